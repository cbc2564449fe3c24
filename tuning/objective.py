"""The tuning objective, run inside Ray Tune trial workers (this module imports no Ray at import
time).

One trial = one :class:`~dart_ray.DecodingConfig` at one batch size, measured **as it is served**:

1. **Throughput of the workload as served.** The trial's prompts are streamed through the
   long-lived engine with at most ``batch_size`` requests in flight (a request joins as soon as
   one finishes — continuous batching, as the server runs). EOS is honoured and answers have
   their natural lengths, capped at ``max_new_tokens`` (never forced). Throughput = generated
   tokens / wall seconds of the engine steps, which include drafting, tree search, verification
   and the adaptive controller. Per-request latency (admission to last token) gives the p95 used
   by the multi-objective search. After every ``report_every`` finished requests the cumulative
   throughput is reported (``ray.tune.report``) so ASHA can stop poor trials early; the final
   (complete) report waits for the load check and the exactness gate below. Time spent inside
   ``report`` is not counted.
2. **Load detection.** Around the measurement the worker times a short fixed-length plain AR
   decode (:class:`LoadProbe`; ``load_probe_tokens``). Its reference is the fastest probe this
   worker has seen (an idle machine is the fastest state). The opening probe is the previous
   trial's closing one when that is under :data:`PROBE_REUSE_S` old (consecutive trials of a
   reused actor: only Tune's hand-over lies between them). When a probe is more than
   ``load_threshold`` slower than the reference, the measurement is re-run once (probing anew);
   if the machine is still loaded the result carries ``load_flag=True`` and the driver does not
   pick it as the best trial (see ``tuning.study``). ``load_drift``, ``ar_probe_tps`` and
   ``reruns`` are always reported.
3. **Exactness gate**, for a trial that survived every ASHA rung (a stopped trial never becomes
   a result, so checking it would only spend the tuning budget). Greedy outputs for a few check
   prompts, decoded with the trial's config and the trial's batch size's knobs (at most as many
   rows as there are check prompts, ``--check-prompts``, 2 by default), must equal plain AR
   outputs token for token. The AR references are computed once per worker (AR engine sharing
   the check target's weights). A mismatch raises :class:`ExactnessError`: the trial errors
   before its final report, so it never becomes a result. When the measuring engine runs in
   bf16/fp16 the check runs on an fp32 copy of the same target + drafter (``check_dtype``),
   because half-precision tree-vs-chain logits differ by rounding alone and would flag benign
   near-ties; the knobs under test are dtype-independent. (The check decodes a fixed number of
   tokens, ignoring EOS, so it compares as many tokens as it can.)

**Engine reuse.** The engine lives in a module-level cache of the worker process, keyed by the
structural :class:`~dart_ray.EngineConfig` (everything but the decoding knobs). Tune runs with
``reuse_actors=True``, so consecutive trials land in the same actor process and only call
``engine.set_decoding(...)``: weights load once per worker. The engine keeps its adaptive
controller (``EngineConfig.adaptive``, on by default): the tuned knobs are its starting point and
cap, so the trial measures what a server with that profile would run.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from dart_ray import DecodingConfig, Engine, EngineConfig, SamplingParams

METRIC = "tokens_per_s"
P95_METRIC = "p95_latency_s"
"""Second objective of ``--objective throughput+p95`` (minimised)."""
PROBE_PROMPT = "The history of computing began with"
LOAD_THRESHOLD = 0.3
"""Default probe slowdown that means "under load". Idle probes on a 2-core KVM guest (AMD EPYC)
spread up to 23 % below the fastest one (a 0.15 threshold flagged idle trials); a competing
CPU-bound process on 2 cores slows the engine about 2x."""
PROBE_REUSE_S = 10.0
"""A load probe this recent (seconds) opens the next trial instead of a new probe."""


class ExactnessError(RuntimeError):
    """A decoding config produced greedy output different from plain AR (a bug, never a result)."""


@dataclass(frozen=True)
class TrialJob:
    """Everything a trial needs besides its knobs (shipped to workers once via
    ``tune.with_parameters``)."""

    engine: dict
    """``EngineConfig.to_dict()`` less ``decoding`` (the knobs are the trial's);
    ``max_batch_size`` covers every tuned batch size."""
    batch_size: int
    """Requests kept in flight (continuous batching)."""
    prompts: tuple[str, ...]
    """Prompts measured per trial (the same ones for every trial of this batch size)."""
    check_prompts: tuple[str, ...]
    """Prompts whose greedy output must equal AR's (the exactness gate)."""
    max_new_tokens: int
    """Cap on generated tokens per request (answers end at EOS before it unless ``ignore_eos``)."""
    base_decoding: dict
    """DecodingConfig fields the trial's knobs are applied onto."""
    chat: bool = False
    """Apply the chat template to prompts."""
    report_every: int = 1
    """Finished requests between incremental reports (ASHA rungs)."""
    check_dtype: str | None = "fp32"
    """dtype of the exactness check (None or equal to the engine dtype: check on the measuring
    engine)."""
    num_threads: int | None = None
    """torch threads of the worker (None: leave as is)."""
    check_max_new_tokens: int | None = None
    """Generated tokens per check prompt (default: ``max_new_tokens``)."""
    ignore_eos: bool = False
    """False (default): EOS ends an answer, as in serving. True: fixed-length answers (old
    objective)."""
    load_probe_tokens: int = 16
    """Tokens of the AR load probe before and after each measurement (0 disables load detection)."""
    load_threshold: float = LOAD_THRESHOLD
    """A probe this much slower than the worker's fastest (share) means the machine is loaded."""

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.max_new_tokens < 1 or self.report_every < 1:
            raise ValueError("batch_size, max_new_tokens and report_every must be >= 1")
        if self.load_probe_tokens < 0 or not 0.0 < self.load_threshold < 1.0:
            raise ValueError("load_probe_tokens must be >= 0 and load_threshold in (0, 1)")

    def engine_config(self) -> EngineConfig:
        return EngineConfig.from_dict(self.engine)

    def params(self) -> SamplingParams:
        return SamplingParams(max_new_tokens=self.max_new_tokens, ignore_eos=self.ignore_eos)

    def check_params(self) -> SamplingParams:
        return SamplingParams(max_new_tokens=self.check_max_new_tokens or self.max_new_tokens,
                              ignore_eos=True)


@dataclass
class StreamResult:
    """What :func:`stream_workload` measured."""

    outputs: list[list[int]]
    """Generated token ids per prompt (prompt order)."""
    tokens: int
    """Generated tokens in all."""
    seconds: float
    """Wall seconds inside the engine's steps (drafting, tree search, verification included)."""
    latencies: list[float] = field(default_factory=list)
    """Per prompt: seconds from its admission (``add_request``) to its last token, same clock."""
    finish_reasons: list[str | None] = field(default_factory=list)
    """Per prompt: ``stop`` (EOS / stop id), ``length`` (hit the cap), ..."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)

    @property
    def p95_latency_s(self) -> float | None:
        return percentile(self.latencies, 95.0)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated ``q``-th percentile (None for no values)."""
    xs = sorted(values)
    if not xs:
        return None
    k = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def stream_workload(engine: Engine, prompts: Sequence[str], batch_size: int, params: SamplingParams,
                    chat: bool = False,
                    on_progress: Callable[[StreamResult, int], None] | None = None,
                    report_every: int = 1) -> StreamResult:
    """Decode ``prompts`` keeping at most ``batch_size`` in flight (a prompt joins as soon as one
    finishes). ``on_progress(result_so_far, done)`` runs after every ``report_every`` finished
    requests and after the last one; its own run time is excluded from seconds and latencies."""
    if batch_size > engine.max_batch:
        raise ValueError(f"batch size {batch_size} exceeds the engine's max_batch_size "
                         f"{engine.max_batch}")
    pending = deque(enumerate(prompts))
    index: dict[str, int] = {}
    res = StreamResult([[] for _ in prompts], 0, 0.0, [0.0] * len(prompts), [None] * len(prompts))
    started: dict[int, float] = {}
    done = 0
    t0 = time.perf_counter()

    def clock() -> float:                     # engine seconds so far (report time excluded)
        return res.seconds + time.perf_counter() - t0

    while pending or index:
        while pending and len(index) < batch_size:
            i, p = pending.popleft()
            index[engine.add_request(p, params, chat=chat)] = i
            started[i] = clock()
        for o in engine.step(detokenize=bool(params.stop)):  # text off the step, as served
            i = index.get(o.request_id)
            if i is None:
                continue
            res.outputs[i].extend(o.new_token_ids)
            res.tokens += len(o.new_token_ids)
            if o.finished:
                del index[o.request_id]
                res.latencies[i] = clock() - started[i]
                res.finish_reasons[i] = o.finish_reason
                done += 1
                if on_progress is not None and (done % report_every == 0 or done == len(prompts)):
                    res.seconds = clock()
                    on_progress(res, done)
                    t0 = time.perf_counter()
    res.seconds = clock()
    return res


def stream_batched(engine: Engine, prompts: Sequence[str], batch_size: int, params: SamplingParams,
                   chat: bool = False, on_progress: Callable[[int, int, float], None] | None = None,
                   report_every: int = 1) -> tuple[list[list[int]], int, float]:
    """:func:`stream_workload` as a tuple (token ids per prompt, generated tokens, engine seconds);
    ``on_progress(done, tokens, seconds)``."""
    cb = None if on_progress is None else (lambda r, done: on_progress(done, r.tokens, r.seconds))
    r = stream_workload(engine, prompts, batch_size, params, chat, cb, report_every)
    return r.outputs, r.tokens, r.seconds


@dataclass
class LoadProbe:
    """A short fixed-length plain AR decode at batch 1 whose speed tracks the machine's load."""

    tokens: int = 16
    """Tokens per probe (0 disables)."""
    reference: float | None = None
    """The fastest probe so far (tokens/s): this worker's idle-machine speed."""
    last: float | None = None
    """The latest probe (tokens/s)."""
    at: float | None = None
    """When the latest probe ended (``time.monotonic()``)."""

    def measure(self, ar_engine: Engine) -> float | None:
        """Best of two probes, tokens/s; updates ``reference``. None when disabled."""
        if self.tokens <= 0:
            return None
        params = SamplingParams(max_new_tokens=self.tokens, ignore_eos=True)
        best = math.inf
        for _ in range(2):
            t0 = time.perf_counter()
            ar_engine.generate(PROBE_PROMPT, params)
            best = min(best, time.perf_counter() - t0)
        self.last = self.tokens / max(best, 1e-9)
        self.at = time.monotonic()
        self.reference = self.last if self.reference is None else max(self.reference, self.last)
        return self.last

    def slowdown(self, tps: float | None) -> float:
        """How much slower than the reference ``tps`` is (share; 0 when disabled or faster)."""
        if tps is None or not self.reference:
            return 0.0
        return max(0.0, 1.0 - tps / self.reference)


class WorkerState:
    """A worker's long-lived engines: the measuring engine, and the exactness-check pair."""

    def __init__(self, cfg: EngineConfig, check_dtype: str | None = "fp32",
                 check_batch: int = 4) -> None:
        from dart_ray.drafters import NoDrafter, make_drafter
        from dart_ray.models import load_target

        self.config = cfg
        self.engine = Engine.from_config(cfg)
        cfg = self.engine.config                      # dtype "auto" resolved for this machine
        if check_dtype and check_dtype != cfg.dtype:
            ccfg = cfg.replace(dtype=check_dtype,
                               max_batch_size=max(1, min(check_batch, cfg.max_batch_size)))
            target = load_target(ccfg.model, ccfg.dtype, ccfg.device, ccfg.max_seq_len)
            self.check_engine = Engine(target, make_drafter(ccfg, target), ccfg)
        else:
            ccfg = cfg
            self.check_engine = self.engine
        self.ar = Engine(self.check_engine.target, NoDrafter(),
                         ccfg.replace(method="none", max_batch_size=1))
        self._ar_cache: dict[tuple, list[int]] = {}
        self._probe_engine: Engine | None = self.ar if self.check_engine is self.engine else None
        self.probe = LoadProbe()

    @property
    def probe_engine(self) -> Engine:
        """Plain AR at batch 1 on the *measuring* target (its dtype), built on first use."""
        if self._probe_engine is None:
            from dart_ray.drafters import NoDrafter

            cfg = self.engine.config
            self._probe_engine = Engine(self.engine.target, NoDrafter(),
                                        cfg.replace(method="none", max_batch_size=1))
        return self._probe_engine

    def measure_load(self, tokens: int, reuse_within_s: float = 0.0) -> float | None:
        """One load probe (tokens/s of plain AR here and now); None when ``tokens`` is 0. The
        latest probe stands in when it probed as many tokens under ``reuse_within_s`` ago."""
        p = self.probe
        if (reuse_within_s > 0 and p.tokens == tokens and p.last is not None and p.at is not None
                and time.monotonic() - p.at <= reuse_within_s):
            return p.last
        p.tokens = tokens
        return p.measure(self.probe_engine)

    @property
    def check_batch(self) -> int:
        return self.check_engine.max_batch

    def ar_reference(self, prompts: Sequence[str], params: SamplingParams,
                     chat: bool) -> list[list[int]]:
        """Plain AR greedy outputs (batch 1), computed once per (prompt, length, chat) per
        worker."""
        out = []
        for p in prompts:
            key = (p, params.max_new_tokens, params.ignore_eos, chat)
            if key not in self._ar_cache:
                self._ar_cache[key] = list(self.ar.generate(p, params, chat=chat)[0].token_ids)
            out.append(self._ar_cache[key])
        return out

    def check_exact(self, decoding: DecodingConfig, prompts: Sequence[str], params: SamplingParams,
                    batch_size: int, chat: bool = False) -> None:
        """Raise :class:`ExactnessError` unless greedy outputs under ``decoding`` equal AR's."""
        if not prompts:
            return
        ref = self.ar_reference(prompts, params, chat)
        eng = self.check_engine
        eng.set_decoding(decoding)
        got, _, _ = stream_batched(eng, prompts, min(batch_size, eng.max_batch), params, chat)
        bad = [i for i, (a, b) in enumerate(zip(got, ref, strict=True)) if a != b]
        if bad:
            i = bad[0]
            pos = next((k for k, (x, y) in enumerate(zip(got[i], ref[i], strict=False)) if x != y),
                       min(len(got[i]), len(ref[i])))
            raise ExactnessError(
                f"decoding config breaks exactness: {len(bad)}/{len(prompts)} check prompts differ "
                f"from AR (first at prompt {i}, token {pos}) with batch size {batch_size}, config "
                f"{decoding.to_dict()}")


_STATE: dict = {}


def worker_state(cfg: EngineConfig, check_dtype: str | None, check_batch: int) -> WorkerState:
    """The process-wide WorkerState for ``cfg`` (built on first use; rebuilt only if ``cfg``
    changes)."""
    key = (dataclasses.replace(cfg, decoding=DecodingConfig()), check_dtype, check_batch)
    if _STATE.get("key") != key:
        _STATE.pop("state", None)
        st = WorkerState(cfg, check_dtype, check_batch)
        st.engine.generate("Hello", SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up
        _STATE.update(key=key, state=st, builds=_STATE.get("builds", 0) + 1, uses=0)
    _STATE["uses"] += 1
    return _STATE["state"]


def _measure(state: WorkerState, decoding: DecodingConfig, job: TrialJob,
             report: Callable[[dict], None] | None) -> dict:
    """One throughput measurement of ``decoding``; incremental (non-final) results go to
    ``report``."""
    eng = state.engine
    eng.set_decoding(decoding)
    eng.reset_stats()
    n = len(job.prompts)
    last: dict = {}

    def progress(res: StreamResult, done: int) -> None:
        last.clear()
        last.update(_metrics(eng, job, res, done, n))
        if report is not None and done < n:
            report(dict(last))

    stream_workload(eng, job.prompts, job.batch_size, job.params(), job.chat, progress,
                    job.report_every)
    return last


def _metrics(eng: Engine, job: TrialJob, res: StreamResult, done: int, n: int) -> dict:
    st = eng.stats()
    finished = [r for r in res.finish_reasons if r is not None]
    return {METRIC: res.tokens_per_s, P95_METRIC: res.p95_latency_s if finished else None,
            "tau": st.mean_accepted_len, "prompts_done": done, "tokens": res.tokens,
            "seconds": res.seconds, "mean_new_tokens": res.tokens / max(done, 1),
            "eos_finished": sum(r == "stop" for r in finished), "complete": done == n,
            "batch_size": job.batch_size, "worker_pid": os.getpid(),
            "engine_builds": _STATE.get("builds", 0), "engine_uses": _STATE.get("uses", 0),
            **{f"{k}_ms": v for k, v in st.time_split_ms().items()}}


def evaluate_config(state: WorkerState, decoding: DecodingConfig, job: TrialJob,
                    report: Callable[[dict], None] | None = None) -> dict:
    """Measure the workload (re-run once under load), then gate on exactness; ``report`` receives
    incremental metrics and, last, the final result (which is also returned). A trial that ASHA
    stops ends inside ``report`` and is never gated (it is never a result)."""
    import torch

    if job.num_threads:
        torch.set_num_threads(job.num_threads)
    result, drift, reruns = {}, 0.0, 0
    for attempt in range(2):
        # the first attempt may open with the previous trial's closing probe; a re-run probes anew
        before = state.measure_load(job.load_probe_tokens,
                                    reuse_within_s=PROBE_REUSE_S if attempt == 0 else 0.0)
        result = _measure(state, decoding, job, report if attempt == 0 else None)
        after = state.measure_load(job.load_probe_tokens)
        drift = max(state.probe.slowdown(before), state.probe.slowdown(after))
        if drift <= job.load_threshold:
            break
        reruns = 1 if attempt == 0 else reruns        # loaded: measure once more, then flag
    state.check_exact(decoding, job.check_prompts, job.check_params(), job.batch_size, job.chat)
    result.update({"load_drift": drift, "load_flag": drift > job.load_threshold, "reruns": reruns,
                   "ar_probe_tps": state.probe.last, "ar_reference_tps": state.probe.reference})
    if report is not None:
        report(dict(result))
    return result


def trainable(config: dict, job: TrialJob) -> None:
    """Ray Tune function trainable: ``config`` holds this trial's knob values."""
    from ray import tune

    cfg = job.engine_config()
    state = worker_state(cfg, job.check_dtype, len(job.check_prompts) or 1)
    decoding = DecodingConfig.from_dict({**job.base_decoding, **config})
    evaluate_config(state, decoding, job, report=tune.report)
