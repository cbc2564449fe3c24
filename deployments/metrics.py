"""Prometheus text exposition (format 0.0.4) of one replica, with vLLM's metric names and semantics.

Every vLLM (v1 engine) metric that applies to this server is exported under its vLLM name, so
vLLM dashboards and alerts work unchanged; ``dart_ray:`` names carry what vLLM has no name for
(tree sizes, errors by status, aborted requests) and the names earlier versions exported.

Two exposition formats, negotiated by ``Accept`` (:func:`wants_openmetrics`): OpenMetrics 1.0 (what
Prometheus asks for first), where ``# TYPE``/``# HELP`` name a counter family without ``_total`` and
its sample carries the suffix; and the classic text format 0.0.4 (curl, older scrapers), where those
lines name the ``_total`` sample as that format's parsers expect (``prometheus_client`` writes the
same; its 0.0.4 parser then reports the family without ``_total``). Samples are identical in both.

Families:

* gauges: ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` (waiting = beyond the free
  batch rows, see :class:`~dart_ray.engine.async_engine.AsyncEngine`), ``vllm:kv_cache_usage_perc``
  (committed KV slots / (rows x max_model_len) over the lanes: the static cache is allocated once,
  this is the share of it requests hold);
* counters: ``vllm:prompt_tokens``, ``vllm:generation_tokens``,
  ``vllm:request_success{finished_reason}`` (stop / length / abort), ``vllm:num_preemptions``
  (always 0: rows are never preempted), ``vllm:spec_decode_num_drafts``,
  ``vllm:spec_decode_num_draft_tokens``, ``vllm:spec_decode_num_accepted_tokens``,
  ``vllm:spec_decode_num_accepted_tokens_per_pos{position}``;
* histograms: ``vllm:time_to_first_token_seconds``, ``vllm:e2e_request_latency_seconds``,
  ``vllm:inter_token_latency_seconds`` (and its older name ``vllm:time_per_output_token_seconds``),
  ``vllm:request_time_per_output_token_seconds``, ``vllm:request_queue_time_seconds``,
  ``vllm:request_prefill_time_seconds``, ``vllm:request_decode_time_seconds``,
  ``vllm:request_inference_time_seconds``, ``vllm:request_prompt_tokens``,
  ``vllm:request_generation_tokens``, ``vllm:request_params_max_tokens``,
  ``vllm:request_max_num_generation_tokens``, ``vllm:request_params_n``,
  ``vllm:iteration_tokens_total``;
* ``dart_ray:request_errors{status}`` and ``dart_ray:request_retries`` are the ingress's
  (:class:`IngressMetrics`): the replica that answers HTTP counts them, under its own labels.

Not exported (no counterpart here): prefix-cache hits/queries (no prefix cache), LoRA info,
``cache_config_info`` (no paged blocks).

**Draft tokens of a tree.** vLLM's acceptance rate is ``accepted / draft_tokens`` and its mean
acceptance length ``1 + accepted / drafts``, with ``draft_tokens`` = positions speculated per draft
(``num_speculative_tokens``). A DART tree speculates ``depth`` positions along many branches; at
most ``depth`` of its nodes can be accepted. So here a *draft* is one row in one step with a
non-empty tree, its *draft tokens* are the tree's depth (the longest root-to-leaf path: the
drafter's ``draft_depth``, or a prompt-lookup path's ``lookup_len`` where DART merged a deeper
one in, so a step's draft tokens can exceed ``draft_depth``), and
``accepted_per_pos[i]`` counts drafts whose accepted path reached position ``i``: every vLLM
formula keeps its meaning (the rate stays in [0, 1]). The number of tree nodes verified is
``dart_ray:spec_decode_tree_nodes_total``.

Labels on every series: ``model_name``, and (when given) ``replica`` (Serve replica id) and
``node`` (Ray node id), so several replicas can be scraped into one Prometheus without clashing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

# vLLM's buckets (vllm/v1/metrics/loggers.py), so quantiles line up with vLLM dashboards
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
# dart_ray:request_latency_seconds keeps its earlier buckets
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)

FINISH_REASONS = ("stop", "length", "abort")
"""vLLM's finished_reason values (every one is exported, zeros included)."""

VLLM_METRICS = (
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success", "vllm:num_preemptions",
    "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_per_pos",
    "vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
    "vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds",
    "vllm:request_time_per_output_token_seconds", "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
    "vllm:request_inference_time_seconds", "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens", "vllm:request_params_max_tokens",
    "vllm:request_max_num_generation_tokens", "vllm:request_params_n",
    "vllm:iteration_tokens_total",
)
"""Every vLLM metric family this module exports (family names, as ``# TYPE`` lines give them)."""


def _fmt(v: float) -> str:
    if v == float("inf"):
        return "+Inf"
    if float(v).is_integer():
        return f"{int(v)}.0" if abs(v) < 1e15 else repr(float(v))
    return repr(float(v))


def _labels(d: dict) -> str:
    if not d:
        return ""

    def esc(v) -> str:
        return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')

    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in d.items()) + "}"


def _replica_labels(replica: str | None, node: str | None) -> dict[str, str]:
    """``replica`` / ``node`` labels, those that are known."""
    return {k: v for k, v in (("replica", replica), ("node", node)) if v is not None}


def token_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's 1-2-5 buckets up to ``max_model_len`` (request token-count histograms)."""
    out, mag = [], 1
    while True:
        for m in (1, 2, 5):
            v = m * mag
            if v > max_model_len:
                return tuple(out)
            out.append(v)
        mag *= 10


class Histogram:
    def __init__(self, buckets: Iterable[float]) -> None:
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * len(self.buckets)
        self.sum = 0.0
        self.count = 0
        self._lock = threading.Lock()

    def observe(self, v: float) -> None:
        with self._lock:
            self.sum += v
            self.count += 1
            for i, b in enumerate(self.buckets):
                if v <= b:
                    self.counts[i] += 1

    def lines(self, name: str, labels: dict) -> list[str]:
        out = []
        with self._lock:
            for b, c in zip(self.buckets, self.counts, strict=True):
                out.append(f"{name}_bucket{_labels({**labels, 'le': _fmt(b)})} {_fmt(c)}")
            out.append(f"{name}_bucket{_labels({**labels, 'le': '+Inf'})} {_fmt(self.count)}")
            out.append(f"{name}_sum{_labels(labels)} {_fmt(self.sum)}")
            out.append(f"{name}_count{_labels(labels)} {_fmt(self.count)}")
        return out


def _spec_totals(engine_stats: dict, num_positions: int) -> dict:
    """vLLM spec-decode counters summed over the speculating lanes (``engine_stats``: lane ->
    (method, EngineStats as dict)); see the module docstring for the tree semantics."""
    spec = [s for m, s in engine_stats.values() if m != "none"]
    per_pos: list[int] = []
    for s in spec:
        for i, v in enumerate(s.get("accepted_per_depth", [])):
            if i >= len(per_pos):
                per_pos.append(0)
            per_pos[i] += v
    per_pos.extend([0] * max(0, num_positions - len(per_pos)))
    return {
        "drafts": sum(s.get("spec_row_steps", s.get("row_steps", 0)) for s in spec),
        "draft_tokens": sum(s.get("draft_depth_tokens", 0) for s in spec),
        "accepted": sum(s.get("accepted_tokens", 0) for s in spec),
        "tree_nodes": sum(s.get("draft_tokens", 0) for s in spec),
        "row_steps": sum(s.get("row_steps", 0) for s in spec),
        "per_pos": per_pos,
    }


class ServerMetrics:
    """Edge-side counters and histograms of one engine replica (updated from its event loop; the
    histograms are locked because ``observe_iteration`` runs on the engine thread). Errors are
    not counted here: the ingress answers HTTP and counts them (:class:`IngressMetrics`)."""

    def __init__(self, model_name: str, replica: str | None = None, node: str | None = None,
                 max_model_len: int = 2048) -> None:
        self.labels = {"model_name": model_name, **_replica_labels(replica, node)}
        tok = token_buckets(max_model_len)
        # vLLM histograms
        self.ttft = Histogram(TTFT_BUCKETS)
        self.e2e = Histogram(REQUEST_LATENCY_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.tpot = Histogram(ITL_BUCKETS)
        self.queue_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.prefill_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.decode_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.inference_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.prompt_len = Histogram(tok)
        self.generation_len = Histogram(tok)
        self.max_tokens = Histogram(tok)
        self.max_num_gen = Histogram(tok)
        self.n_param = Histogram(N_BUCKETS)
        self.iteration_tokens = Histogram(ITERATION_TOKEN_BUCKETS)
        # dart_ray histograms (earlier names; TTFT is the vLLM histogram under its earlier name too)
        self.latency = Histogram(LATENCY_BUCKETS)
        self.requests: dict[str, int] = {r: 0 for r in FINISH_REASONS}   # finish reason -> count
        self.generation_tokens = 0
        """Tokens streamed to clients (what their usage counts; a step the engine ran past a stop
        string is not streamed, so the engine's own count can be larger)."""
        self.aborted = 0                        # clients that went away mid-request

    # ---- recording ---------------------------------------------------------------------------
    def first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def generated(self, num_tokens: int) -> None:
        """A request's delta carried ``num_tokens`` tokens to its client."""
        self.generation_tokens += num_tokens

    def inter_token(self, gap_s: float) -> None:
        """Time between two consecutive outputs of one request (one engine step: with speculation
        it may carry several tokens, as vLLM's inter-token latency does)."""
        self.itl.observe(gap_s)

    def observe_iteration(self, num_tokens: int) -> None:
        """Tokens one engine step processed (prompt + generated); called on the engine thread."""
        if num_tokens > 0:
            self.iteration_tokens.observe(num_tokens)

    def finished(self, reason: str, latency_s: float, num_prompt: int, num_completion: int,
                 timing=None, first_token_s: float | None = None, end_s: float | None = None,
                 max_tokens: int | None = None) -> None:
        """A request ended (``reason``: stop / length / abort). ``timing``: its
        :class:`~dart_ray.engine.async_engine.RequestTiming`; ``first_token_s`` / ``end_s``: when
        its first output / its end reached the server (``time.perf_counter()``)."""
        self.requests[reason] = self.requests.get(reason, 0) + 1
        self.latency.observe(latency_s)
        self.e2e.observe(latency_s)
        self.prompt_len.observe(num_prompt)
        self.generation_len.observe(num_completion)
        self.n_param.observe(1)
        if max_tokens is not None:
            self.max_tokens.observe(max_tokens)
            self.max_num_gen.observe(max_tokens)    # n = 1: the largest max_tokens of its sequences
        if timing is not None and timing.scheduled is not None and timing.submitted is not None:
            self.queue_time.observe(max(0.0, timing.scheduled - timing.submitted))
            if timing.first_token is not None:
                self.prefill_time.observe(max(0.0, timing.first_token - timing.scheduled))
            if end_s is not None:
                self.inference_time.observe(max(0.0, end_s - timing.scheduled))
        if first_token_s is not None and end_s is not None:
            decode = max(0.0, end_s - first_token_s)
            self.decode_time.observe(decode)
            if num_completion > 1:
                self.tpot.observe(decode / (num_completion - 1))

    # ---- exposition ------------------------------------------------------------------------------
    def render(self, engine_stats: dict, queue_depth: int, num_running: int, num_positions: int,
               kv_cache_usage: float = 0.0, openmetrics: bool = False,
               ingress: dict | None = None, step_errors: int = 0) -> str:
        """``engine_stats``: lane -> (method, EngineStats as dict); ``num_positions``: draft
        positions to list in ``accepted_per_pos`` even when none was accepted yet (the server passes
        the deepest position a tree reaches in the schedules its lanes decode with, a loaded
        profile's included: ``deployments.serving.draft_positions``);
        ``openmetrics``: OpenMetrics 1.0 text instead of the 0.0.4 text format;
        ``ingress``: :meth:`IngressMetrics.snapshot` of the ingress replica that asked, whose error
        and retry counters are listed under that replica's labels; ``step_errors``: engine steps
        that failed (each ended the requests of its step)."""
        L = self.labels
        IL = {"model_name": L["model_name"], **(ingress or {}).get("labels", {})}
        ingress_errors = sorted((ingress or {}).get("errors", {}).items())
        out: list[str] = []

        def family(name: str, kind: str, help: str, samples: list[tuple[dict, float]]) -> None:
            sample = name + "_total" if kind == "counter" else name
            meta = name if openmetrics else sample
            out.append(f"# HELP {meta} {help}")
            out.append(f"# TYPE {meta} {kind}")
            for labels, v in samples:
                out.append(f"{sample}{_labels(labels)} {_fmt(v)}")

        def histogram(name: str, help: str, h: Histogram) -> None:
            out.append(f"# HELP {name} {help}")
            out.append(f"# TYPE {name} histogram")
            out.extend(h.lines(name, L))

        sp = _spec_totals(engine_stats, num_positions)
        gen = self.generation_tokens
        prompt = sum(s.get("prompt_tokens", 0) for _, s in engine_stats.values())

        # ---- vLLM: scheduler state
        family("vllm:num_requests_running", "gauge",
               "Number of requests in model execution batches.",
               [(L, num_running)])
        family("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
               [(L, queue_depth)])
        family("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
               [(L, kv_cache_usage)])
        # ---- vLLM: counters
        family("vllm:num_preemptions", "counter",
               "Cumulative number of preemption from the engine.", [(L, 0)])
        family("vllm:prompt_tokens", "counter", "Number of prefill tokens processed.",
               [(L, prompt)])
        family("vllm:generation_tokens", "counter", "Number of generation tokens processed.",
               [(L, gen)])
        family("vllm:request_success", "counter", "Count of successfully processed requests.",
               [({**L, "finished_reason": k}, v) for k, v in sorted(self.requests.items())])
        family("vllm:spec_decode_num_drafts", "counter",
               "Number of spec decoding drafts (a row in a step with a non-empty draft tree).",
               [(L, sp["drafts"])])
        family("vllm:spec_decode_num_draft_tokens", "counter",
               "Number of draft tokens (per draft: the tree depth, i.e. positions speculated).",
               [(L, sp["draft_tokens"])])
        family("vllm:spec_decode_num_accepted_tokens", "counter", "Number of accepted tokens.",
               [(L, sp["accepted"])])
        family("vllm:spec_decode_num_accepted_tokens_per_pos", "counter",
               "Accepted tokens per draft position.",
               [({**L, "position": str(i)}, v) for i, v in enumerate(sp["per_pos"])])
        # ---- vLLM: histograms
        histogram("vllm:time_to_first_token_seconds",
                  "Histogram of time to first token in seconds.", self.ttft)
        histogram("vllm:e2e_request_latency_seconds",
                  "Histogram of e2e request latency in seconds.", self.e2e)
        histogram("vllm:inter_token_latency_seconds",
                  "Histogram of inter-token latency in seconds.", self.itl)
        histogram("vllm:time_per_output_token_seconds",
                  "Histogram of time per output token in seconds "
                  "(older name of inter_token_latency).", self.itl)
        histogram("vllm:request_time_per_output_token_seconds",
                  "Histogram of time_per_output_token_seconds per request.", self.tpot)
        histogram("vllm:request_queue_time_seconds",
                  "Histogram of time spent in WAITING phase for request.", self.queue_time)
        histogram("vllm:request_prefill_time_seconds",
                  "Histogram of time spent in PREFILL phase for request.", self.prefill_time)
        histogram("vllm:request_decode_time_seconds",
                  "Histogram of time spent in DECODE phase for request.", self.decode_time)
        histogram("vllm:request_inference_time_seconds",
                  "Histogram of time spent in RUNNING phase for request.", self.inference_time)
        histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                  self.prompt_len)
        histogram("vllm:request_generation_tokens", "Number of generation tokens processed.",
                  self.generation_len)
        histogram("vllm:request_params_max_tokens",
                  "Histogram of the max_tokens request parameter.", self.max_tokens)
        histogram("vllm:request_max_num_generation_tokens",
                  "Histogram of maximum number of requested generation tokens.", self.max_num_gen)
        histogram("vllm:request_params_n", "Histogram of the n request parameter.", self.n_param)
        histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                  self.iteration_tokens)

        # ---- dart_ray: what vLLM has no name for, and the earlier names
        family("dart_ray:spec_decode_tree_nodes", "counter",
               "Draft tree nodes verified (all branches), speculating lanes.",
               [(L, sp["tree_nodes"])])
        family("dart_ray:generation_tokens", "counter", "Tokens generated by the engines.",
               [(L, gen)])
        family("dart_ray:prompt_tokens", "counter", "Prompt tokens prefilled by the engines.",
               [(L, prompt)])
        family("dart_ray:queue_depth", "gauge", "Requests waiting for a batch row.",
               [(L, queue_depth)])
        family("dart_ray:num_running", "gauge", "Requests holding a batch row.", [(L, num_running)])
        rows = sp["row_steps"]
        family("dart_ray:mean_accepted_len", "gauge",
               "Tokens committed per row-step (accepted + bonus) since start, speculating lanes.",
               [(L, (sp["accepted"] + rows) / rows if rows else 0.0)])
        family("dart_ray:request_success", "counter", "Finished requests by finish reason.",
               [({**L, "finished_reason": k}, v) for k, v in sorted(self.requests.items())])
        family("dart_ray:request_errors", "counter", "Requests answered with an error, by status.",
               [({**IL, "status": k}, v) for k, v in ingress_errors])
        family("dart_ray:request_retries", "counter",
               "Requests resubmitted to another engine replica after theirs was lost "
               "before any output.",
               [(IL, ingress["retries"])] if ingress is not None else [])
        family("dart_ray:engine_step_errors", "counter",
               "Engine steps that failed (each ended every request of its step with an error).",
               [(L, step_errors)])
        family("dart_ray:request_aborted", "counter",
               "Requests aborted because the client went away.",
               [(L, self.aborted)])
        histogram("dart_ray:request_latency_seconds", "End-to-end request latency.", self.latency)
        histogram("dart_ray:time_to_first_token_seconds", "Time to the first generated token.",
                  self.ttft)
        if openmetrics:
            out.append("# EOF")
        return "\n".join(out) + "\n"


class IngressMetrics:
    """Counters of one ingress replica (the HTTP side, which holds no engine): error responses by
    status (every one the server answers, in-band SSE errors included) and transparent retries.
    They are rendered by the engine replica that serves a scrape (``ServerMetrics.render(...,
    ingress=snapshot())``), under the ingress replica's own ``replica`` / ``node`` labels."""

    def __init__(self, replica: str | None = None, node: str | None = None) -> None:
        self.labels = _replica_labels(replica, node)
        self.errors: dict[str, int] = {}          # HTTP status -> count
        self.retries = 0

    def error(self, status: int) -> None:
        self.errors[str(status)] = self.errors.get(str(status), 0) + 1

    def retried(self) -> None:
        self.retries += 1

    def snapshot(self) -> dict:
        return {"labels": dict(self.labels), "errors": dict(self.errors), "retries": self.retries}


TEXT_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OPENMETRICS_CONTENT_TYPE = "application/openmetrics-text; version=1.0.0; charset=utf-8"


def wants_openmetrics(accept: str | None) -> bool:
    """Whether an ``Accept`` header asks for OpenMetrics (Prometheus lists it first)."""
    return "application/openmetrics-text" in (accept or "")
