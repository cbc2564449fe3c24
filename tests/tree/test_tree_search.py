"""Tests of the N-gram-pruned beam search (dart_ray.tree.search)."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch

from dart_ray.config import DecodingConfig
from dart_ray.tree.search import (
    NGramScorer,
    _stable_desc,
    build_trees,
    build_trees_with_scores,
    topk_last,
)
from dart_ray.tree.tree import TokenTree, merge_paths, pack_trees, trie_from_paths

EPS = 1e-6


# ------------------------------------------------------------------ fakes and helpers
class DictNGram:
    """Fake N-gram model: P(tok | ctx) from a dict keyed by (ctx tuple, tok); 0 when absent."""

    def __init__(self, order: int, table: dict[tuple[tuple[int, ...], int], float]):
        self.order = order
        self.table = table
        self.calls: list[tuple[np.ndarray, np.ndarray, int]] = []

    def prob(self, ctx: np.ndarray, tokens: np.ndarray, min_count: int) -> np.ndarray:
        assert ctx.dtype == np.int64 and tokens.dtype == np.int64
        assert ctx.shape == (tokens.shape[0], self.order - 1)
        self.calls.append((ctx.copy(), tokens.copy(), min_count))
        return np.array([self.table.get((tuple(int(c) for c in row), int(t)), 0.0)
                         for row, t in zip(ctx, tokens, strict=True)], dtype=np.float64)


class HashNGram:
    """Fake N-gram model with a deterministic pseudo-random probability for every (ctx, tok)."""

    def __init__(self, order: int = 3):
        self.order = order
        self.calls = 0

    @staticmethod
    def p_one(ctx: tuple[int, ...], tok: int) -> float:
        h = sum((i + 1) * (c + 2) for i, c in enumerate(ctx)) * 7 + tok * 13
        return min(1.0, (h % 11) / 10.0)

    def prob(self, ctx: np.ndarray, tokens: np.ndarray, min_count: int) -> np.ndarray:
        self.calls += 1
        weights = np.arange(1, ctx.shape[1] + 1, dtype=np.int64)
        h = ((ctx + 2) * weights[None, :]).sum(1) * 7 + tokens * 13
        return np.minimum(1.0, (h % 11) / 10.0)


def paths_of(tree: TokenTree, scores: torch.Tensor, b: int) -> dict[tuple[int, ...], float]:
    """Valid draft nodes of row b as {token path from the root (excl.): score}."""
    out = {}
    toks, pars, val = tree.tokens[b].tolist(), tree.parents[b].tolist(), tree.valid[b].tolist()
    for i in range(1, tree.num_nodes):
        if not val[i]:
            continue
        path, j = [], i
        while j > 0:
            path.append(toks[j])
            j = pars[j]
        out[tuple(reversed(path))] = float(scores[b, i])
    return out


def reference(root: int, logits: torch.Tensor, cfg: DecodingConfig, context: list[int],
              ngram=None) -> dict[tuple[int, ...], float]:
    """Plain-Python beam search + top-budget selection (float64), for comparison."""
    d = min(cfg.draft_depth, logits.shape[0])
    k = min(cfg.top_k, logits.shape[1])
    use_ng = ngram is not None and cfg.ngram_weight > 0
    pool: list[tuple[float, tuple[int, ...]]] = []
    beams: list[tuple[float, tuple[int, ...]]] = [(0.0, ())]
    for lvl in range(d):
        v, idx = torch.topk(logits[lvl].double(), k)
        p = torch.softmax(v, 0).tolist()
        idx = idx.tolist()
        w = (lvl + 1) ** (-cfg.level_weight_exp)
        cands = []
        for s, path in beams:
            for j in range(k):
                inc = cfg.logit_weight_base ** lvl * math.log(p[j] + cfg.eps)
                if use_ng and lvl > 0:
                    hist = [-1] * ngram.order + context + [root] + list(path)
                    ctx = tuple(hist[len(hist) - (ngram.order - 1):]) if ngram.order > 1 else ()
                    inc += cfg.ngram_weight * math.log(ngram.p_one(ctx, idx[j]) + cfg.eps)
                cands.append((s + w * inc, path + (idx[j],)))
        pool += cands
        beams = sorted(cands, key=lambda c: -c[0])[: cfg.beam_width]
    keep = sorted(pool, key=lambda c: -c[0])[: cfg.tree_budget]
    return {path: s for s, path in keep}


def check_tree(tree: TokenTree, scores: torch.Tensor, cfg: DecodingConfig) -> None:
    tree.validate()
    B, T = tree.tokens.shape
    assert scores.shape == (B, T)
    assert T - 1 <= cfg.tree_budget
    for b in range(B):
        v = tree.valid[b]
        # padding format
        assert bool((tree.parents[b][~v] == 0).all()) and bool((tree.depths[b][~v] == 1).all())
        assert bool((tree.tokens[b][~v] == 0).all()) and bool(torch.isinf(scores[b][~v]).all())
        # valid nodes first, in priority order: effective (path-minimum) score descending, so every
        # prefix of the node list is the best tree of that size
        nv = int(v.sum())
        assert bool(v[:nv].all())
        par, sc = tree.parents[b, :nv].tolist(), scores[b, :nv].tolist()
        eff = [float("inf")]
        for i in range(1, nv):
            eff.append(min(sc[i], eff[par[i]]))
        for i in range(1, nv - 1):
            assert eff[i] >= eff[i + 1]
        # no duplicate siblings
        pairs = list(zip(tree.parents[b, 1:nv].tolist(), tree.tokens[b, 1:nv].tolist(),
                         strict=True))
        assert len(pairs) == len(set(pairs))


def rand_logits(B: int, d: int, V: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, d, V, generator=g) * scale


# ------------------------------------------------------------------ hand-worked tiny example
# V=4, d=2, k=2. Level 0 logits [2,1,0,-1] -> tokens 0,1 with p = softmax([2,1]);
# level 1 logits [0,3,1,0] -> tokens 1,2 with p = softmax([3,1]). root = 3, context = [2].
L0 = [2.0, 1.0, 0.0, -1.0]
L1 = [0.0, 3.0, 1.0, 0.0]
TINY = torch.tensor([[L0, L1]])
ROOT = torch.tensor([3])
CTX = torch.tensor([[2]])


def _tiny_terms():
    pa = [math.e / (math.e + 1), 1 / (math.e + 1)]          # level-0 probs of tokens 0, 1
    pb = [math.e ** 2 / (math.e ** 2 + 1), 1 / (math.e ** 2 + 1)]  # level-1 probs of tokens 1, 2
    w1 = 2 ** -0.7
    sA = math.log(pa[0] + EPS)                              # node "0"
    sB = math.log(pa[1] + EPS)                              # node "1"
    c1 = w1 * 0.9 * math.log(pb[0] + EPS)                   # draft term of token 1 at level 1
    c2 = w1 * 0.9 * math.log(pb[1] + EPS)                   # draft term of token 2 at level 1
    return sA, sB, c1, c2, w1


def test_tiny_hand_worked_no_ngram():
    cfg = DecodingConfig(draft_depth=2, top_k=2, beam_width=2, tree_budget=10)
    tree, scores = build_trees_with_scores(ROOT, TINY, cfg, context=CTX)
    check_tree(tree, scores, cfg)
    sA, sB, c1, c2, _ = _tiny_terms()
    # priority order (score descending, parents first): A(0), A1 = sA+c1, B(1), B1 = sB+c1,
    # A2 = sA+c2, B2 = sB+c2
    assert sA > sA + c1 > sB > sB + c1 > sA + c2 > sB + c2
    assert tree.tokens.tolist() == [[3, 0, 1, 1, 1, 2, 2]]
    assert tree.parents.tolist() == [[-1, 0, 1, 0, 3, 1, 3]]
    assert tree.depths.tolist() == [[0, 1, 2, 1, 2, 2, 2]]
    want = [0.0, sA, sA + c1, sB, sB + c1, sA + c2, sB + c2]
    assert scores[0].tolist() == pytest.approx(want, abs=1e-5)

    # budget 3 keeps the 3 best: A, A1, B
    small = cfg.replace(tree_budget=3)
    tree, scores = build_trees_with_scores(ROOT, TINY, small, context=CTX)
    check_tree(tree, scores, small)
    assert tree.tokens.tolist() == [[3, 0, 1, 1]]
    assert tree.parents.tolist() == [[-1, 0, 1, 0]]
    assert scores[0].tolist() == pytest.approx([0.0, sA, sA + c1, sB], abs=1e-5)


def test_tiny_hand_worked_with_ngram():
    # order 3: the level-1 context is (root, level-0 token). The table also holds level-0
    # entries with p = 0 that would crush the level-0 scores if the N-gram term were not skipped.
    table = {((3, 0), 2): 0.9, ((3, 1), 1): 0.2, ((2, 3), 0): 0.0, ((2, 3), 1): 0.0}
    ng = DictNGram(3, table)
    cfg = DecodingConfig(draft_depth=2, top_k=2, beam_width=2, tree_budget=10, ngram_weight=0.5,
                         ngram_min_count=2)
    tree, scores = build_trees_with_scores(ROOT, TINY, cfg, context=CTX, ngram=ng)
    check_tree(tree, scores, cfg)
    sA, sB, c1, c2, w1 = _tiny_terms()
    nw = w1 * 0.5
    A1 = sA + c1 + nw * math.log(0.0 + EPS)
    A2 = sA + c2 + nw * math.log(0.9 + EPS)
    B1 = sB + c1 + nw * math.log(0.2 + EPS)
    B2 = sB + c2 + nw * math.log(0.0 + EPS)
    assert sorted([A1, A2, B1, B2], reverse=True) == [A2, B1, A1, B2]
    assert tree.tokens.tolist() == [[3, 0, 1, 2, 1, 1, 2]]
    assert tree.parents.tolist() == [[-1, 0, 0, 1, 2, 1, 2]]
    assert scores[0].tolist() == pytest.approx([0.0, sA, sB, A2, B1, A1, B2], abs=1e-5)
    # exactly one batched lookup (level 1 only), with the right contexts and min_count
    assert len(ng.calls) == 1
    ctx, toks, mc = ng.calls[0]
    assert mc == 2
    assert ctx.tolist() == [[3, 0], [3, 0], [3, 1], [3, 1]]
    assert toks.tolist() == [1, 2, 1, 2]

    # ngram_weight = 0 drops the term (and the lookups) entirely
    ng2 = DictNGram(3, table)
    tree0, scores0 = build_trees_with_scores(ROOT, TINY, cfg.replace(ngram_weight=0.0),
                                             context=CTX, ngram=ng2)
    assert ng2.calls == []
    ref_tree, ref_scores = build_trees_with_scores(ROOT, TINY, cfg, context=CTX)
    assert torch.equal(tree0.tokens, ref_tree.tokens) and torch.equal(scores0, ref_scores)


def test_ngram_context_uses_committed_text_and_pads():
    # order 4: context = last 3 tokens of (context + root + path)
    ng = DictNGram(4, {})
    cfg = DecodingConfig(draft_depth=3, top_k=2, beam_width=1, tree_budget=10)
    logits = torch.tensor([[L0, L1, [5.0, 0.0, 0.0, 0.0]]])
    build_trees(ROOT, logits, cfg, context=torch.tensor([[7, 2]]), ngram=ng)
    assert [c[0].tolist() for c in ng.calls] == [[[2, 3, 0]] * 2, [[3, 0, 1]] * 2]
    ng = DictNGram(4, {})
    build_trees(ROOT, logits, cfg, context=None, ngram=ng)
    assert [c[0].tolist() for c in ng.calls] == [[[-1, 3, 0]] * 2, [[3, 0, 1]] * 2]
    ng = DictNGram(1, {})  # unigram: empty contexts
    build_trees(ROOT, logits, cfg, ngram=ng)
    assert ng.calls[0][0].shape == (2, 0)


# ------------------------------------------------------------------ reference comparison
@pytest.mark.parametrize("use_ngram", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_python_reference(use_ngram: bool, seed: int):
    cfg = DecodingConfig(draft_depth=4, top_k=5, beam_width=3, tree_budget=20)
    B, V = 3, 50
    logits = rand_logits(B, 5, V, seed)
    roots = torch.tensor([4, 9, 11])
    context = torch.tensor([[1, 2], [-1, 3], [-1, -1]])
    ng = HashNGram(3) if use_ngram else None
    tree, scores = build_trees_with_scores(roots, logits, cfg, context=context, ngram=ng)
    check_tree(tree, scores, cfg)
    if use_ngram:
        assert ng.calls == 3  # one batched lookup per level >= 1
    for b in range(B):
        got = paths_of(tree, scores, b)
        want = reference(int(roots[b]), logits[b], cfg, [c for c in context[b].tolist()], ng)
        assert set(got) == set(want)
        for path, s in want.items():
            assert got[path] == pytest.approx(s, abs=1e-4)


# ------------------------------------------------------------------ structural properties
def test_budget_respected_and_exact():
    cfg = DecodingConfig()  # k=25, beams 20, budget 60, d=8
    tree, scores = build_trees_with_scores(torch.tensor([1, 2]), rand_logits(2, 8, 1000, 3), cfg)
    check_tree(tree, scores, cfg)
    assert tree.num_nodes == 1 + 60 and bool(tree.valid.all())
    for budget in (1, 7, 33):
        c = cfg.replace(tree_budget=budget)
        t, s = build_trees_with_scores(torch.tensor([1, 2]), rand_logits(2, 8, 1000, 4), c)
        check_tree(t, s, c)
        assert t.num_nodes == 1 + budget and bool(t.valid.all())
    # fewer candidates than budget: every pool node is kept (k + beams*k = 3 + 3*3 = 12)
    c = DecodingConfig(draft_depth=2, top_k=3, beam_width=5, tree_budget=100)
    t, s = build_trees_with_scores(torch.tensor([0]), rand_logits(1, 2, 10, 5), c)
    check_tree(t, s, c)
    assert t.num_nodes == 1 + 12 and bool(t.valid.all())


def test_beam_width_one_follows_argmax():
    cfg = DecodingConfig(draft_depth=6, top_k=4, beam_width=1, tree_budget=100)
    logits = rand_logits(1, 6, 30, 6)
    argmax = logits[0].argmax(-1).tolist()
    tree, scores = build_trees_with_scores(torch.tensor([0]), logits, cfg)
    check_tree(tree, scores, cfg)
    assert tree.num_nodes == 1 + 6 * 4
    # every node with children lies on the argmax chain
    paths = paths_of(tree, scores, 0)
    for path in paths:
        assert list(path[:-1]) == argmax[: len(path) - 1]
    # with a peaked drafter and budget d the tree IS the argmax chain
    peaked = logits.clone()
    peaked[0, torch.arange(6), torch.tensor(argmax)] += 20.0
    t, s = build_trees_with_scores(torch.tensor([0]), peaked, cfg.replace(tree_budget=6))
    check_tree(t, s, cfg)
    assert t.tokens[0, 1:].tolist() == argmax
    assert t.parents[0].tolist() == [-1, 0, 1, 2, 3, 4, 5]


def test_batch_rows_independent():
    cfg = DecodingConfig(draft_depth=5, top_k=6, beam_width=4, tree_budget=25)
    B = 4
    logits = rand_logits(B, 5, 80, 7)
    logits[2, :, 1:] = float("-inf")  # row 2: 1 candidate per level -> a 5-node chain, padded
    roots = torch.tensor([1, 5, 7, 9])
    context = torch.tensor([[3, 4, 5], [-1, -1, 6], [8, 9, 10], [-1, -1, -1]])
    ng = HashNGram(3)
    tree, scores = build_trees_with_scores(roots, logits, cfg, context=context, ngram=ng)
    check_tree(tree, scores, cfg)
    for b in range(B):
        t1, s1 = build_trees_with_scores(roots[b : b + 1], logits[b : b + 1], cfg,
                                         context=context[b : b + 1], ngram=ng)
        n = t1.num_nodes
        assert torch.equal(tree.tokens[b, :n], t1.tokens[0])
        assert torch.equal(tree.parents[b, :n], t1.parents[0])
        assert torch.equal(tree.depths[b, :n], t1.depths[0])
        assert torch.equal(tree.valid[b, :n], t1.valid[0])
        assert torch.equal(scores[b, :n], s1[0])
        assert not bool(tree.valid[b, n:].any())
    assert int(tree.valid[2].sum()) == 1 + 5 and tree.num_nodes == 1 + 25
    assert tree.tokens[2, :6].tolist() == [7, 0, 0, 0, 0, 0]


def test_masked_logits_are_never_drafted_and_rows_padded():
    cfg = DecodingConfig(draft_depth=3, top_k=4, beam_width=4, tree_budget=50)
    logits = rand_logits(2, 3, 10, 8)
    logits[0, 0, 2:] = float("-inf")  # row 0: 2 candidates at level 0
    logits[0, 1, :] = float("-inf")   # row 0: nothing at level 1 -> depth-1 only
    tree, scores = build_trees_with_scores(torch.tensor([1, 2]), logits, cfg)
    check_tree(tree, scores, cfg)
    assert int(tree.valid[0].sum()) == 1 + 2
    assert set(tree.tokens[0, 1:3].tolist()) == {0, 1}
    assert int(tree.valid[1].sum()) == tree.num_nodes == 1 + 4 + 16 + 16
    # a row whose every level is masked gives a root-only tree
    t, s = build_trees_with_scores(torch.tensor([1]), torch.full((1, 3, 10), float("-inf")), cfg)
    t.validate()
    assert t.num_nodes == 1 and s.tolist() == [[0.0]]


def test_draft_depth_limits_levels():
    logits = rand_logits(2, 8, 100, 9)
    cfg = DecodingConfig(draft_depth=3, top_k=5, beam_width=4, tree_budget=60)
    tree, scores = build_trees_with_scores(torch.tensor([1, 2]), logits, cfg)
    check_tree(tree, scores, cfg)
    assert int(tree.depths.max()) <= 3
    t2, s2 = build_trees_with_scores(torch.tensor([1, 2]), logits[:, :3].clone(), cfg)
    assert torch.equal(tree.tokens, t2.tokens) and torch.equal(scores, s2)
    # draft_depth larger than the drafter depth uses all D levels
    t3, _ = build_trees_with_scores(torch.tensor([1, 2]), logits[:, :2].clone(),
                                    cfg.replace(draft_depth=8, tree_budget=500))
    assert int(t3.depths.max()) == 2


def test_deterministic():
    cfg = DecodingConfig()
    logits = rand_logits(3, 8, 500, 10).round()  # rounding creates many exact ties
    roots = torch.tensor([1, 2, 3])
    ctx = torch.tensor([[4, 5], [6, 7], [8, 9]])
    a = build_trees_with_scores(roots, logits, cfg, context=ctx, ngram=HashNGram(3))
    b = build_trees_with_scores(roots, logits, cfg, context=ctx, ngram=HashNGram(3))
    check_tree(*a, cfg)
    for x, y in zip((a[0].tokens, a[0].parents, a[0].depths, a[0].valid, a[1]),
                    (b[0].tokens, b[0].parents, b[0].depths, b[0].valid, b[1]), strict=True):
        assert torch.equal(x, y)


def test_top_k_larger_than_vocab():
    cfg = DecodingConfig(draft_depth=3, top_k=25, beam_width=3, tree_budget=100)
    tree, scores = build_trees_with_scores(torch.tensor([0]), rand_logits(1, 3, 5, 11), cfg)
    check_tree(tree, scores, cfg)
    assert tree.num_nodes == 1 + 5 + 15 + 15
    assert int(tree.tokens.max()) < 5


def test_ties_and_eps_keep_prefix_closure():
    # uniform logits: every sibling ties
    cfg = DecodingConfig(draft_depth=4, top_k=4, beam_width=3, tree_budget=10)
    tree, scores = build_trees_with_scores(torch.tensor([0]), torch.zeros(1, 4, 4), cfg)
    check_tree(tree, scores, cfg)
    assert tree.num_nodes == 11
    # k=1: p=1, so ln(1+eps) > 0 and scores GROW with depth; the deepest nodes score highest,
    # yet closure must keep the shallow prefix: budget 3 -> the chain of depths 1, 2, 3.
    cfg1 = DecodingConfig(draft_depth=6, top_k=1, beam_width=1, tree_budget=3)
    tree, scores = build_trees_with_scores(torch.tensor([0]), rand_logits(1, 6, 9, 12), cfg1)
    check_tree(tree, scores, cfg1)
    assert tree.depths.tolist() == [[0, 1, 2, 3]] and tree.parents.tolist() == [[-1, 0, 1, 2]]
    assert bool((scores[0, 2:] > scores[0, 1:-1]).all())


def test_ngram_prefers_likely_continuation():
    cfg = DecodingConfig(draft_depth=4, top_k=10, beam_width=5, tree_budget=30, ngram_weight=0.5)
    logits = rand_logits(1, 4, 200, 13, scale=0.3)  # flat-ish drafter
    top = torch.topk(logits[0], 10, dim=-1).indices  # [4, 10]
    a0 = int(top[0, 0])
    chain = [a0, int(top[1, 9]), int(top[2, 8]), int(top[3, 7])]  # low-ranked draft candidates
    ctx0 = [6, 42]  # context ..., root
    hist = ctx0 + chain
    table = {(tuple(hist[i:i + 2]), hist[i + 2]): 1.0 for i in range(1, len(chain))}
    ng = DictNGram(3, table)
    tree, scores = build_trees_with_scores(torch.tensor([42]), logits, cfg,
                                           context=torch.tensor([[6]]), ngram=ng)
    check_tree(tree, scores, cfg)
    paths = paths_of(tree, scores, 0)
    for m in range(1, 5):
        assert tuple(chain[:m]) in paths
    # the favoured node is the best one at depths 2..4
    for m in range(2, 5):
        best = max((s, p) for p, s in paths.items() if len(p) == m)
        assert best[1] == tuple(chain[:m])
    # without the N-gram these low-ranked continuations are not the best
    t0, s0 = build_trees_with_scores(torch.tensor([42]), logits, cfg)
    p0 = paths_of(t0, s0, 0)
    assert max((s, p) for p, s in p0.items() if len(p) == 2)[1] != tuple(chain[:2])


# ------------------------------------------------------------------ blocked topk
@pytest.mark.parametrize("V", [49152, 40000 + 37])  # divisible by the block / ragged tail
def test_blocked_topk_matches_torch(V: int):
    x = rand_logits(2, 3, V, 15)
    x[1, 2, V - 5] = 100.0  # the maximum sits in the ragged tail (or the last block)
    for k in (1, 25):
        v, i = topk_last(x, k)
        v_ref, i_ref = torch.topk(x, k, dim=-1)
        assert torch.equal(v, v_ref) and torch.equal(i, i_ref)
    # exact ties: values agree and the indices point at those values
    xr = (x * 0.5).round()
    v, i = topk_last(xr, 25)
    assert torch.equal(v, torch.topk(xr, 25, dim=-1).values)
    assert torch.equal(xr.gather(2, i), v)
    assert all(len(set(row)) == 25 for row in i.reshape(-1, 25).tolist())
    # bf16 and a sliced (non-contiguous in dim 1) view
    xb = x.to(torch.bfloat16)[:, 1:]
    assert torch.equal(topk_last(xb, 25)[0], torch.topk(xb, 25, dim=-1).values)
    # NaN still surfaces (and build_trees rejects it)
    xn = x.clone()
    xn[0, 1, 777] = float("nan")
    assert bool(torch.isnan(topk_last(xn, 25)[0]).any())
    with pytest.raises(ValueError):
        build_trees(torch.tensor([0, 1]), xn, DecodingConfig())


def test_stable_desc_is_a_stable_descending_sort():
    g = torch.Generator().manual_seed(16)
    x = (torch.randn(3, 400, generator=g) * 2).round()                   # many exact ties
    x[0, :50] = float("-inf")
    x[1, 10] = -0.0
    x[1, 11] = 0.0
    x[2, 7] = float("inf")
    want = torch.sort(x + 0.0, dim=1, descending=True, stable=True).indices
    assert np.array_equal(_stable_desc(x.numpy()), want.numpy())


# ------------------------------------------------------------------ errors
def test_bad_inputs_fail_loudly():
    cfg = DecodingConfig()
    lg = torch.zeros(2, 3, 10)
    r = torch.tensor([0, 1])
    with pytest.raises(ValueError):
        build_trees(r, torch.zeros(2, 10), cfg)
    with pytest.raises(ValueError):
        build_trees(torch.tensor([0]), lg, cfg)
    with pytest.raises(ValueError):
        build_trees(r.float(), lg, cfg)
    with pytest.raises(ValueError):
        build_trees(r, torch.zeros(2, 0, 10), cfg)
    with pytest.raises(ValueError):
        build_trees(r, lg, cfg, context=torch.zeros(3, 2, dtype=torch.long))
    with pytest.raises(ValueError):
        build_trees(r, lg, cfg, context=torch.zeros(2, 2))
    bad = lg.clone()
    bad[0, 1, 3] = float("nan")
    with pytest.raises(ValueError):
        build_trees(r, bad, cfg)
    with pytest.raises(TypeError):
        build_trees(r, lg, {"top_k": 3})

    class WrongShape:
        order = 3

        def prob(self, ctx, tokens, min_count):
            return np.zeros(len(tokens) + 1)

    class OutOfRange(WrongShape):
        def prob(self, ctx, tokens, min_count):
            return np.full(len(tokens), 1.5)

    with pytest.raises(ValueError):
        build_trees(r, rand_logits(2, 3, 10, 0), cfg, ngram=WrongShape())
    with pytest.raises(ValueError):
        build_trees(r, rand_logits(2, 3, 10, 0), cfg, ngram=OutOfRange())


def test_protocol_and_empty_batch():
    assert isinstance(HashNGram(), NGramScorer)
    assert isinstance(DictNGram(3, {}), NGramScorer)
    t, s = build_trees_with_scores(torch.zeros(0, dtype=torch.long), torch.zeros(0, 8, 10),
                                   DecodingConfig())
    assert t.tokens.shape == (0, 1) and s.shape == (0, 1)


# ------------------------------------------------------------------ benchmark (printed only)
def test_benchmark_realistic(capsys):
    cfg = DecodingConfig()  # d=8, k=25, beams 20, budget 60
    V = 49152

    def bench(B: int, ng, dtype=torch.float32, n: int = 50) -> float:
        logits = rand_logits(B, 8, V, 14).to(dtype)
        roots = torch.arange(B)
        ctx = torch.randint(0, V, (B, 4))
        for _ in range(5):
            build_trees(roots, logits, cfg, context=ctx, ngram=ng)
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            build_trees(roots, logits, cfg, context=ctx, ngram=ng)
            ts.append(time.perf_counter() - t0)
        return float(np.median(ts)) * 1e3  # median: robust to a noisy shared machine

    threads = torch.get_num_threads()
    rows = []
    try:
        for nt in sorted({1, threads}):
            torch.set_num_threads(nt)
            rows += [
                (f"{nt}t B=1 fp32, no n-gram", bench(1, None, n=200)),
                (f"{nt}t B=1 fp32, hash n-gram", bench(1, HashNGram(3), n=100)),
                (f"{nt}t B=1 bf16, no n-gram", bench(1, None, torch.bfloat16, n=100)),
                (f"{nt}t B=8 fp32, hash n-gram", bench(8, HashNGram(3), n=30)),
            ]
    finally:
        torch.set_num_threads(threads)
    with capsys.disabled():
        print(f"\n[tree search benchmark, V={V}, d=8, k=25, beams=20, budget=60]")
        for name, ms in rows:
            print(f"  {name:<28s} {ms:7.3f} ms/call (median)")


def test_trie_from_paths_shares_prefixes_and_keeps_the_budget():
    # nodes in insertion order, parents first; a shared (parent, token) is one node
    assert trie_from_paths([[1, 2, 3], [1, 2, 4], [5]]) == ([1, 2, 3, 4, 5], [0, 1, 2, 2, 0])
    # the budget cuts a path where it runs out; later paths still walk existing nodes, add none
    assert trie_from_paths([[1, 2, 3], [1, 4], [1, 2]], budget=3) == ([1, 2, 3], [0, 1, 2])
    assert trie_from_paths([[1, 2], [3, 4]], budget=3) == ([1, 2, 3], [0, 1, 0])
    assert trie_from_paths([], budget=5) == ([], [])


def test_merge_paths_puts_paths_first_and_shares_prefixes():
    roots = torch.tensor([7, 9])
    # row 0: root -> 1 -> 2, root -> 3 ; row 1: root -> 4 (plus one padding node)
    tree = pack_trees(roots, [([1, 2, 3], [0, 1, 0]), ([4], [0])])
    merged = merge_paths(tree, [[[1, 2, 5, 6], [3]], [[8], [4, 4]]])
    merged.validate()
    rows = [(merged.tokens[b, 1:][merged.valid[b, 1:]].tolist(),
             merged.parents[b, 1:][merged.valid[b, 1:]].tolist())
            for b in range(2)]
    # paths lead the priority order; the tree's nodes 1, 2 and 3 are shared with them, not repeated
    assert rows[0] == ([1, 2, 5, 6, 3], [0, 1, 2, 3, 0])
    assert rows[1] == ([8, 4, 4], [0, 0, 2])
    assert merged.depths[0, 1:6].tolist() == [1, 2, 3, 4, 1]
    assert merged.tokens[:, 0].tolist() == [7, 9]
    assert merge_paths(tree, [[], []]).tokens.tolist() == tree.tokens.tolist()   # nothing to add
    with pytest.raises(ValueError, match="rows"):
        merge_paths(tree, [[]])
    sampled = TokenTree(tree.tokens, tree.parents, tree.depths, tree.valid, torch.zeros(2, 4, 10))
    with pytest.raises(ValueError, match="draft_probs"):
        merge_paths(sampled, [[], []])


def test_deep_levels_that_cannot_enter_the_tree_are_not_searched():
    # confident early levels, flat late ones: a small budget is filled by shallow nodes, so the
    # search stops before the deep levels (no N-gram lookups there) -- and the tree is still the
    # reference's, node for node
    cfg = DecodingConfig(draft_depth=6, top_k=5, beam_width=3, tree_budget=4)
    logits = rand_logits(2, 6, 50, 21, scale=0.1)
    logits[:, 0, 7] = 12.0
    logits[:, 1, 9] = 12.0
    roots = torch.tensor([4, 9])
    context = torch.tensor([[1, 2], [-1, 3]])
    ng = HashNGram(3)
    tree, scores = build_trees_with_scores(roots, logits, cfg, context=context, ngram=ng)
    check_tree(tree, scores, cfg)
    assert ng.calls < 5                                   # 5 = one lookup per level >= 1
    for b in range(2):
        want = reference(int(roots[b]), logits[b], cfg, context[b].tolist(), ng)
        got = paths_of(tree, scores, b)
        assert set(got) == set(want)
        for path, s in want.items():
            assert got[path] == pytest.approx(s, abs=1e-4)
    # a budget the shallow levels cannot fill searches every level
    ng2 = HashNGram(3)
    big = cfg.replace(tree_budget=200)
    build_trees_with_scores(roots, logits, big, context=context, ngram=ng2)
    assert ng2.calls == 5
