"""Engine exactness (fp32): every drafter's greedy output equals plain AR token for token —
batch 1 and 4, mixed prompt lengths, requests joining/leaving mid-run — plus stop conditions,
streaming and errors. Tiny random targets keep these fast."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import MIXED_PROMPTS, flat_cost

from dart_ray import DecodingConfig, Engine, EngineConfig, SamplingParams
from dart_ray.drafters import Drafter, make_drafter
from dart_ray.engine import PromptTooLongError
from dart_ray.models import load_target
from dart_ray.tree import pack_trees

PROMPTS = MIXED_PROMPTS
GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_dirs):
    return load_target(str(tiny_dirs["llama"]), "fp32", max_seq_len=512)


def make_engine(target, method="none", drafter=None, batch=4, decoding=None, seq=512,
                adaptive=True):
    cfg = EngineConfig(method=method, drafter=drafter, ngram="none", dtype="fp32",
                       max_batch_size=batch, max_seq_len=seq,
                       decoding=decoding or DecodingConfig(tree_budget=24, top_k=8, beam_width=6),
                       adaptive=adaptive)
    return Engine(target, make_drafter(cfg, target), cfg)


@pytest.fixture(scope="module")
def ar_out(tiny):
    eng = make_engine(tiny, "none", batch=1)
    return [eng.generate(p, GREEDY)[0].token_ids for p in PROMPTS]


class OracleDrafter(Drafter):
    """Test drafter: proposes the known AR continuation plus decoy siblings at every level, so deep
    acceptance, branch selection and KV commit of non-contiguous paths are all exercised."""

    name = "oracle"

    def __init__(self, futures: dict[tuple[int, ...], list[int]], depth: int = 5,
                 vocab: int = 49152) -> None:
        super().__init__()
        self.futures = futures  # prompt ids -> AR continuation
        self.depth = depth
        self.vocab = vocab
        self.max_draft_depth = depth

    def propose(self, view):
        trees = []
        for b in range(view.batch_size):
            seq = [int(t) for t in view.tokens[b, :view.lengths[b]]] + [int(view.roots[b])]
            cont = None
            for prompt, fut in self.futures.items():
                full = list(prompt) + fut
                if full[:len(seq)] == seq:
                    cont = full[len(seq):len(seq) + self.depth]
            toks, pars = [], []
            parent = 0
            rng = np.random.default_rng(len(seq))
            for i, t in enumerate(cont or []):
                decoy = int((t + 1 + rng.integers(1000)) % self.vocab)
                toks.append(decoy)  # decoy first: the true child is not always node parent+1
                pars.append(parent)
                if i == 3:  # break the chain once: a wrong token at depth 4 ends acceptance there
                    t = (t + 7) % self.vocab
                toks.append(t)
                pars.append(parent)
                parent = len(toks)
            trees.append((toks, pars))
        return pack_trees(view.roots, trees)


@pytest.mark.parametrize("method,drafter", [("ngram", None), ("dart", "random")])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_equals_ar(tiny, ar_out, method, drafter, batch):
    eng = make_engine(tiny, method, drafter, batch=batch)
    outs = eng.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == ar_out
    st = eng.stats()
    assert st.steps > 0 and st.row_steps >= st.steps


BASELINES = ["eagle", "medusa", "sps"]


@pytest.mark.parametrize("method", BASELINES)
@pytest.mark.parametrize("batch", [1, 4])
def test_baseline_greedy_equals_ar(tiny, ar_out, tiny_baselines, method, batch):
    eng = make_engine(tiny, method, str(tiny_baselines[method]), batch=batch)
    outs = eng.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == ar_out
    assert eng.stats().draft_tokens > 0


@pytest.mark.parametrize("method", BASELINES)
def test_baseline_join_leave_and_topk1_sampling(tiny, ar_out, tiny_baselines, method):
    eng = make_engine(tiny, method, str(tiny_baselines[method]), batch=3)
    lens = [24, 7, 15, 3]
    rids = [eng.add_request(PROMPTS[i], SamplingParams(max_new_tokens=lens[i], ignore_eos=True))
            for i in range(4)]
    results: dict[str, list[int]] = {r: [] for r in rids}
    while eng.has_unfinished():
        for o in eng.step():
            results[o.request_id] += o.new_token_ids
    assert [results[r] for r in rids] == [ar_out[i][:lens[i]] for i in range(4)]
    g = SamplingParams(max_new_tokens=16, temperature=0.8, top_k=1, seed=1, ignore_eos=True)
    assert [o.token_ids for o in eng.generate(PROMPTS, g)] == [x[:16] for x in ar_out]


def test_sps_sampled_rows_reproducible_and_mixed_with_greedy(tiny, ar_out, tiny_baselines):
    # a fixed tree schedule: with adaptive speculation the tree sizes (and so the random draws)
    # follow this machine's timings, so seeded outputs are reproducible only without it
    # (SamplingParams.seed)
    eng = make_engine(tiny, "sps", str(tiny_baselines["sps"]), batch=4, adaptive=False)
    sp = SamplingParams(max_new_tokens=16, temperature=0.9, seed=7, ignore_eos=True)
    a = [o.token_ids for o in eng.generate(PROMPTS[:2], sp)]
    b = [o.token_ids for o in eng.generate(PROMPTS[:2], sp)]
    assert a == b and all(len(x) == 16 for x in a)
    # a greedy row batched with sampled rows is still exactly AR
    rid = eng.add_request(PROMPTS[0], GREEDY)
    for p in PROMPTS[1:]:
        eng.add_request(p, sp)
    done: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            done.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert done[rid] == ar_out[0]


def test_ngram_drafter_accepts_on_repetitive_text(tiny, ar_out):
    eng = make_engine(tiny, "ngram", batch=4)
    outs = eng.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == ar_out
    assert eng.stats().draft_tokens > 0


def test_oracle_drafter_deep_acceptance_exact(tiny, ar_out):
    prompt_ids = [tuple(make_engine(tiny).encode_prompt(p)) for p in PROMPTS]
    futures = dict(zip(prompt_ids, ar_out, strict=True))
    # fixed trees (adaptive off): this is about deep acceptance and non-contiguous commits, not
    # about which tree size this machine's cost model prefers (that is
    # tests/engine/test_adaptive.py's)
    cfg = EngineConfig(method="none", dtype="fp32", max_batch_size=4, max_seq_len=512,
                       adaptive=False)
    eng = Engine(tiny, OracleDrafter(futures), cfg)
    outs = eng.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == ar_out
    tau = eng.stats().mean_accepted_len
    assert tau > 3.0, tau  # 3 accepted drafts + bonus per step (the 4th is broken on purpose)
    assert eng.stats().accepted_per_depth[:3] == [eng.stats().accepted_per_depth[0]] * 3


def test_join_and_leave_mid_run(tiny, ar_out):
    """Requests arrive while others decode; short ones leave early (rows compact)."""
    for method, drafter in [("none", None), ("ngram", None), ("dart", "random")]:
        eng = make_engine(tiny, method, drafter, batch=3)
        lens = [24, 5, 17, 9]
        ids = {}
        results: dict[str, list[int]] = {}
        ids[eng.add_request(PROMPTS[0],
                            SamplingParams(max_new_tokens=lens[0], ignore_eos=True))] = 0
        step = 0
        while eng.has_unfinished() or len(ids) < 4:
            if step in (1, 2, 4) and len(ids) < 4:
                i = len(ids)
                ids[eng.add_request(PROMPTS[i],
                                    SamplingParams(max_new_tokens=lens[i], ignore_eos=True))] = i
            for o in eng.step():
                results.setdefault(o.request_id, []).extend(o.new_token_ids)
            step += 1
        for rid, i in ids.items():
            assert results[rid] == ar_out[i][:lens[i]], (method, i)
        assert eng.num_running == 0 and all(n == 0 for n in eng.cache.lengths)


def test_more_requests_than_rows(tiny, ar_out):
    eng = make_engine(tiny, "dart", "random", batch=2)
    outs = eng.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == ar_out


def test_stop_token_and_max_tokens(tiny, ar_out):
    eng = make_engine(tiny, "ngram", batch=2)
    target_tok = ar_out[0][5]
    first = ar_out[0].index(target_tok)
    out = eng.generate(PROMPTS[0], SamplingParams(max_new_tokens=24, stop_token_ids=(target_tok,),
                                                  ignore_eos=True))[0]
    assert out.token_ids == ar_out[0][:first + 1] and out.finish_reason == "stop"
    # the stop token is counted, its text left out (vLLM's include_stop_str_in_output=false)
    assert out.text == eng.tokenizer.decode(ar_out[0][:first], skip_special_tokens=True)
    out = eng.generate(PROMPTS[0], SamplingParams(max_new_tokens=3, ignore_eos=True))[0]
    assert out.token_ids == ar_out[0][:3] and out.finish_reason == "length"


def test_stop_string_and_streaming_text(tiny, ar_out):
    eng = make_engine(tiny, "ngram", batch=1)
    full = eng.generate(PROMPTS[1], GREEDY)[0]
    chunks = [o.new_text for o in eng.stream(PROMPTS[1], GREEDY)]
    assert "".join(chunks) == full.text == eng.tokenizer.decode(ar_out[1], skip_special_tokens=True)
    if len(full.text) > 6:
        stop = full.text[3:6]
        out = eng.generate(PROMPTS[1],
                           SamplingParams(max_new_tokens=24, stop=(stop,), ignore_eos=True))[0]
        assert out.finish_reason == "stop"
        assert out.text == full.text[:full.text.find(stop)]


SAMPLED = [SamplingParams(max_new_tokens=20, temperature=t, top_k=k, top_p=p, seed=s,
                          ignore_eos=True)
           for t, k, p, s in [(0.3, 0, 1.0, 11), (0.5, 0, 0.9, 12), (0.4, 20, 1.0, 13),
                              (0.6, 0, 0.95, 14)]]


def test_seeded_sampling_equals_plain_sampling_whatever_the_method_batch_and_schedule(
        tiny, tiny_baselines):
    """Position-keyed randomness (dart_ray.verify.randomness): a seeded request emits the tokens
    plain sampling emits with its seed -- alone or batched, with any drafter, adaptive or fixed
    trees, requests joining mid-run -- and the speculative runs do accept drafts."""
    ref = [make_engine(tiny, "none", batch=1).generate(PROMPTS[i], SAMPLED[i])[0].token_ids
           for i in range(4)]
    assert len({tuple(x) for x in ref}) == 4
    assert [o.token_ids for o in make_engine(tiny, "none", batch=4).generate(PROMPTS, SAMPLED)] \
        == ref
    # an oracle that drafts the sampled continuations: deep acceptance under sampling
    prompt_ids = [tuple(make_engine(tiny).encode_prompt(p)) for p in PROMPTS]
    cfg = EngineConfig(method="none", dtype="fp32", max_batch_size=4, max_seq_len=512,
                       adaptive=False)
    eng = Engine(tiny, OracleDrafter(dict(zip(prompt_ids, ref, strict=True))), cfg)
    assert [o.token_ids for o in eng.generate(PROMPTS, SAMPLED)] == ref
    assert eng.stats().mean_accepted_len > 3.0
    for method, drafter, adaptive in [("dart", "random", True), ("dart", "random", False),
                                      ("ngram", None, True), ("eagle", "eagle", True),
                                      ("medusa", "medusa", False)]:
        path = str(tiny_baselines[drafter]) if drafter in tiny_baselines else drafter
        cfg = EngineConfig(method=method, drafter=path, ngram="none", dtype="fp32",
                           max_batch_size=3, max_seq_len=512, adaptive=adaptive,  # 4 prompts
                           decoding=DecodingConfig(tree_budget=24, top_k=8, beam_width=6))
        # adaptive: verify steps priced flat (not this machine's timings), so it does speculate
        eng = Engine(tiny, make_drafter(cfg, tiny), cfg, cost_model=flat_cost())
        assert [o.token_ids for o in eng.generate(PROMPTS, SAMPLED)] == ref, (method, adaptive)
        assert eng.stats().draft_tokens > 0


def test_sampling_exact_for_topk1(tiny, ar_out):
    eng = make_engine(tiny, "dart", "random", batch=2)
    # top_k=1 sampling is greedy: every method must reproduce AR exactly
    g = SamplingParams(max_new_tokens=16, temperature=0.8, top_k=1, seed=1, ignore_eos=True)
    assert [o.token_ids for o in eng.generate(PROMPTS, g)] == [x[:16] for x in ar_out]


def test_interleaved_streams_lose_nothing(tiny, ar_out):
    """Two ``Engine.stream`` iterators consumed in turns: a step run by one yields the other's
    outputs later, none dropped."""
    eng = make_engine(tiny, "dart", "random", batch=4)
    a = eng.stream(PROMPTS[:2], GREEDY)
    b = eng.stream(PROMPTS[2:], GREEDY)
    got: dict[str, list[int]] = {}
    live = [a, b]
    while live:
        for it in list(live):
            o = next(it, None)
            if o is None:
                live.remove(it)
                continue
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert sorted(got.values()) == sorted(ar_out) and not eng.has_unfinished()


def test_a_dropped_or_aborted_stream_frees_its_requests(tiny):
    """A stream dropped before its first ``next`` aborts its requests (no row kept computing, no
    outputs queued for it); aborting a request an open stream owns ends that stream."""
    import gc

    eng = make_engine(tiny, "dart", "random", batch=4)
    dropped = eng.stream(PROMPTS[:2], GREEDY)
    rids = list(eng._streams)
    del dropped
    gc.collect()
    assert not eng._streams and not any(r in eng.requests for r in rids)
    assert [o.token_ids for o in eng.generate(PROMPTS[2:], GREEDY)] and not eng._streams
    it = eng.stream(PROMPTS[0], SamplingParams(max_new_tokens=200, ignore_eos=True))
    first = next(it)
    assert eng.abort(first.request_id).finish_reason == "abort"
    rest = list(it)                                         # ends: once it spun forever
    assert rest[-1].finish_reason == "abort" and not eng.has_unfinished()


def test_errors_and_abort(tiny):
    eng = make_engine(tiny, "dart", "random", batch=2, seq=128)
    with pytest.raises(PromptTooLongError):
        eng.add_request(list(range(10, 10 + 128)), GREEDY)  # max_model_len 128: no room to generate
    with pytest.raises(ValueError):
        eng.add_request("", GREEDY)
    with pytest.raises(ValueError):
        eng.add_request([10**9], GREEDY)
    # all-or-nothing batch add: nothing left behind
    with pytest.raises(ValueError):
        eng.generate(["ok", ""], GREEDY)
    assert not eng.has_unfinished()
    rid = eng.add_request("Hello there", SamplingParams(max_new_tokens=50, ignore_eos=True))
    eng.step()
    out = eng.abort(rid)
    assert out.finished and out.finish_reason == "abort"
    assert eng.num_running == 0 and not eng.has_unfinished()
    # a stream closed early aborts its request (no leaked rows)
    s = eng.stream("Hello there", SamplingParams(max_new_tokens=50, ignore_eos=True))
    next(s)
    s.close()
    assert eng.num_running == 0


def test_context_limit_finishes_with_length(tiny):
    eng = make_engine(tiny, "none", batch=1, seq=64, decoding=DecodingConfig(tree_budget=4))
    out = eng.generate("Hello", SamplingParams(max_new_tokens=500, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) < 64


def test_runtime_decoding_change(tiny, ar_out):
    eng = make_engine(tiny, "ngram", batch=4)
    eng.set_decoding(DecodingConfig(draft_depth=2, tree_budget=3, beam_width=1))
    assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == ar_out
    from dart_ray import DecodingSchedule
    sched = DecodingSchedule("t", ((1, DecodingConfig(tree_budget=2)),
                                   (8, DecodingConfig(tree_budget=9))))
    eng.set_decoding(sched)
    assert eng.decoding_for(1).tree_budget == 2 and eng.decoding_for(3).tree_budget == 9
    assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == ar_out


def test_engine_holds_one_schedule(tiny):
    """Issue 18: one DecodingSchedule per engine -- a constant one of ``config.decoding`` until a
    profile is set; a DecodingConfig is held as a constant schedule; anything else is refused (no
    duck-typed schedules)."""
    from dart_ray import DecodingSchedule

    dec = DecodingConfig(tree_budget=24, top_k=8, beam_width=6)
    eng = make_engine(tiny, "ngram", batch=4, decoding=dec)
    assert eng.schedule == DecodingSchedule.constant(dec)
    assert all(eng.decoding_for(b) == dec for b in (1, 3, 4, 1000))
    assert not hasattr(eng, "decoding")                          # no second place for the knobs
    other = DecodingConfig(draft_depth=3, tree_budget=5)
    eng.set_decoding(other)
    assert eng.schedule == DecodingSchedule.constant(other) and eng.decoding_for(4) == other
    sched = DecodingSchedule("p", ((2, DecodingConfig(draft_depth=2)),
                                   (8, DecodingConfig(draft_depth=5))))
    eng.set_decoding(sched)
    assert eng.schedule is sched and eng.schedule.max_draft_depth == 5
    assert eng.decoding_for(2).draft_depth == 2 and eng.decoding_for(3).draft_depth == 5

    class LooksLikeASchedule:
        def for_batch_size(self, b):
            return other

    with pytest.raises(TypeError, match="DecodingSchedule"):
        eng.set_decoding(LooksLikeASchedule())
    assert eng.schedule is sched                                 # a refused value changes nothing
    with pytest.raises(TypeError, match="DecodingConfig"):
        DecodingSchedule("bad", ((1, {"draft_depth": 2}),))


@pytest.mark.slow
def test_smollm_untrained_drafter_exact(smollm_fp32):
    prompts = ["def fibonacci(n):", "Write a short poem about rain.", "import os\nimport sys\n"]
    sp = SamplingParams(max_new_tokens=32, ignore_eos=True)
    ar = make_engine(smollm_fp32, "none", batch=1, seq=1024)
    ref = [ar.generate(p, sp)[0].token_ids for p in prompts]
    for method, drafter in [("dart", "random"), ("ngram", None)]:
        eng = make_engine(smollm_fp32, method, drafter, batch=4, seq=1024,
                          decoding=DecodingConfig())
        assert [o.token_ids for o in eng.generate(prompts, sp)] == ref, method


@pytest.mark.parametrize("method", ["dart", "eagle", "sps"])
def test_long_prompt_joins_long_running_row(tiny, tiny_baselines, method):
    """A new long prompt is drafted in the same padded block as a row that has run long: the
    drafter's own cache must hold both (regression: drafter KV overflow took the step down)."""
    drafter = "random" if method == "dart" else str(tiny_baselines[method])
    eng = make_engine(tiny, method, drafter, batch=2, seq=160)
    ref = make_engine(tiny, "none", batch=1, seq=160)
    long_ids = list(range(1000, 1100))                                 # 100-token prompt
    sp_a = SamplingParams(max_new_tokens=100, ignore_eos=True)
    sp_b = SamplingParams(max_new_tokens=20, ignore_eos=True)
    a = eng.add_request("Hello", sp_a)
    out: dict[str, list[int]] = {a: []}
    while len(out[a]) < 70:
        for o in eng.step():
            out[o.request_id] += o.new_token_ids
    b = eng.add_request(long_ids, sp_b)
    out[b] = []
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id] += o.new_token_ids
    assert out[a] == ref.generate("Hello", sp_a)[0].token_ids
    assert out[b] == ref.generate(long_ids, sp_b)[0].token_ids


def test_bench_runs_every_own_method(tiny_dirs, tiny_baselines, tmp_path):
    """`dart-ray bench` drives the baselines through the same harness: per-method drafter dirs and
    knobs, fp32 outputs equal AR, a draft-time split and tau reported for each."""
    from dart_ray.bench.runner import format_table, run_bench

    methods = ["ar", "ngram", "sps", "medusa", "eagle", "dart"]
    rep = run_bench(PROMPTS[:2], methods, model=str(tiny_dirs["llama"]), drafter="random",
                    ngram="none", max_new_tokens=8, dtype="fp32", progress=False,
                    drafters={m: str(tiny_baselines[m]) for m in ("sps", "medusa", "eagle")},
                    decodings={"sps": DecodingConfig(draft_depth=3),
                               "eagle": DecodingConfig(draft_depth=3, top_k=4, beam_width=4,
                                                       tree_budget=12)})
    for m in methods:
        e = rep["methods"][m]
        assert e["outputs_match_ar"] is True, m
        assert e["tokens_per_s"] > 0 and e["mean_accepted_len"] >= 1.0
    assert rep["config"]["decodings"]["sps"]["draft_depth"] == 3
    assert "| eagle |" in format_table(rep)


def test_bench_runs_a_method_twice_as_variants(tiny_dirs, tmp_path):
    """`dart@b` runs DART again with its own drafter and knobs in the same interleaved run (an A/B
    of two drafters); a variant of a transformers method, an unnamed one, a repeat, or a drafter
    for a method not listed is refused."""
    from dart_ray.bench.runner import run_bench

    kw = {"model": str(tiny_dirs["llama"]), "drafter": "random", "ngram": "none",
          "max_new_tokens": 8, "dtype": "fp32", "progress": False}
    rep = run_bench(PROMPTS[:2], ["ar", "dart", "dart@b"], drafters={"dart@b": "random"},
                    decodings={"dart@b": DecodingConfig(tree_budget=4, top_k=2, beam_width=2)},
                    **kw)
    assert set(rep["methods"]) == {"ar", "dart", "dart@b"}
    assert all(rep["methods"][m]["outputs_match_ar"] for m in ("dart", "dart@b"))
    assert rep["config"]["decodings"]["dart@b"]["tree_budget"] == 4
    for methods, err in ((["ar", "hf@x"], "variant"), (["ar", "dart@"], "variant"),
                         (["ar", "foo@x"], "unknown"), (["dart", "dart"], "twice")):
        with pytest.raises(ValueError, match=err):
            run_bench(PROMPTS[:1], methods, **kw)
    with pytest.raises(ValueError, match="not among the methods"):   # a misspelt variant's drafter
        run_bench(PROMPTS[:1], ["ar", "dart@b"], drafters={"dart@c": "random"}, **kw)


def test_bench_samples_and_still_compares_with_ar(tiny_dirs):
    """``--temperature``: every prompt sampled with one seed; position-keyed sampling makes the
    methods' fp32 outputs equal AR's, so "matches ar" stays a real check; transformers' methods
    (greedy only) are refused."""
    from dart_ray.bench.runner import format_table, run_bench

    kw = {"model": str(tiny_dirs["llama"]), "drafter": "random", "ngram": "none",
          "max_new_tokens": 12, "dtype": "fp32", "progress": False}
    rep = run_bench(PROMPTS[:2], ["ar", "ngram", "dart"], temperature=0.8, top_p=0.95, seed=5,
                    **kw)
    assert all(rep["methods"][m]["outputs_match_ar"] is True for m in ("ngram", "dart"))
    assert rep["config"]["sampling"] == {"temperature": 0.8, "top_p": 0.95, "top_k": 0, "seed": 5}
    assert "sampling temperature 0.8" in format_table(rep)
    # at a divergence the bench measures the two tokens' gap in the position's exponential race
    # (log p/E): the token AR sampled there wins it, so the other's gap to it is negative
    from dart_ray.bench.runner import divergence_gaps
    from dart_ray.models import load_target

    target = load_target(kw["model"], "fp32", max_seq_len=512)
    sp = SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.95, seed=5)
    eng = Engine(target, make_drafter(EngineConfig(method="none", dtype="fp32"), target),
                 EngineConfig(method="none", dtype="fp32", max_seq_len=512))
    ids = eng.encode_prompt(PROMPTS[0])
    a = eng.generate([ids], sp)[0].token_ids
    b = a[:5] + [(a[5] + 1) % target.args.vocab_size] + a[6:]
    gap = divergence_gaps(target.model, [ids], [b], [a], sp)[0]
    assert gap < 0 and divergence_gaps(target.model, [ids], [a], [b], sp) == [-gap]
    assert 0.0 < -gap < float("inf")        # log units: a wrong token is whole units away
    # a token outside this forward's top-k support has no finite gap (was inf / nan in the JSON)
    k1 = SamplingParams(max_new_tokens=12, temperature=0.8, top_k=1, seed=5)
    assert divergence_gaps(target.model, [ids], [b], [a], k1) == [None]
    with pytest.raises(ValueError, match="greedy only"):
        run_bench(PROMPTS[:1], ["ar", "hf"], temperature=0.8, **kw)


@pytest.mark.parametrize("batch", [1, 4])
def test_dart_with_lookup_paths_equals_ar_and_accepts_more(tiny, ar_out, batch):
    """DART's tree with prompt-lookup paths merged in stays exact; on the repetitive prompts the
    merged paths are accepted (an untrained drafter alone accepts almost nothing)."""
    base = DecodingConfig(tree_budget=8, top_k=4, beam_width=3, lookup_paths=0)
    plain = make_engine(tiny, "dart", "random", batch=batch, decoding=base, adaptive=False)
    merged = make_engine(tiny, "dart", "random", batch=batch, adaptive=False,
                         decoding=base.replace(lookup_paths=2, lookup_min_match=1, lookup_len=8))
    assert merged.drafter.max_tree_nodes(merged.decoding_for(1)) == 8 + 2 * 8
    assert [o.token_ids for o in plain.generate(PROMPTS, GREEDY)] == ar_out
    assert [o.token_ids for o in merged.generate(PROMPTS, GREEDY)] == ar_out
    assert merged.stats().mean_accepted_len > plain.stats().mean_accepted_len


def test_lookup_paths_reach_past_the_drafter_depth(tiny, ar_out):
    """``lookup_len`` is independent of ``draft_depth``: a 2-level DART tree with 12-token lookup
    paths accepts runs deeper than its drafter could propose, and stays exact."""
    base = DecodingConfig(draft_depth=2, tree_budget=4, top_k=4, beam_width=2, lookup_paths=2,
                          lookup_min_match=1, lookup_len=2)
    # fixed trees (adaptive off): this is about the tree's shape, not the controller's choice of
    # size
    short = make_engine(tiny, "dart", "random", batch=2, decoding=base, adaptive=False)
    long = make_engine(tiny, "dart", "random", batch=2, decoding=base.replace(lookup_len=12),
                       adaptive=False)
    assert short.drafter.max_tree_nodes(short.decoding_for(1)) == 4 + 2 * 2
    assert long.drafter.max_tree_nodes(long.decoding_for(1)) == 4 + 2 * 12
    assert [o.token_ids for o in short.generate(PROMPTS, GREEDY)] == ar_out
    assert [o.token_ids for o in long.generate(PROMPTS, GREEDY)] == ar_out
    assert len(short.stats().accepted_per_depth) <= 2
    assert len(long.stats().accepted_per_depth) > 2
    assert long.stats().mean_accepted_len > short.stats().mean_accepted_len


def test_divergence_gaps_measure_the_split(tiny, ar_out):
    """The bench's near-tie diagnostic: the gap is the target's logit difference at the first
    divergence (small for a runner-up token, large for a wrong one); equal outputs give none."""
    from dart_ray.bench.runner import divergence_gaps

    eng = make_engine(tiny, "none", batch=1)
    p = eng.encode_prompt(PROMPTS[0])
    ref = ar_out[0]
    j = 5
    from dart_ray.masks import attention_mask, causal_ancestors

    seq = torch.tensor([p + ref[:j]])
    T = seq.shape[1]
    mask = attention_mask([0], causal_ancestors(T), T, torch.float32)
    logits = tiny.model(seq, torch.arange(T)[None], mask, tiny.model.new_cache(1, T),
                        starts=[0]).logits[0, -1]
    top2 = logits.topk(2).indices.tolist()
    worst = int(logits.argmin())
    assert top2[0] == ref[j]
    runner_up = ref[:j] + [top2[1]] + ref[j + 1:]
    wrong = ref[:j] + [worst] + ref[j + 1:]
    gaps = divergence_gaps(tiny.model, [p] * 4, [ref] * 4, [ref, runner_up, wrong, ref[:-3]])
    assert len(gaps) == 3 and gaps[2] is None                 # a length cut is not a token split
    assert gaps[0] == pytest.approx(float(logits[top2[0]] - logits[top2[1]]), abs=1e-4)
    assert gaps[1] > gaps[0] > 0


def test_max_model_len_is_what_a_request_can_use(tiny):
    """The tree scratch lies beyond max_model_len: a prompt of max_model_len - 1 tokens is admitted
    whatever the schedule, and prompt + max_new_tokens == max_model_len gets every token (trees
    larger than the reserve are cut to it, never the request)."""
    from dart_ray.profiles import DecodingSchedule

    eng = make_engine(tiny, "dart", "random", batch=2, seq=128,
                      decoding=DecodingConfig(tree_budget=8))
    assert eng.max_model_len == 128
    eng.set_decoding(DecodingSchedule("t", ((1, DecodingConfig(tree_budget=8)),
                                            (8, DecodingConfig(tree_budget=120, lookup_paths=4)))))
    eng.check_prompt(list(range(1, 128)))
    with pytest.raises(PromptTooLongError, match="at most 127"):
        eng.check_prompt(list(range(1, 129)))
    prompts = [list(range(1, 101)), list(range(5, 125))]
    outs = eng.generate(prompts, [SamplingParams(max_new_tokens=28, ignore_eos=True),
                                  SamplingParams(max_new_tokens=8, ignore_eos=True)])
    assert [len(o.token_ids) for o in outs] == [28, 8]
    assert {o.finish_reason for o in outs} == {"length"}
    # past max_model_len the request ends there with "length" (prompt 120 + 8 = 128)
    out = eng.generate(list(range(5, 125)), SamplingParams(max_new_tokens=50, ignore_eos=True))[0]
    assert len(out.token_ids) == 8 and out.finish_reason == "length"


@pytest.mark.parametrize("method", ["dart", "eagle", "sps"])
def test_drafting_that_catches_up_is_not_learned_as_a_steps_cost(tiny, tiny_baselines, method):
    """A request's first drafter forward also takes its prompt: the controller must not learn that
    time as a step's drafting cost. Sizes are forced (4, 4, plain, 4, then 4 twice with a second
    request joined); the forward after the plain step is an ordinary one (the controller skips
    its time as after any plain step)."""
    drafter = "random" if method == "dart" else str(tiny_baselines[method])
    eng = make_engine(tiny, method, drafter, batch=2,
                      decoding=DecodingConfig(tree_budget=4, top_k=4, beam_width=3,
                                              lookup_paths=0, draft_depth=4))
    plans = iter([4, 4, 0, 4, 4, 4])
    eng.controller.plan = lambda B, max_nodes, context=0: next(plans)
    seen: list[tuple[int, int, bool]] = []
    record = eng.controller.record

    def spy(B, n_used, *args, catch_up=False, **kw):
        seen.append((B, n_used, catch_up))
        return record(B, n_used, *args, catch_up=catch_up, **kw)

    eng.controller.record = spy
    eng.add_request(PROMPTS[0], SamplingParams(max_new_tokens=40, ignore_eos=True))
    for _ in range(4):
        eng.step()
    eng.add_request(PROMPTS[1], SamplingParams(max_new_tokens=40, ignore_eos=True))
    for _ in range(2):
        eng.step()
    assert seen == [(1, 4, True), (1, 4, False), (1, 0, False), (1, 4, False),
                    (2, 4, True), (2, 4, False)]


def test_a_sliding_window_model_runs_to_its_window_plus_one_exactly(tmp_path, smollm_dir):
    """A Mistral with a sliding window of W: the engine caps a request at W + 1 tokens whatever
    the method (the last emitted token comes from position W - 1, which sees every key; the tree
    scratch beyond is never emitted), and its greedy tokens equal transformers' (which slides)."""
    from conftest import make_tiny_checkpoint
    from transformers import AutoModelForCausalLM

    window = 24
    d = make_tiny_checkpoint(tmp_path / "mistral", "mistral", smollm_dir, seed=3,
                             sliding_window=window)
    hf = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    target = load_target(str(d), "fp32", max_seq_len=128)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], list(range(100, 120)), [9, 8, 7, 6]]
    refs = []
    for p in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), max_new_tokens=window + 8, do_sample=False,
                              min_new_tokens=window + 8)[0, len(p):].tolist()
        refs.append(out)
    for method in ("none", "ngram", "dart"):
        eng = make_engine(target, method, drafter="random" if method == "dart" else None,
                          batch=3, seq=128)
        assert eng.max_model_len == window + 1
        outs = eng.generate(prompts, SamplingParams(max_new_tokens=window, ignore_eos=True))
        for p, o, ref in zip(prompts, outs, refs, strict=True):
            assert len(p) + len(o.token_ids) == window + 1 and o.finish_reason == "length"
            assert o.token_ids == ref[:len(o.token_ids)], method
    # the window matters: transformers without it continues differently past W + 1
    unslid = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32,
                                                  sliding_window=None).eval()
    p = prompts[1]
    with torch.no_grad():
        free = unslid.generate(torch.tensor([p]), max_new_tokens=window + 8, do_sample=False,
                               min_new_tokens=window + 8)[0, len(p):].tolist()
    assert free[:window + 1 - len(p)] == refs[1][:window + 1 - len(p)] and free != refs[1]


def test_sampling_params_read_as_openai_and_name_bad_types():
    """A plain string is one stop string (it was split into characters: 'xyz' stopped at the
    first 'y'); a wrong type names its field instead of being rounded or failing later."""
    assert SamplingParams(stop="xyz").stop == ("xyz",)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(seed=np.int64(3), top_k=np.int32(5)).seed == 3
    for kw, field in (({"max_new_tokens": 2.5}, "max_new_tokens"),
                      ({"max_new_tokens": True}, "max_new_tokens"), ({"top_k": 2.5}, "top_k"),
                      ({"temperature": "0.5"}, "temperature"), ({"seed": 1.5}, "seed"),
                      ({"seed": 2**64}, "seed"), ({"seed": "abc"}, "seed"),
                      ({"top_k": 2**63}, "top_k"), ({"top_k": -1}, "top_k"),
                      ({"ignore_eos": "no"}, "ignore_eos"), ({"stop": None}, "stop"),
                      ({"stop": [""]}, "stop"), ({"stop_token_ids": "12"}, "stop_token_ids"),
                      ({"stop_token_ids": 5}, "stop_token_ids")):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kw)


def test_a_seeded_request_samples_the_same_alone_or_batched_over_a_long_flat_output(
        tmp_path_factory, smollm_dir):
    """fp32, a flat distribution (a tiny model's 49k-token vocabulary, T = 1, top_p 0.9): the
    inverse-CDF draw the exponential race replaced put each token's interval on the sum of every
    probability before it in vocabulary order, so the rounding of a batch-4 forward moved an edge
    and plain decoding itself parted from the same request alone (prompts 1-3 at tokens 104, 137
    and 69 with this model; `ngram` at batch 1 too, at 104)."""
    from conftest import make_tiny_checkpoint

    tiny = load_target(str(make_tiny_checkpoint(tmp_path_factory.mktemp("flat") / "qwen2", "qwen2",
                                                smollm_dir, seed=0)), "fp32", max_seq_len=512)
    prompts = ["Write a short story about a dragon.", "def quicksort(arr):", "The history of Rome",
               "Explain photosynthesis to a child."]
    sps = [SamplingParams(max_new_tokens=150, temperature=1.0, top_p=0.9, seed=100 + i,
                          ignore_eos=True) for i in range(4)]
    knobs = DecodingConfig(tree_budget=8, top_k=4, beam_width=4)
    alone = [make_engine(tiny, "none", batch=1, adaptive=False).generate(p, sp)[0].token_ids
             for p, sp in zip(prompts, sps, strict=True)]
    for method, batch in (("none", 4), ("ngram", 1)):
        eng = make_engine(tiny, method, batch=batch, decoding=knobs, adaptive=False)
        assert [o.token_ids for o in eng.generate(prompts, sps)] == alone, method


def test_a_top_k_past_the_vocabulary_samples_beside_others_as_no_top_k(tiny):
    """A top_k of 2**63 failed every request of the step it was admitted in (an int64 overflow
    inside acceptance); now SamplingParams refuses it, and any representable top_k >= V samples
    as top_k = 0 while another request decodes beside it."""
    eng = make_engine(tiny, "ngram", batch=2, adaptive=False)
    plain = SamplingParams(max_new_tokens=12, temperature=1.0, seed=5, ignore_eos=True)
    ref = eng.generate(PROMPTS[0], plain)[0].token_ids
    huge = plain.__class__(**{**plain.__dict__, "top_k": 2**63 - 1})
    outs = eng.generate([PROMPTS[0], PROMPTS[1]], [huge, GREEDY])
    assert outs[0].token_ids == ref and len(outs[1].token_ids) == GREEDY.max_new_tokens


def test_encode_prompt_adds_the_tokenizers_bos_to_text_as_hf_and_vllm_do():
    """Plain text gets the tokenizer's special tokens (a Llama tokenizer's BOS) by default; a chat
    template writes its own, so none are added there unless asked; ids pass through."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from dart_ray import encode_prompt
    vocab = {"<s>": 0, "</s>": 1, "Hello": 2, "world": 3, "[UNK]": 4}
    t = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok = PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>")
    tok.chat_template = "<s>{% for m in messages %}{{ m['content'] }} {% endfor %}"
    assert encode_prompt(tok, "Hello world") == [0, 2, 3] == tok("Hello world")["input_ids"]
    assert encode_prompt(tok, "Hello world", add_special_tokens=False) == [2, 3]
    assert encode_prompt(tok, "Hello", chat=True) == [0, 2]
    msgs = [{"role": "user", "content": "Hello"}]
    assert encode_prompt(tok, msgs) == [0, 2]
    assert encode_prompt(tok, msgs, add_special_tokens=True) == [0, 0, 2]   # asked: doubled
    assert encode_prompt(tok, [3, 2]) == [3, 2]


def test_a_step_that_fails_part_way_ends_every_request_and_leaves_the_engine_exact(tiny, ar_out):
    """A failure after the step committed KV entries (here the drafter's observe) could leave
    rows half-committed: every request ends ('abort', an open stream gets its final output, its
    tokens a prefix of plain decoding's), nothing is left behind, the next generation is exact.
    A params of the wrong type is a TypeError before anything is added."""
    eng = make_engine(tiny, "ngram", batch=4, adaptive=False)
    other = eng.stream(PROMPTS[1], GREEDY)
    got = list(next(other).new_token_ids)
    observe, calls = eng.drafter.observe, [0]

    def failing_observe(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("transient drafter failure")
        return observe(*args, **kwargs)

    eng.drafter.observe = failing_observe
    with pytest.raises(RuntimeError, match="transient"):
        eng.generate([PROMPTS[0], PROMPTS[2]], GREEDY)
    rest = list(other)
    got += [t for o in rest for t in o.new_token_ids]
    assert rest[-1].finish_reason == "abort" and got == ar_out[1][:len(got)]
    assert not eng.requests and not eng.running and not eng.waiting and not eng._streams
    assert [c.token_ids for c in eng.generate(PROMPTS, GREEDY)] == ar_out
    with pytest.raises(TypeError, match="SamplingParams"):
        eng.generate("Hello", {"max_new_tokens": 3})
    assert not eng.has_unfinished()
