#!/usr/bin/env python
"""Load test of a running dart-ray (or any OpenAI-compatible) server with streaming clients.

    python scripts/load_test.py --url http://127.0.0.1:8000 --clients 32 --requests 2 \
        --max-tokens 64
    # issue 16's load run: 64 streaming clients, then the same with 8 clients sending 1 MB prompts
    python scripts/load_test.py --clients 64 --requests 2 --ignore-eos
    python scripts/load_test.py --clients 64 --requests 2 --ignore-eos --big-clients 8 \
        --big-prompt-bytes 1000000

Runs one client alone first (the baseline), then N concurrent clients (threads, each sending
``--requests`` streaming requests back to back), and prints throughput (generated tokens/s,
requests/s) and p50/p99 latency and time-to-first-token for both, plus the error count.
``--big-clients`` adds clients that, while the streaming clients run, send prompts of
``--big-prompt-bytes`` back to back (the server refuses them: 400 ``context_length_exceeded`` or
413); their statuses and latencies are reported apart, and the streaming numbers show what they cost
the others (largest inter-chunk gap included). Anything else than those refusals (5xx, connection
errors) counts as an error. Standard library only (urllib + SSE parsing), so it measures the
server, not a client library.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request

BIG_OK = (400, 413)
"""Statuses a big-prompt request is expected to get (refused before it can hurt anyone)."""

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Explain what a hash map is in two sentences.",
    "List three uses of binary search.",
    "Write a haiku about speculative decoding.",
    "def fibonacci(n):",
    "Summarise the rules of chess briefly.",
    "What is the capital of Australia? Answer and explain.",
    "Write a SQL query that counts rows per day.",
]


def one_request(base: str, i: int, a) -> dict:
    prompt = PROMPTS[i % len(PROMPTS)]
    if a.chat:
        path = "/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": prompt}]}
    else:
        path = "/v1/completions"
        body = {"prompt": prompt}
    body.update({"max_tokens": a.max_tokens, "temperature": a.temperature, "stream": True,
                 "stream_options": {"include_usage": True}})
    if a.model:
        body["model"] = a.model
    if a.ignore_eos:
        body["ignore_eos"] = True
    headers = {"Content-Type": "application/json"}
    if a.api_key:
        headers["Authorization"] = f"Bearer {a.api_key}"
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), headers=headers,
                                 method="POST")
    t0 = time.perf_counter()
    ttft = None
    tokens = 0
    last = None
    max_gap = 0.0
    try:
        with urllib.request.urlopen(req, timeout=a.timeout) as r:
            for raw in r:
                line = raw.strip()
                if not line.startswith(b"data: "):
                    continue
                now = time.perf_counter()
                if last is not None:
                    max_gap = max(max_gap, now - last)
                last = now
                data = line[6:]
                if data == b"[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    return {"ok": False, "error": obj["error"].get("message"),
                            "latency": time.perf_counter() - t0}
                if obj.get("choices"):
                    c = obj["choices"][0]
                    text = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                    if text and ttft is None:
                        ttft = time.perf_counter() - t0
                if obj.get("usage"):
                    tokens = obj["usage"]["completion_tokens"]
    except (urllib.error.URLError, OSError, ValueError) as e:
        return {"ok": False, "error": repr(e), "latency": time.perf_counter() - t0}
    return {"ok": True, "latency": time.perf_counter() - t0, "ttft": ttft, "tokens": tokens,
            "max_gap": max_gap}


def big_prompt(nbytes: int, seed: int) -> str:
    rnd = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "light", "night", "paper",
             "glass"]
    out, n = [], 0
    while n < nbytes:
        w = rnd.choice(words) + str(rnd.randrange(1000))
        out.append(w)
        n += len(w) + 1
    return " ".join(out)[:nbytes]


def big_request(base: str, prompt: str, a) -> dict:
    """One large non-streaming request; ok = refused as expected (or served)."""
    body = json.dumps({"prompt": prompt, "max_tokens": 8,
                       **({"model": a.model} if a.model else {})}).encode()
    headers = {"Content-Type": "application/json"}
    if a.api_key:
        headers["Authorization"] = f"Bearer {a.api_key}"
    req = urllib.request.Request(base + "/v1/completions", data=body, headers=headers,
                                 method="POST")
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=a.timeout) as r:
            r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        e.read()
        status = e.code
    except (urllib.error.URLError, OSError) as e:
        return {"ok": False, "status": repr(e), "latency": time.perf_counter() - t0}
    return {"ok": status == 200 or status in BIG_OK, "status": status,
            "latency": time.perf_counter() - t0}


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return xs[k]


def run_phase(base: str, clients: int, a, big_clients: int = 0) -> dict:
    results: list[dict] = []
    big: list[dict] = []
    lock = threading.Lock()
    done = threading.Event()

    def worker(c: int) -> None:
        for r in range(a.requests):
            res = one_request(base, c * a.requests + r, a)
            with lock:
                results.append(res)

    def big_worker(c: int) -> None:
        prompt = big_prompt(a.big_prompt_bytes, c)
        while not done.is_set():
            res = big_request(base, prompt, a)
            with lock:
                big.append(res)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(c,), daemon=True) for c in range(clients)]
    bigs = [threading.Thread(target=big_worker, args=(c,), daemon=True) for c in range(big_clients)]
    for t in threads + bigs:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    done.set()
    for t in bigs:
        t.join()
    ok = [r for r in results if r["ok"]]
    lat = [r["latency"] for r in ok]
    ttft = [r["ttft"] for r in ok if r.get("ttft") is not None]
    toks = sum(r["tokens"] for r in ok)
    return {"clients": clients, "requests": len(results), "errors": len(results) - len(ok),
            "error_samples": [r["error"] for r in results if not r["ok"]][:3],
            "wall_s": wall, "tokens": toks, "tokens_per_s": toks / wall if wall else 0.0,
            "requests_per_s": len(ok) / wall if wall else 0.0,
            "latency_p50_s": pct(lat, 50), "latency_p99_s": pct(lat, 99),
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
            "max_inter_chunk_gap_s": max((r.get("max_gap", 0.0) for r in ok), default=float("nan")),
            "mean_latency_s": statistics.fmean(lat) if lat else float("nan"),
            **({"big": summarize_big(big)} if big_clients else {})}


def summarize_big(big: list[dict]) -> dict:
    statuses: dict[str, int] = {}
    for r in big:
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    lat = [r["latency"] for r in big]
    return {"requests": len(big), "unexpected": sum(not r["ok"] for r in big), "statuses": statuses,
            "latency_p50_s": pct(lat, 50), "latency_p99_s": pct(lat, 99)}


def fmt(p: dict) -> str:
    return (f"{p['clients']:>3} clients  {p['requests']:>4} req  {p['errors']} err  "
            f"{p['tokens_per_s']:8.1f} tok/s  {p['requests_per_s']:6.2f} req/s  latency p50 "
            f"{p['latency_p50_s']:.2f}s p99 {p['latency_p99_s']:.2f}s  TTFT p50 "
            f"{p['ttft_p50_s']:.3f}s p99 {p['ttft_p99_s']:.3f}s  max gap "
            f"{p['max_inter_chunk_gap_s']:.2f}s"
            + (f"\n          big prompts: {p['big']['requests']} req  {p['big']['unexpected']} "
               f"unexpected  statuses {p['big']['statuses']}  latency p50 "
               f"{p['big']['latency_p50_s']:.2f}s p99 {p['big']['latency_p99_s']:.2f}s"
               if "big" in p else ""))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="server root (without /v1)")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=2, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--chat", action="store_true")
    ap.add_argument("--ignore-eos", action="store_true",
                    help="fixed-length outputs (vLLM extra field)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--skip-baseline", action="store_true")
    ap.add_argument("--big-clients", type=int, default=0,
                    help="extra clients sending huge prompts back to back during the concurrent "
                         "phase")
    ap.add_argument("--big-prompt-bytes", type=int, default=1_000_000,
                    help="size of a huge prompt (characters)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    a = ap.parse_args(argv)
    base = a.url.rstrip("/")
    base = base.removesuffix("/v1")
    out = {}
    if not a.skip_baseline:
        out["single"] = run_phase(base, 1, a)
        if not a.json:
            print("baseline  " + fmt(out["single"]), flush=True)
    out["concurrent"] = run_phase(base, a.clients, a, big_clients=a.big_clients)
    if not a.json:
        print("load      " + fmt(out["concurrent"]), flush=True)
        if "single" in out and out["single"]["tokens_per_s"]:
            print("throughput "
                  f"x{out['concurrent']['tokens_per_s'] / out['single']['tokens_per_s']:.2f} vs "
                  "one client; p50 latency "
                  f"x{out['concurrent']['latency_p50_s'] / out['single']['latency_p50_s']:.2f}")
        for e in out["concurrent"]["error_samples"]:
            print("error:", e, file=sys.stderr)
    else:
        print(json.dumps(out, indent=2))
    big_bad = out["concurrent"].get("big", {}).get("unexpected", 0)
    return 1 if out["concurrent"]["errors"] or big_bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
