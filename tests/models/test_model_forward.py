"""Our Llama-family forward (dart_ray.models.llama) against transformers, plus the cache/mask/tree
machinery around it: prefill + decode, padded and ragged batches, taps, logits_at, tree masks,
KV commits, row moves, reduced precision, and the real SmolLM2 (slow)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from conftest import FAMILIES, make_tiny_checkpoint

from dart_ray.masks import attention_mask, causal_ancestors
from dart_ray.models import load_target
from dart_ray.tree import pack_trees

MAX_SEQ = 160


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One intra-op thread: the tiny ops here gain nothing from more, and on a shared 2-core box
    extra OpenMP threads spin-wait against other processes (10x slower)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------


def load_hf(model_dir: Path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()


@torch.no_grad()
def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    """[T, V] full-sequence logits of one prompt, no cache."""
    return hf(torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def hf_hidden(hf, ids: list[int]) -> tuple[torch.Tensor, ...]:
    return hf(torch.tensor([ids]), output_hidden_states=True).hidden_states


def fwd(model, cache, tokens, *, rows: slice | None = None, starts: list[int] | None = None,
        positions: torch.Tensor | None = None, anc: torch.Tensor | None = None, **kw):
    """One forward of ``tokens`` [B, T] written after ``starts`` (default: committed lengths)."""
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    if tokens.dim() == 1:
        tokens = tokens[None]
    B, T = tokens.shape
    rows = slice(0, B) if rows is None else rows
    starts = list(cache.lengths[rows]) if starts is None else list(starts)
    if positions is None:
        positions = torch.tensor(starts)[:, None] + torch.arange(T)[None, :]
    anc = causal_ancestors(T) if anc is None else anc
    mask = attention_mask(starts, anc, max(starts) + T, model.embed.weight.dtype)
    return model(tokens, positions, mask, cache, rows=rows, starts=starts, **kw)


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, rel: float = 1e-4,
                        what: str = "") -> None:
    ours, ref = ours.float(), ref.float()
    assert ours.shape == ref.shape, (what, ours.shape, ref.shape)
    scale = max(1.0, ref.abs().max().item())
    err = (ours - ref).abs().max().item()
    assert err <= rel * scale, f"{what}: max |diff| {err:.3g} > {rel:g} * scale {scale:.3g}"


def rand_ids(n: int, seed: int, vocab: int = 49152) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


# ----------------------------------------------------------------------------------------------
# fixtures: per family, our fp32 model and the transformers oracle (loaded once per module)
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tiny_dirs):
    d = tiny_dirs[request.param]
    ours = load_target(str(d), "fp32", max_seq_len=MAX_SEQ)
    return request.param, ours.model, load_hf(d)


@pytest.fixture(scope="module")
def llama_pair(tiny_dirs):
    d = tiny_dirs["llama"]
    return load_target(str(d), "fp32", max_seq_len=MAX_SEQ).model, load_hf(d)


# ----------------------------------------------------------------------------------------------
# (a)-(d): parity with transformers per family
# ----------------------------------------------------------------------------------------------


def test_full_prompt_matches_hf(pair):
    fam, model, hf = pair
    ids = rand_ids(17, 1)
    cache = model.new_cache(1, MAX_SEQ)
    out = fwd(model, cache, [ids])
    assert out.logits.shape == (1, 17, model.args.vocab_size)
    assert out.taps is None
    assert_logits_close(out.logits[0], hf_logits(hf, ids), what=fam)


def test_prefill_then_decode_matches_hf(pair):
    fam, model, hf = pair
    ids = rand_ids(24, 2)
    ref = hf_logits(hf, ids)
    P = 9
    cache = model.new_cache(1, MAX_SEQ)
    out = fwd(model, cache, [ids[:P]])
    cache.commit_all(slice(0, 1), [P])
    assert_logits_close(out.logits[0], ref[:P], what=f"{fam} prefill")
    pos = P
    # one token at a time
    for _ in range(4):
        out = fwd(model, cache, [ids[pos:pos + 1]])
        assert_logits_close(out.logits[0], ref[pos:pos + 1], what=f"{fam} decode@{pos}")
        cache.commit_all(slice(0, 1), [1])
        pos += 1
    # chunks of different sizes (a chunk is a chain "tree")
    for chunk in (3, 5, 1, 2):
        out = fwd(model, cache, [ids[pos:pos + chunk]])
        assert_logits_close(out.logits[0], ref[pos:pos + chunk], what=f"{fam} chunk@{pos}")
        cache.commit_all(slice(0, 1), [chunk])
        pos += chunk
    assert pos == len(ids) == cache.lengths[0]


def test_padded_batch_and_ragged_decode_match_hf(pair):
    """Two prompts right-padded into one prefill (starts [0, 0]); then decode steps where the rows
    have different committed lengths (per-row starts, scattered cache writes)."""
    fam, model, hf = pair
    a, b = rand_ids(6, 3), rand_ids(11, 4)
    T = len(b)
    pad = 2
    tokens = torch.tensor([a + [pad] * (T - len(a)), b])
    cache = model.new_cache(2, MAX_SEQ)
    out = fwd(model, cache, tokens)
    assert_logits_close(out.logits[0, :len(a)], hf_logits(hf, a), what=f"{fam} padded row 0")
    assert_logits_close(out.logits[1], hf_logits(hf, b), what=f"{fam} padded row 1")
    cache.commit_all(slice(0, 2), [len(a), len(b)])
    assert cache.lengths[:2] == [len(a), len(b)]

    # ragged decode: one token per row, then a 3-token chunk per row, then one more token
    ext_a, ext_b = rand_ids(5, 5), rand_ids(5, 6)
    seq_a, seq_b = list(a), list(b)
    for k in (1, 3, 1):
        new_a, new_b = ext_a[:k], ext_b[:k]
        ext_a, ext_b = ext_a[k:], ext_b[k:]
        out = fwd(model, cache, [new_a, new_b])
        seq_a += new_a
        seq_b += new_b
        assert_logits_close(out.logits[0], hf_logits(hf, seq_a)[-k:], what=f"{fam} ragged row 0")
        assert_logits_close(out.logits[1], hf_logits(hf, seq_b)[-k:], what=f"{fam} ragged row 1")
        cache.commit_all(slice(0, 2), [k, k])


def test_taps_match_hf_hidden_states(pair):
    fam, model, hf = pair
    ids = rand_ids(10, 7)
    hs = hf_hidden(hf, ids)
    assert len(hs) == model.args.num_layers + 1
    cache = model.new_cache(1, MAX_SEQ)
    out = fwd(model, cache, [ids], taps=(0, 2, 3))
    H = model.args.hidden_size
    assert out.taps.shape == (1, 10, 3 * H)
    ref = torch.cat([hs[0], hs[2], hs[3]], dim=-1)
    assert_logits_close(out.taps, ref, what=f"{fam} taps")
    # the order of the tuple is the order of the concatenation
    cache2 = model.new_cache(1, MAX_SEQ)
    out2 = fwd(model, cache2, [ids], taps=(3, 0), return_logits=False)
    assert out2.logits is None
    assert_logits_close(out2.taps, torch.cat([hs[3], hs[0]], dim=-1), what=f"{fam} taps (3, 0)")


# ----------------------------------------------------------------------------------------------
# config variants (llama family)
# ----------------------------------------------------------------------------------------------

VARIANTS = {
    "tied": dict(tie_word_embeddings=True),
    "rope_llama3": dict(rope_parameters={"rope_type": "llama3", "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 64,
                                         "rope_theta": 10000.0}),
    "rope_linear": dict(rope_parameters={"rope_type": "linear", "factor": 2.0,
                                         "rope_theta": 500000.0}),
    "attention_bias": dict(attention_bias=True),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_llama_config_variants(variant, tmp_path, smollm_dir):
    d = make_tiny_checkpoint(tmp_path / variant, "llama", smollm_dir, seed=11, **VARIANTS[variant])
    tgt = load_target(str(d), "fp32", max_seq_len=MAX_SEQ)
    model, hf = tgt.model, load_hf(d)
    args = tgt.args
    if variant == "tied":
        assert args.tie_word_embeddings
        assert model.lm_head.weight.data_ptr() == model.embed.weight.data_ptr()
    elif variant.startswith("rope"):
        assert args.rope_scaling is not None and args.rope_scaling["rope_type"] == variant[5:]
    elif variant == "attention_bias":
        assert args.qkv_bias and args.o_bias
        assert model.layers[0].attn.o.bias is not None
    # 100 tokens: well past original_max_position_embeddings=64 for llama3 scaling
    ids = rand_ids(100, 12)
    ref = hf_logits(hf, ids)
    cache = model.new_cache(1, MAX_SEQ)
    out = fwd(model, cache, [ids[:90]])
    cache.commit_all(slice(0, 1), [90])
    assert_logits_close(out.logits[0], ref[:90], what=f"{variant} prefill")
    for pos in range(90, 100):
        out = fwd(model, cache, [ids[pos:pos + 1]])
        cache.commit_all(slice(0, 1), [1])
        assert_logits_close(out.logits[0], ref[pos:pos + 1], what=f"{variant} decode@{pos}")


def test_qwen3_attention_bias(tmp_path, smollm_dir):
    """Qwen3 with attention_bias=True has biases on q, k, v *and* o (as in transformers)."""
    d = make_tiny_checkpoint(tmp_path / "q3b", "qwen3", smollm_dir, seed=13, attention_bias=True)
    tgt = load_target(str(d), "fp32", max_seq_len=MAX_SEQ)
    hf = load_hf(d)
    ids = rand_ids(12, 14)
    out = fwd(tgt.model, tgt.model.new_cache(1, MAX_SEQ), [ids])
    assert_logits_close(out.logits[0], hf_logits(hf, ids), what="qwen3 attention_bias")


# ----------------------------------------------------------------------------------------------
# logits_at, tree masks, commits, row management
# ----------------------------------------------------------------------------------------------


def test_logits_at_gathers_positions(llama_pair):
    model, _ = llama_pair
    toks = torch.tensor([rand_ids(8, 20), rand_ids(8, 21)])
    full = fwd(model, model.new_cache(2, MAX_SEQ), toks)
    at = torch.tensor([[7, 0, 3], [2, 2, 5]])
    part = fwd(model, model.new_cache(2, MAX_SEQ), toks, logits_at=at, taps=(1,))
    assert part.logits.shape == (2, 3, model.args.vocab_size)
    assert part.taps.shape == (2, 8, model.args.hidden_size)  # taps are not gathered
    for b in range(2):
        for k in range(3):
            assert_logits_close(part.logits[b, k], full.logits[b, at[b, k]], rel=1e-5)


# Row 0 tree (draft nodes 1..7, parents before children):
#   0 -> 1 -> 3 -> 6
#     |    `-> 4 -> 7
#     `-> 2 -> 5
TREE0 = [0, 0, 1, 1, 2, 3, 4]    # parents of nodes 1..7 (0 = root)
TREE1 = [0, 0, 1, 1]             # row 1: a smaller tree (padded to 7 draft nodes)


def path_to(parents: list[int], node: int) -> list[int]:
    """Node indices root..node for a (draft-node) parent list."""
    path = [node]
    while path[-1] != 0:
        path.append(parents[path[-1] - 1])
    return path[::-1]


@pytest.fixture(scope="module")
def tree_setup(llama_pair):
    """Two rows with different committed prefixes, one tree per row, forwarded in one batch."""
    model, hf = llama_pair
    prefixes = [rand_ids(7, 30), rand_ids(12, 31)]
    roots = torch.tensor([rand_ids(1, 32)[0], rand_ids(1, 33)[0]])
    specs = [(rand_ids(len(TREE0), 34), TREE0), (rand_ids(len(TREE1), 35), TREE1)]
    tree = pack_trees(roots, specs)
    tree.validate()
    return model, hf, prefixes, roots, specs, tree


def prefill_rows(model, cache, prefixes: list[list[int]]) -> None:
    """Prefill each prefix into its own row (row i) and commit it."""
    for i, p in enumerate(prefixes):
        fwd(model, cache, [p], rows=slice(i, i + 1))
        cache.commit_all(slice(i, i + 1), [len(p)])


def tree_forward(model, cache, tree, prefixes):
    starts = [len(p) for p in prefixes]
    positions = torch.tensor(starts)[:, None] + tree.depths
    return fwd(model, cache, tree.tokens, starts=starts, positions=positions, anc=tree.ancestors())


def test_tree_forward_equals_each_branch(tree_setup):
    model, hf, prefixes, roots, specs, tree = tree_setup
    cache = model.new_cache(2, MAX_SEQ)
    prefill_rows(model, cache, prefixes)
    out = tree_forward(model, cache, tree, prefixes)
    assert cache.lengths[:2] == [len(p) for p in prefixes]  # a forward commits nothing
    for b, (toks, pars) in enumerate(specs):
        all_tokens = [int(roots[b])] + toks
        for node in range(len(toks) + 1):
            seq = prefixes[b] + [all_tokens[i] for i in path_to(pars, node)]
            # the oracle: the plain sequence through transformers, and through our own chain forward
            ref = hf_logits(hf, seq)[-1]
            assert_logits_close(out.logits[b, node], ref, what=f"row {b} node {node}")
            chain = fwd(model, model.new_cache(1, MAX_SEQ), [seq],
                        logits_at=torch.tensor([[len(seq) - 1]]))
            assert_logits_close(out.logits[b, node], chain.logits[0, 0], rel=2e-5,
                                what=f"row {b} node {node}")


@pytest.mark.parametrize("leaves", [(6, 4), (7, 3), (0, 0), (2, 2)])
def test_commit_path_equals_chain_cache(tree_setup, leaves):
    model, hf, prefixes, roots, specs, tree = tree_setup
    cache = model.new_cache(2, MAX_SEQ)
    prefill_rows(model, cache, prefixes)
    tree_forward(model, cache, tree, prefixes)
    paths = [path_to(pars, leaf) for (_, pars), leaf in zip(specs, leaves, strict=True)]
    A = max(len(p) for p in paths)
    path_t = torch.tensor([p + [0] * (A - len(p)) for p in paths])
    num = [len(p) for p in paths]
    cache.commit(slice(0, 2), path_t, num)
    nxt = rand_ids(2, 36)
    logits_tree = fwd(model, cache, [[nxt[0]], [nxt[1]]]).logits
    for b, (toks, _) in enumerate(specs):
        all_tokens = [int(roots[b])] + toks
        seq = prefixes[b] + [all_tokens[i] for i in paths[b]]
        assert cache.lengths[b] == len(seq)
        chain_cache = model.new_cache(1, MAX_SEQ)
        fwd(model, chain_cache, [seq])
        chain_cache.commit_all(slice(0, 1), [len(seq)])
        n = len(seq)
        torch.testing.assert_close(cache.k[:, b, :, :n], chain_cache.k[:, 0, :, :n], atol=1e-5,
                                   rtol=1e-4)
        torch.testing.assert_close(cache.v[:, b, :, :n], chain_cache.v[:, 0, :, :n], atol=1e-5,
                                   rtol=1e-4)
        logits_chain = fwd(model, chain_cache, [[nxt[b]]]).logits
        assert_logits_close(logits_tree[b], logits_chain[0], rel=2e-5, what=f"next step row {b}")
        assert_logits_close(logits_tree[b, 0], hf_logits(hf, seq + [nxt[b]])[-1],
                            what=f"next step row {b} (hf)")


def test_commit_rejects_non_topological_path(llama_pair):
    model, _ = llama_pair
    cache = model.new_cache(1, MAX_SEQ)
    fwd(model, cache, [rand_ids(4, 40)])
    with pytest.raises(ValueError):
        cache.commit(slice(0, 1), torch.tensor([[1, 0]]), [2])


def test_rows_slice_and_move_row(llama_pair):
    model, hf = llama_pair
    a, b = rand_ids(5, 41), rand_ids(9, 42)
    cache = model.new_cache(4, MAX_SEQ)
    # rows 1 and 2 of a 4-row cache, right-padded batch prefill
    toks = torch.tensor([a + [0] * (len(b) - len(a)), b])
    out = fwd(model, cache, toks, rows=slice(1, 3))
    assert_logits_close(out.logits[0, :len(a)], hf_logits(hf, a), what="rows 1:3 row a")
    assert_logits_close(out.logits[1], hf_logits(hf, b), what="rows 1:3 row b")
    cache.commit_all(slice(1, 3), [len(a), len(b)])
    assert cache.lengths == [0, len(a), len(b), 0]
    step = rand_ids(2, 43)
    out = fwd(model, cache, [[step[0]], [step[1]]], rows=slice(1, 3))
    assert_logits_close(out.logits[0, 0], hf_logits(hf, a + [step[0]])[-1],
                        what="rows 1:3 decode a")
    assert_logits_close(out.logits[1, 0], hf_logits(hf, b + [step[1]])[-1],
                        what="rows 1:3 decode b")
    cache.commit_all(slice(1, 3), [1, 1])
    a, b = a + [step[0]], b + [step[1]]

    # compaction: request in row 1 leaves, row 2 moves to row 1 and keeps decoding there
    cache.reset_row(1)
    cache.move_row(2, 1)
    assert cache.lengths == [0, len(b), 0, 0]
    nxt = rand_ids(1, 44)
    out = fwd(model, cache, [nxt], rows=slice(1, 2))
    assert_logits_close(out.logits[0, 0], hf_logits(hf, b + nxt)[-1], what="after move_row")
    # the emptied row can take a fresh request
    fresh = rand_ids(6, 45)
    out = fwd(model, cache, [fresh], rows=slice(2, 3))
    assert_logits_close(out.logits[0], hf_logits(hf, fresh), what="fresh row after move")


def test_mask_width_mismatch_raises(llama_pair):
    model, _ = llama_pair
    cache = model.new_cache(1, MAX_SEQ)
    ids = torch.tensor([rand_ids(4, 46)])
    mask = attention_mask([0], causal_ancestors(4), 5, torch.float32)
    with pytest.raises(ValueError):
        model(ids, torch.arange(4)[None], mask, cache)


def test_cache_overflow_raises(llama_pair):
    model, _ = llama_pair
    cache = model.new_cache(1, 8)
    with pytest.raises(ValueError, match="overflow"):
        fwd(model, cache, [rand_ids(9, 47)])


# ----------------------------------------------------------------------------------------------
# reduced precision
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_half_precision_close_to_fp32(dtype, tiny_dirs, llama_pair):
    model32, _ = llama_pair
    model = load_target(str(tiny_dirs["llama"]), dtype, max_seq_len=MAX_SEQ).model
    want = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    assert model.embed.weight.dtype == want
    ids = rand_ids(20, 50)
    ref = fwd(model32, model32.new_cache(1, MAX_SEQ), [ids[:16]]).logits[0]
    cache = model.new_cache(1, MAX_SEQ)
    assert cache.k.dtype == want
    out = fwd(model, cache, [ids[:16]])
    cache.commit_all(slice(0, 1), [16])
    assert out.logits.dtype == want
    assert torch.isfinite(out.logits).all()
    lo = out.logits[0].float()
    rel = (lo - ref).abs().max().item() / ref.abs().max().item()
    assert rel < 0.05, rel
    agree = (lo.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.75, agree
    # decode keeps working in reduced precision
    ref_full = fwd(model32, model32.new_cache(1, MAX_SEQ), [ids]).logits[0]
    for pos in range(16, 20):
        step = fwd(model, cache, [ids[pos:pos + 1]]).logits[0, 0].float()
        cache.commit_all(slice(0, 1), [1])
        assert (step - ref_full[pos]).abs().max().item() / ref_full[pos].abs().max().item() < 0.05


# ----------------------------------------------------------------------------------------------
# the real SmolLM2-135M (slow)
# ----------------------------------------------------------------------------------------------

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived",
]


@pytest.fixture(scope="module")
def smollm_hf(smollm_dir):
    return load_hf(smollm_dir)


@pytest.mark.slow
def test_smollm_logits_match_hf(smollm_fp32, smollm_hf):
    tok, model = smollm_fp32.tokenizer, smollm_fp32.model
    for text in PROMPTS:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        ref = hf_logits(smollm_hf, ids)
        cache = model.new_cache(1, 256)
        out = fwd(model, cache, [ids[:-2]])
        cache.commit_all(slice(0, 1), [len(ids) - 2])
        assert_logits_close(out.logits[0], ref[:-2], rel=1e-5, what=text)
        step = fwd(model, cache, [ids[-2:]]).logits[0]
        assert_logits_close(step, ref[-2:], rel=1e-5, what=text + " (decode)")


@pytest.mark.slow
def test_smollm_greedy_generation_matches_hf(smollm_fp32, smollm_hf):
    from dart_ray import Engine, EngineConfig, SamplingParams
    from dart_ray.drafters import make_drafter

    tok = smollm_fp32.tokenizer
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in PROMPTS]
    N = 48
    refs = []
    with torch.no_grad():
        for ids in prompts:
            # eos_token_id=None: keep going past EOS like ignore_eos (min_new_tokens would instead
            # *suppress* EOS, changing the greedy choice)
            gen = smollm_hf.generate(torch.tensor([ids]),
                                     attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     max_new_tokens=N, do_sample=False, eos_token_id=None)
            refs.append(gen[0, len(ids):].tolist())
    assert all(len(r) == N for r in refs)

    cfg = EngineConfig(method="none", dtype="fp32", max_seq_len=1024, max_batch_size=4)
    eng = Engine(smollm_fp32, make_drafter(cfg, smollm_fp32), cfg)
    params = SamplingParams(max_new_tokens=N, ignore_eos=True)
    t0 = time.perf_counter()
    batch = eng.generate(prompts, params)
    for c, ref in zip(batch, refs, strict=True):
        assert c.token_ids == ref
    for ids, ref in zip(prompts, refs, strict=True):
        (one,) = eng.generate([ids], params)
        assert one.token_ids == ref
    assert time.perf_counter() - t0 < 120
