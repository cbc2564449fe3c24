"""Prometheus text exposition (format 0.0.4) of one replica, with vLLM-compatible names.

Speculative-decoding counters come from the engines' :class:`~dart_ray.EngineStats` (summed over
the lanes that speculate); request-level latency/TTFT histograms are measured at the HTTP edge.
Each replica serves its own ``/metrics`` (scrape every replica, or use Ray's metrics export).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def _fmt(v: float) -> str:
    if v == float("inf"):
        return "+Inf"
    if float(v).is_integer():
        return f"{int(v)}.0" if abs(v) < 1e15 else repr(float(v))
    return repr(float(v))


def _labels(d: dict) -> str:
    if not d:
        return ""
    esc = (lambda s: str(s).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"'))
    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in d.items()) + "}"


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
            for b, c in zip(self.buckets, self.counts):
                out.append(f"{name}_bucket{_labels({**labels, 'le': _fmt(b)})} {_fmt(c)}")
            out.append(f"{name}_bucket{_labels({**labels, 'le': '+Inf'})} {_fmt(self.count)}")
            out.append(f"{name}_sum{_labels(labels)} {_fmt(self.sum)}")
            out.append(f"{name}_count{_labels(labels)} {_fmt(self.count)}")
        return out


class ServerMetrics:
    """Edge-side counters of one replica (thread-safe enough for the replica's event loop)."""

    def __init__(self, model_name: str) -> None:
        self.labels = {"model_name": model_name}
        self.latency = Histogram(LATENCY_BUCKETS)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.requests: dict[str, int] = {}      # finish reason -> count
        self.errors: dict[str, int] = {}        # HTTP status -> count
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.aborted = 0                        # clients that went away mid-request

    def finished(self, reason: str, latency_s: float, num_prompt: int, num_completion: int) -> None:
        self.requests[reason] = self.requests.get(reason, 0) + 1
        self.latency.observe(latency_s)
        self.prompt_tokens += num_prompt
        self.completion_tokens += num_completion

    def error(self, status: int) -> None:
        self.errors[str(status)] = self.errors.get(str(status), 0) + 1

    def render(self, engine_stats: dict, queue_depth: int, num_running: int, num_positions: int) -> str:
        """``engine_stats``: lane -> (method, EngineStats as dict)."""
        L = self.labels
        out: list[str] = []

        def family(name: str, kind: str, help: str, samples: list[tuple[str, dict, float]]) -> None:
            out.append(f"# HELP {name} {help}")
            out.append(f"# TYPE {name} {kind}")
            for sname, labels, v in samples:
                out.append(f"{sname}{_labels(labels)} {_fmt(v)}")

        spec = [s for m, s in engine_stats.values() if m != "none"]
        drafts = sum(s["row_steps"] for s in spec)
        draft_tokens = sum(s["draft_tokens"] for s in spec)
        accepted = sum(s["accepted_tokens"] for s in spec)
        per_pos: list[int] = []
        for s in spec:
            apd = s["accepted_per_depth"]
            if len(apd) > len(per_pos):
                per_pos.extend([0] * (len(apd) - len(per_pos)))
            for i, v in enumerate(apd):
                per_pos[i] += v
        per_pos.extend([0] * max(0, num_positions - len(per_pos)))
        gen = sum(s["generated_tokens"] for _, s in engine_stats.values())
        prompt = sum(s["prompt_tokens"] for _, s in engine_stats.values())

        family("vllm:spec_decode_num_drafts_total", "counter",
               "Number of spec decoding drafts (one per running request per step).",
               [("vllm:spec_decode_num_drafts_total", L, drafts)])
        family("vllm:spec_decode_num_draft_tokens_total", "counter", "Number of draft tokens.",
               [("vllm:spec_decode_num_draft_tokens_total", L, draft_tokens)])
        family("vllm:spec_decode_num_accepted_tokens_total", "counter", "Number of accepted tokens.",
               [("vllm:spec_decode_num_accepted_tokens_total", L, accepted)])
        family("vllm:spec_decode_num_accepted_tokens_per_pos_total", "counter",
               "Accepted tokens per draft position.",
               [("vllm:spec_decode_num_accepted_tokens_per_pos_total", {**L, "position": str(i)}, v)
                for i, v in enumerate(per_pos)])
        family("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.",
               [("vllm:generation_tokens_total", L, gen)])
        family("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
               [("vllm:prompt_tokens_total", L, prompt)])
        family("vllm:num_requests_running", "gauge", "Requests holding a batch row.",
               [("vllm:num_requests_running", L, num_running)])
        family("vllm:num_requests_waiting", "gauge", "Requests waiting for a batch row.",
               [("vllm:num_requests_waiting", L, queue_depth)])

        family("dart_ray:generation_tokens_total", "counter", "Tokens generated by the engines.",
               [("dart_ray:generation_tokens_total", L, gen)])
        family("dart_ray:prompt_tokens_total", "counter", "Prompt tokens prefilled by the engines.",
               [("dart_ray:prompt_tokens_total", L, prompt)])
        family("dart_ray:queue_depth", "gauge", "Requests waiting for a batch row.",
               [("dart_ray:queue_depth", L, queue_depth)])
        family("dart_ray:num_running", "gauge", "Requests holding a batch row.",
               [("dart_ray:num_running", L, num_running)])
        family("dart_ray:mean_accepted_len", "gauge",
               "Tokens committed per draft (accepted + bonus) since start, speculating lanes.",
               [("dart_ray:mean_accepted_len", L, (accepted + drafts) / drafts if drafts else 0.0)])
        family("dart_ray:request_success_total", "counter", "Finished requests by finish reason.",
               [("dart_ray:request_success_total", {**L, "finished_reason": k}, v)
                for k, v in sorted(self.requests.items())])
        family("dart_ray:request_errors_total", "counter", "Requests answered with an error, by status.",
               [("dart_ray:request_errors_total", {**L, "status": k}, v) for k, v in sorted(self.errors.items())])
        family("dart_ray:request_aborted_total", "counter", "Requests aborted because the client went away.",
               [("dart_ray:request_aborted_total", L, self.aborted)])
        out.append("# HELP dart_ray:request_latency_seconds End-to-end request latency.")
        out.append("# TYPE dart_ray:request_latency_seconds histogram")
        out.extend(self.latency.lines("dart_ray:request_latency_seconds", L))
        out.append("# HELP dart_ray:time_to_first_token_seconds Time to the first generated token.")
        out.append("# TYPE dart_ray:time_to_first_token_seconds histogram")
        out.extend(self.ttft.lines("dart_ray:time_to_first_token_seconds", L))
        return "\n".join(out) + "\n"
