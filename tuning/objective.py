"""The tuning objective, run inside Ray Tune trial workers (this module imports no Ray at import time).

One trial = one :class:`~dart_ray.DecodingConfig` at one batch size:

1. **Exactness gate.** Greedy outputs for a few check prompts, decoded with the trial's config at
   the trial's batch size, must equal plain AR outputs token for token. The AR references are
   computed once per worker (AR engine sharing the check target's weights). A mismatch raises
   :class:`ExactnessError`: the trial errors, it never becomes a result. When the measuring
   engine runs in bf16/fp16 the check runs on an fp32 copy of the same target + drafter
   (``check_dtype``), because half-precision tree-vs-chain logits differ by rounding alone and
   would flag benign near-ties; the knobs under test are dtype-independent.
2. **Throughput.** The trial's prompts are streamed through the long-lived engine with at most
   ``batch_size`` requests in flight (a request joins as soon as one finishes — continuous
   batching, as the server runs). After every ``report_every`` finished requests the cumulative
   generated tokens / engine seconds is reported (``ray.tune.report``) so ASHA can stop poor
   trials early. Time spent inside ``report`` is not counted.

**Engine reuse.** The engine lives in a module-level cache of the worker process, keyed by the
structural :class:`~dart_ray.EngineConfig` (everything but the decoding knobs). Tune runs with
``reuse_actors=True``, so consecutive trials land in the same actor process and only call
``engine.set_decoding(...)``: weights load once per worker.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dart_ray import DecodingConfig, Engine, EngineConfig, SamplingParams

METRIC = "tokens_per_s"


class ExactnessError(RuntimeError):
    """A decoding config produced greedy output different from plain AR (a bug, never a result)."""


@dataclass(frozen=True)
class TrialJob:
    """Everything a trial needs besides its knobs (shipped to workers once via ``tune.with_parameters``)."""

    engine: dict
    """EngineConfig fields (``decoding`` excluded); ``max_batch_size`` covers every tuned batch size."""
    batch_size: int
    prompts: tuple[str, ...]
    """Prompts measured per trial (the same ones for every trial of this batch size)."""
    check_prompts: tuple[str, ...]
    max_new_tokens: int
    base_decoding: dict
    chat: bool = False
    report_every: int = 1
    check_dtype: str | None = "fp32"
    """dtype of the exactness check (None or equal to the engine dtype: check on the measuring engine)."""
    num_threads: int | None = None
    check_max_new_tokens: int | None = None
    """Generated tokens per check prompt (default: ``max_new_tokens``)."""

    def engine_config(self) -> EngineConfig:
        return EngineConfig(**self.engine)

    def params(self) -> SamplingParams:
        return SamplingParams(max_new_tokens=self.max_new_tokens, ignore_eos=True)

    def check_params(self) -> SamplingParams:
        return SamplingParams(max_new_tokens=self.check_max_new_tokens or self.max_new_tokens, ignore_eos=True)


def stream_batched(engine: Engine, prompts: Sequence[str], batch_size: int, params: SamplingParams,
                   chat: bool = False, on_progress: Callable[[int, int, float], None] | None = None,
                   report_every: int = 1) -> tuple[list[list[int]], int, float]:
    """Decode ``prompts`` keeping at most ``batch_size`` in flight; returns (token ids per prompt,
    generated tokens, engine seconds). ``on_progress(done, tokens, seconds)`` runs after every
    ``report_every`` finished requests and after the last one; its own run time is excluded."""
    if batch_size > engine.max_batch:
        raise ValueError(f"batch size {batch_size} exceeds the engine's max_batch_size {engine.max_batch}")
    pending = deque(enumerate(prompts))
    index: dict[str, int] = {}
    outs: list[list[int]] = [[] for _ in prompts]
    tokens = done = 0
    elapsed = 0.0
    t0 = time.perf_counter()
    while pending or index:
        while pending and len(index) < batch_size:
            i, p = pending.popleft()
            index[engine.add_request(p, params, chat=chat)] = i
        for o in engine.step():
            i = index.get(o.request_id)
            if i is None:
                continue
            outs[i].extend(o.new_token_ids)
            tokens += len(o.new_token_ids)
            if o.finished:
                del index[o.request_id]
                done += 1
                if on_progress is not None and (done % report_every == 0 or done == len(prompts)):
                    elapsed += time.perf_counter() - t0
                    on_progress(done, tokens, elapsed)
                    t0 = time.perf_counter()
    elapsed += time.perf_counter() - t0
    return outs, tokens, elapsed


class WorkerState:
    """A worker's long-lived engines: the measuring engine, and the exactness-check pair."""

    def __init__(self, cfg: EngineConfig, check_dtype: str | None = "fp32", check_batch: int = 4) -> None:
        from dart_ray.drafters import NoDrafter, make_drafter
        from dart_ray.models import load_target

        self.config = cfg
        self.engine = Engine.from_config(cfg)
        cfg = self.engine.config                      # dtype "auto" resolved for this machine
        if check_dtype and check_dtype != cfg.dtype:
            ccfg = cfg.replace(dtype=check_dtype, max_batch_size=max(1, min(check_batch, cfg.max_batch_size)))
            target = load_target(ccfg.model, ccfg.dtype, ccfg.device, ccfg.max_seq_len)
            self.check_engine = Engine(target, make_drafter(ccfg, target), ccfg)
        else:
            ccfg = cfg
            self.check_engine = self.engine
        self.ar = Engine(self.check_engine.target, NoDrafter(), ccfg.replace(method="none", max_batch_size=1))
        self._ar_cache: dict[tuple, list[int]] = {}

    @property
    def check_batch(self) -> int:
        return self.check_engine.max_batch

    def ar_reference(self, prompts: Sequence[str], params: SamplingParams, chat: bool) -> list[list[int]]:
        """Plain AR greedy outputs (batch 1), computed once per (prompt, length, chat) per worker."""
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
        bad = [i for i, (a, b) in enumerate(zip(got, ref)) if a != b]
        if bad:
            i = bad[0]
            pos = next((k for k, (x, y) in enumerate(zip(got[i], ref[i])) if x != y), min(len(got[i]), len(ref[i])))
            raise ExactnessError(
                f"decoding config breaks exactness: {len(bad)}/{len(prompts)} check prompts differ from AR "
                f"(first at prompt {i}, token {pos}) with batch size {batch_size}, config {decoding.to_dict()}")


_STATE: dict = {}


def worker_state(cfg: EngineConfig, check_dtype: str | None, check_batch: int) -> WorkerState:
    """The process-wide WorkerState for ``cfg`` (built on first use; rebuilt only if ``cfg`` changes)."""
    key = (dataclasses.replace(cfg, decoding=DecodingConfig()), check_dtype, check_batch)
    if _STATE.get("key") != key:
        _STATE.pop("state", None)
        st = WorkerState(cfg, check_dtype, check_batch)
        st.engine.generate("Hello", SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up
        _STATE.update(key=key, state=st, builds=_STATE.get("builds", 0) + 1, uses=0)
    _STATE["uses"] += 1
    return _STATE["state"]


def evaluate_config(state: WorkerState, decoding: DecodingConfig, job: TrialJob,
                    report: Callable[[dict], None] | None = None) -> dict:
    """Gate on exactness, then measure throughput; ``report`` receives incremental metrics."""
    import torch

    if job.num_threads:
        torch.set_num_threads(job.num_threads)
    params = job.params()
    state.check_exact(decoding, job.check_prompts, job.check_params(), job.batch_size, job.chat)
    eng = state.engine
    eng.set_decoding(decoding)
    eng.reset_stats()
    n = len(job.prompts)
    last: dict = {}

    def progress(done: int, tokens: int, seconds: float) -> None:
        st = eng.stats()
        last.clear()
        last.update({METRIC: tokens / max(seconds, 1e-9), "tau": st.mean_accepted_len,
                     "prompts_done": done, "tokens": tokens, "seconds": seconds,
                     "complete": done == n, "batch_size": job.batch_size,
                     "worker_pid": os.getpid(), "engine_builds": _STATE.get("builds", 0),
                     "engine_uses": _STATE.get("uses", 0),
                     **{f"{k}_ms": v for k, v in st.time_split_ms().items()}})
        if report is not None:
            report(dict(last))

    stream_batched(eng, job.prompts, job.batch_size, params, job.chat, progress, job.report_every)
    return last


def trainable(config: dict, job: TrialJob) -> None:
    """Ray Tune function trainable: ``config`` holds this trial's knob values."""
    from ray import tune

    cfg = job.engine_config()
    state = worker_state(cfg, job.check_dtype, len(job.check_prompts) or 1)
    decoding = DecodingConfig.from_dict({**job.base_decoding, **config})
    evaluate_config(state, decoding, job, report=tune.report)
