"""``dart-ray bench``: every method on the same prompts in one process, interleaved, medians.

Methods: ``ar`` (own engine, no drafter), ``ngram``, ``dart`` (own engine with those drafters),
``hf`` (transformers ``generate``), ``hf-pld`` (its prompt-lookup decoding). The target weights
load once and are shared by the own-engine methods; transformers loads the same converted
checkpoint in the same dtype. For every batch of prompts each method runs once, in rotating order,
so drift (thermal, other load) hits all methods alike; tokens/s is the median over batches.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dart_ray.config import (
    GREEDY_BELOW,
    METHOD_ALIASES,
    DecodingConfig,
    EngineConfig,
    SamplingParams,
)
from dart_ray.methods import method_names

OWN = {**METHOD_ALIASES,
       **{m: m for m in method_names() if m not in METHOD_ALIASES.values()}}
"""Bench name -> engine method: every registered method, plain decoding as ``ar``."""
HF = ("hf", "hf-pld")
ALL_METHODS = tuple(OWN) + HF


def base_method(name: str) -> str:
    """``dart@v14`` -> ``dart``: a variant runs its method with its own ``drafters`` /
    ``decodings`` entry, interleaved with the others in the same process (an A/B of two drafters
    without the run-to-run drift of two processes)."""
    return name.partition("@")[0]


@dataclass
class MethodResult:
    times: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)
    draft_ms: float = 0.0
    tree_ms: float = 0.0
    verify_ms: float = 0.0
    tau: float = 0.0
    tau_per_depth: list[float] = field(default_factory=list)


def _hf_generate(hf, tok, prompt_ids: list[list[int]], max_new: int, pld: bool,
                 eos_ids) -> list[list[int]]:
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    T = max(len(p) for p in prompt_ids)
    ids = torch.full((len(prompt_ids), T), pad, dtype=torch.long, device=hf.device)
    att = torch.zeros_like(ids)
    for i, p in enumerate(prompt_ids):  # left padding for decoder-only batched generate
        ids[i, T - len(p):] = torch.tensor(p, device=hf.device)
        att[i, T - len(p):] = 1
    kw = dict(max_new_tokens=max_new, do_sample=False, attention_mask=att, pad_token_id=pad,
              eos_token_id=list(eos_ids))
    if pld:
        kw["prompt_lookup_num_tokens"] = 10
    with torch.inference_mode():
        out = hf.generate(ids, **kw)
    res = []
    for row in out[:, T:].tolist():
        cut = []
        for t in row:
            cut.append(t)
            if t in eos_ids:
                break
        res.append(cut)
    return res


def run_bench(prompts: list[str], methods: list[str], *, model: str | None = None,
              drafter: str | None = None, ngram: str | None = None, chat: bool = False,
              max_new_tokens: int = 128, batch_size: int = 1, dtype: str = "auto",
              threads: int | None = None, decoding: DecodingConfig | None = None, warmup: int = 1,
              progress: bool = True, device: str = "cpu", drafters: dict[str, str] | None = None,
              decodings: dict[str, DecodingConfig] | None = None, adaptive: bool = True,
              temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
              seed: int = 0) -> dict:
    """Interleaved, same-process benchmark of ``methods`` on ``prompts`` (medians over batches).

    ``temperature`` > 0 benchmarks sampling (own-engine methods only) with ``seed`` for every
    prompt: sampling is position-keyed, so "matches ar" still compares token for token (fp32
    exactly; bf16 up to near-ties of the race, as for greedy near-ties).

    ``drafter`` is the DART drafter; ``drafters`` maps other methods to their drafter directories
    (default: shipped). ``decoding`` applies to every own-engine method unless ``decodings`` gives
    a method its own (e.g. a per-method tuned profile). ``dtype="auto"`` is resolved for this
    machine (``dart_ray.hardware``); the report's ``config`` records the choice and the hardware
    fingerprint it was measured on.
    """
    from dart_ray.drafters import make_drafter
    from dart_ray.engine import Engine
    from dart_ray.engine.engine import encode_prompt
    from dart_ray.hardware import resolve_dtype
    from dart_ray.models import load_target

    unknown = {m for m in methods if base_method(m) not in ALL_METHODS}
    if unknown:
        raise ValueError(f"unknown methods {sorted(unknown)}; choose from {ALL_METHODS} (an own "
                         "method may be named METHOD@VARIANT to run it twice with another drafter "
                         "or profile)")
    bad = [m for m in methods
           if "@" in m and (base_method(m) not in OWN or not m.partition("@")[2])]
    if bad:
        raise ValueError(f"{bad}: a variant is METHOD@NAME of an own-engine method "
                         f"({', '.join(OWN)}), not of {HF}")
    if len(set(methods)) != len(methods):
        raise ValueError(f"methods listed twice: {methods}")
    stray = sorted({*(drafters or {}), *(decodings or {})} - set(methods))
    if stray:  # e.g. a misspelt variant would run with the default drafter: a silent wrong A/B
        raise ValueError(f"a drafter or profile is given for {stray}, which are not among the "
                         f"methods {methods}")
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                            top_k=top_k, seed=seed)
    if not params.greedy and any(m in HF for m in methods):
        raise ValueError(f"{[m for m in methods if m in HF]} run greedy only: drop them, or "
                         "--temperature 0")
    if "hf-pld" in methods and batch_size != 1:
        raise ValueError("hf-pld (transformers prompt lookup) supports batch size 1 only")
    if threads:
        torch.set_num_threads(threads)
    decoding = decoding or DecodingConfig()
    choice = resolve_dtype(dtype, device)
    dtype = choice.dtype
    target = load_target(model, dtype, device, max_seq_len=2048)
    engines = {}
    for m in methods:
        base = base_method(m)
        if base in OWN:
            d = (drafters or {}).get(m, drafter if base == "dart" else None)
            cfg = EngineConfig(model=model, method=OWN[base], drafter=d, ngram=ngram, dtype=dtype,
                               device=device, max_batch_size=batch_size, max_seq_len=2048,
                               adaptive=adaptive, decoding=(decodings or {}).get(m, decoding))
            engines[m] = Engine(target, make_drafter(cfg, target), cfg)
    hf = None
    if any(m in HF for m in methods):
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(target.model_dir),
                                                  dtype=target.model.embed.weight.dtype)
        hf = hf.to(device).eval()
    tok = target.tokenizer
    prompt_ids = [encode_prompt(tok, p, chat) for p in prompts]
    eos = set(target.args.eos_token_ids) | ({tok.eos_token_id} if tok.eos_token_id is not None
                                            else set())
    batches = [prompt_ids[i:i + batch_size] for i in range(0, len(prompt_ids), batch_size)]

    def run(m: str, batch: list[list[int]]) -> list[list[int]]:
        if m in engines:
            return [c.token_ids for c in engines[m].generate(batch, params)]
        return _hf_generate(hf, tok, batch, max_new_tokens, m == "hf-pld", eos)

    for m in methods:  # warm-up (allocator, kernels) outside the measurement
        for b in batches[:warmup]:
            run(m, b)
    for e in engines.values():
        e.reset_stats()
    res = {m: MethodResult() for m in methods}
    it = range(len(batches))
    if progress:
        from tqdm import tqdm
        it = tqdm(it, desc="bench", unit="batch")
    for i in it:
        batch = batches[i]
        rot = methods[i % len(methods):] + methods[:i % len(methods)]
        for m in rot:
            t0 = time.perf_counter()
            outs = run(m, batch)
            dt = time.perf_counter() - t0
            res[m].times.append(dt)
            res[m].tokens.append(sum(len(o) for o in outs))
            res[m].outputs.extend(outs)
    report = {"config": {"n_prompts": len(prompts), "methods": methods, "chat": chat,
                         "sampling": {"temperature": temperature, "top_p": top_p, "top_k": top_k,
                                      "seed": seed},
                         "batch_size": batch_size, "max_new_tokens": max_new_tokens, "dtype": dtype,
                         "dtype_choice": choice.to_dict(), "adaptive": adaptive,
                         "threads": torch.get_num_threads(), "model": model or "default",
                         "drafter": drafter, "device": device, "decoding": decoding.to_dict(),
                         "drafters": drafters or {},
                         "decodings": {m: d.to_dict() for m, d in (decodings or {}).items()}},
              "methods": {}}
    from dart_ray.hardware import Fingerprint

    fp = Fingerprint.current(device, dtype, target.model_id)
    report["config"]["fingerprint"] = fp.to_dict()
    report["config"]["machine"] = fp.summary()
    from dart_ray.allocator import allocator_in_use

    report["config"]["allocator"] = allocator_in_use()   # CPU throughput depends on it (~25 %)
    ar_out = res["ar"].outputs if "ar" in res else None
    for m in methods:
        r = res[m]
        tps = statistics.median(t / s for t, s in zip(r.tokens, r.times, strict=True))
        entry = {"tokens_per_s": tps, "total_tokens": sum(r.tokens), "total_s": sum(r.times),
                 "n_prompts": len(prompts), "mean_accepted_len": None, "draft_ms": None,
                 "tree_ms": None, "verify_ms": None, "outputs_match_ar": None}
        if m in engines:
            st = engines[m].stats()
            split = st.time_split_ms()
            entry.update(mean_accepted_len=st.mean_accepted_len, draft_ms=split["draft"],
                         tree_ms=split["tree"], verify_ms=split["verify"],
                         accept_ms=split["accept"], other_ms=split["other"],
                         accepted_per_depth=[a / max(st.row_steps, 1)
                                             for a in st.accepted_per_depth],
                         steps=st.steps, ar_steps=st.ar_steps,
                         head_rows_per_step=st.head_rows / max(st.steps, 1))
        if ar_out is not None:
            entry["outputs_match_ar"] = r.outputs == ar_out
            entry["n_mismatch"] = sum(a != b for a, b in zip(r.outputs, ar_out, strict=True))
            if m != "ar" and entry["n_mismatch"]:
                gaps = divergence_gaps(target.model, prompt_ids, ar_out, r.outputs,
                                       None if params.greedy else params)
                entry["divergence_gaps"] = gaps
                token_gaps = [abs(g) for g in gaps if g is not None]
                entry["max_divergence_gap"] = max(token_gaps) if token_gaps else None
        report["methods"][m] = entry
    if "ar" in report["methods"]:
        base = report["methods"]["ar"]["tokens_per_s"]
        for e in report["methods"].values():
            e["speedup_vs_ar"] = e["tokens_per_s"] / base
    return report


@torch.inference_mode()
def divergence_gaps(model, prompt_ids: list[list[int]], ref: list[list[int]],
                    outs: list[list[int]], sampling: SamplingParams | None = None
                    ) -> list[float | None]:
    """For each output that differs from the reference (AR), the target's logit gap between the two
    tokens at the first divergence: ``logit[ref token] - logit[other token]``, from one forward over
    prompt + the common prefix. A gap near the bf16 resolution of the logits (~0.1) means the two
    runs split on a numerical near-tie; a wrong token would show a gap of whole logits (either sign:
    negative when this forward prefers the other run's token). None where one output is a prefix of
    the other (a length cut, not a token choice).

    ``sampling`` (position-keyed, every prompt with its seed): the same gap in the position's
    exponential race, ``log(p/E)[ref token] - log(p/E)[other token]`` in this forward's processed
    distribution -- near 0 (the bf16 rounding of the probabilities) when the runs split on a
    near-tie of the race, whole units for a wrong token; None where either token is outside this
    forward's top-k/top-p support (p = 0: no finite gap; in bf16 a rounding can move that edge)."""
    from dart_ray.masks import attention_mask, causal_ancestors
    from dart_ray.verify import RequestRandom, processed_probs

    gaps = []
    dev = model.embed.weight.device
    for p, a, b in zip(prompt_ids, ref, outs, strict=True):
        if a == b:
            continue
        j = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                 min(len(a), len(b)))
        if j >= min(len(a), len(b)):  # one is a prefix of the other: a length cut, not a token
            gaps.append(None)
            continue
        seq = torch.tensor([p + a[:j]], device=dev)                       # [1, T]
        T = seq.shape[1]
        cache = model.new_cache(1, T)
        mask = attention_mask([0], causal_ancestors(T, dev), T,
                              model.embed.weight.dtype) if T > 1 else None
        out = model(seq, torch.arange(T, device=dev)[None], mask, cache, starts=[0],
                    logits_at=torch.tensor([[T - 1]], device=dev))
        logits = out.logits[0, 0].float()                                  # [V]
        if sampling is None:
            gaps.append(float(logits[a[j]] - logits[b[j]]))
            continue
        probs = processed_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
        if float(probs[a[j]]) == 0.0 or float(probs[b[j]]) == 0.0:
            gaps.append(None)      # outside this forward's top-k/top-p: no finite gap to report
            continue
        exps = RequestRandom(sampling.seed).exponentials(j, probs.shape[-1], dev)   # [V]
        score = probs.log() - exps.log()                                   # [V] log(p / E)
        gaps.append(float(score[a[j]] - score[b[j]]))
    return gaps


def plot_report(report: dict, out: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["methods"])
    tps = [report["methods"][m]["tokens_per_s"] for m in names]
    tau = [report["methods"][m]["mean_accepted_len"] or 1.0 for m in names]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    a1.bar(names, tps, color="tab:blue")
    a1.set_ylabel("tokens/s")
    a1.set_title("throughput")
    a2.bar(names, tau, color="tab:orange")
    a2.set_ylabel("mean accepted length (tau)")
    a2.set_title("tau (HF methods shown as 1)")
    c = report["config"]
    fig.suptitle(f"{c['model']} {c['dtype']} bs={c['batch_size']} new={c['max_new_tokens']} "
                 f"n={c['n_prompts']}")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _sampling_note(sampling: dict | None) -> str:
    if not sampling or sampling.get("temperature", 0.0) < GREEDY_BELOW:
        return ""
    return (f"; sampling temperature {sampling['temperature']} top_p {sampling['top_p']} "
            f"top_k {sampling['top_k']} seed {sampling['seed']} (max gap: the two runs' tokens' "
            "log(p/E) gap in the position's exponential race at the first divergence)")


def format_table(report: dict) -> str:
    c = report.get("config", {})
    rows = [f"machine: {c.get('machine', '?')}; allocator {c.get('allocator', '?')}; "
            f"dtype {c.get('dtype')} "
            f"({(c.get('dtype_choice') or {}).get('reason', 'given')}); adaptive "
            f"{c.get('adaptive')}" + _sampling_note(c.get("sampling")), "",
            "| method | tok/s | speedup vs ar | tau | AR steps | draft ms | tree ms | verify ms | "
            "matches ar | max gap |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    f = lambda v, p=2: "-" if v is None else (f"{v:.{p}f}" if isinstance(v, float) else str(v))  # noqa: E731
    for m, e in report["methods"].items():
        match = f(e["outputs_match_ar"])
        if e.get("n_mismatch"):
            match += f" ({e['n_mismatch']}/{e['n_prompts']} differ)"
        ar_steps = f"{e['ar_steps']}/{e['steps']}" if e.get("steps") else "-"
        rows.append(f"| {m} | {f(e['tokens_per_s'], 1)} | {f(e.get('speedup_vs_ar'))} | "
                    f"{f(e['mean_accepted_len'])} | {ar_steps} | {f(e['draft_ms'])} | "
                    f"{f(e['tree_ms'])} | {f(e['verify_ms'])} | {match} | "
                    f"{f(e.get('max_divergence_gap'), 3)} |")
    return "\n".join(rows)


def write_report(report: dict, out: str | Path) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(report, indent=2))
