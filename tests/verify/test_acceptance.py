"""Tests of dart_ray.verify.acceptance: greedy rule, processed target probabilities, and a
statistical check that sampled acceptance is lossless (with negative controls that must fail)."""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Callable, Sequence

import pytest
import torch

from dart_ray.config import SamplingParams
from dart_ray.tree.tree import TokenTree, chain_tree
from dart_ray.verify import (
    Acceptance,
    RequestRandom,
    accept,
    greedy_accept,
    processed_probs,
    sample_accept,
)

# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------


def make_tree(root: int, nodes: Sequence[tuple[int, int]], pad: int = 0) -> TokenTree:
    """One tree (B=1): nodes[i-1] = (parent, token) of node i; ``pad`` invalid nodes appended."""
    tokens, parents, depths = [root], [-1], [0]
    for par, tok in nodes:
        tokens.append(tok)
        parents.append(par)
        depths.append(depths[par] + 1)
    valid = [True] * len(tokens) + [False] * pad
    tokens += [0] * pad
    parents += [0] * pad
    depths += [1] * pad
    tree = TokenTree(
        torch.tensor([tokens]),
        torch.tensor([parents]),
        torch.tensor([depths]),
        torch.tensor([valid], dtype=torch.bool),
    )
    tree.validate()
    return tree


def stack_trees(trees: Sequence[TokenTree]) -> TokenTree:
    """Concatenate B=1 trees into one batch, padding with invalid nodes to a common size."""
    T = max(t.num_nodes for t in trees)
    parts: list[list[torch.Tensor]] = [[], [], [], []]
    for t in trees:
        n = T - t.num_nodes
        parts[0].append(torch.cat([t.tokens, torch.zeros(1, n, dtype=torch.long)], 1))
        parts[1].append(torch.cat([t.parents, torch.zeros(1, n, dtype=torch.long)], 1))
        parts[2].append(torch.cat([t.depths, torch.ones(1, n, dtype=torch.long)], 1))
        parts[3].append(torch.cat([t.valid, torch.zeros(1, n, dtype=torch.bool)], 1))
    tree = TokenTree(*(torch.cat(p, 0) for p in parts))
    tree.validate()
    return tree


def pointing_logits(preds: Sequence[int], V: int, T: int | None = None) -> torch.Tensor:
    """[1, T, V] logits whose argmax at node i is preds[i] (extra nodes point at V-1)."""
    T = T or len(preds)
    lg = torch.randn(1, T, V, generator=torch.Generator().manual_seed(len(preds) * 7 + V)) * 0.1
    full = list(preds) + [V - 1] * (T - len(preds))
    for i, p in enumerate(full):
        lg[0, i, p] = 5.0
    return lg


def as_lists(acc: Acceptance) -> tuple[list[list[int]], list[int], list[int]]:
    return acc.path.tolist(), acc.num_accepted.tolist(), acc.bonus.tolist()


def emitted(acc: Acceptance, tree: TokenTree) -> list[list[int]]:
    """Per row, the committed tokens of this step: accepted draft tokens then the bonus."""
    path, toks = acc.path.cpu(), tree.tokens.cpu()
    n, bonus = acc.num_accepted.tolist(), acc.bonus.tolist()
    return [toks[b, path[b, 1:1 + n[b]]].tolist() + [bonus[b]] for b in range(len(n))]


# ----------------------------------------------------------------------------------------------
# greedy
# ----------------------------------------------------------------------------------------------

V = 8
CHAIN = make_tree(5, [(0, 1), (1, 2), (2, 3)])  # root 5 -> 1 -> 2 -> 3


def test_greedy_chain_fully_accepted():
    acc = greedy_accept(CHAIN, pointing_logits([1, 2, 3, 4], V))
    assert as_lists(acc) == ([[0, 1, 2, 3]], [3], [4])
    assert emitted(acc, CHAIN) == [[1, 2, 3, 4]]


def test_greedy_chain_partial():
    acc = greedy_accept(CHAIN, pointing_logits([1, 6, 3, 4], V))  # node 2 (token 2) wrong
    assert as_lists(acc) == ([[0, 1, -1, -1]], [1], [6])
    assert emitted(acc, CHAIN) == [[1, 6]]


def test_greedy_chain_none():
    # later nodes "match" their parents, but the first does not: nothing is accepted
    acc = greedy_accept(CHAIN, pointing_logits([7, 2, 3, 4], V))
    assert as_lists(acc) == ([[0, -1, -1, -1]], [0], [7])


def test_greedy_branching_second_sibling():
    # root 0: children 1 (tok 2), 2 (tok 3), 3 (tok 4); node 4 (tok 5) under 1;
    # node 5 (tok 1) under 2
    tree = make_tree(0, [(0, 2), (0, 3), (0, 4), (1, 5), (2, 1)])
    lg = pointing_logits([3, 5, 1, 0, 0, 6], V)
    acc = greedy_accept(tree, lg)
    assert as_lists(acc) == ([[0, 2, 5]], [2], [6])


def test_greedy_padding_never_accepted():
    # real child token 1 is wrong; padding node carries token 3 == argmax at root but is invalid
    tree = make_tree(0, [(0, 1)], pad=2)
    tree.tokens[0, 2] = 3
    lg = pointing_logits([3, 0, 0, 0], V)
    acc = greedy_accept(tree, lg)
    assert as_lists(acc) == ([[0, -1]], [0], [3])
    # chain_tree padding: valid length 1, the padded node would otherwise extend the path
    ct = chain_tree(torch.tensor([0]), torch.tensor([[2, 0]]), lengths=torch.tensor([1]))
    acc = greedy_accept(ct, pointing_logits([2, 0, 0], V))
    assert as_lists(acc) == ([[0, 1]], [1], [0])


def test_greedy_duplicate_siblings_lowest_index():
    tree = make_tree(0, [(0, 4), (0, 4)])
    acc = greedy_accept(tree, pointing_logits([4, 2, 2], V))
    assert as_lists(acc) == ([[0, 1]], [1], [2])


def test_greedy_batch_mixed_outcomes():
    t_branch = make_tree(0, [(0, 2), (0, 3), (0, 4), (1, 5), (2, 1)])
    trees = [CHAIN, CHAIN, CHAIN, t_branch, make_tree(3, [])]
    batch = stack_trees(trees)
    T = batch.num_nodes
    lg = torch.cat(
        [
            pointing_logits([1, 2, 3, 4], V, T),
            pointing_logits([1, 6, 3, 4], V, T),
            pointing_logits([7, 2, 3, 4], V, T),
            pointing_logits([3, 5, 1, 0, 0, 6], V, T),
            pointing_logits([2], V, T),
        ]
    )
    acc = greedy_accept(batch, lg)
    path, num, bonus = as_lists(acc)
    assert num == [3, 1, 0, 2, 0]
    assert bonus == [4, 6, 7, 6, 2]
    assert path == [[0, 1, 2, 3], [0, 1, -1, -1], [0, -1, -1, -1], [0, 2, 5, -1], [0, -1, -1, -1]]
    # each row alone gives the same answer
    for b, t in enumerate(trees):
        one = greedy_accept(t, lg[b : b + 1, : t.num_nodes])
        assert one.num_accepted.item() == num[b] and one.bonus.item() == bonus[b]


# ----------------------------------------------------------------------------------------------
# processed_probs
# ----------------------------------------------------------------------------------------------


def test_processed_probs_temperature():
    lg = torch.log(torch.tensor([1.0, 2.0, 4.0]))
    torch.testing.assert_close(processed_probs(lg, 1.0, 0, 1.0), torch.tensor([1, 2, 4]) / 7.0)
    r = torch.tensor([1.0, math.sqrt(2.0), 2.0])
    torch.testing.assert_close(processed_probs(lg, 2.0, 0, 1.0), r / r.sum())
    with pytest.raises(ValueError):
        processed_probs(lg, 0.0, 0, 1.0)


def test_processed_probs_top_k():
    lg = torch.tensor([1.0, 3.0, 2.0, 0.0])
    p = processed_probs(lg, 1.0, 2, 1.0)
    e = torch.exp(torch.tensor([3.0, 2.0]))
    torch.testing.assert_close(p, torch.tensor([0.0, e[0] / e.sum(), e[1] / e.sum(), 0.0]))
    torch.testing.assert_close(processed_probs(lg, 1.0, 1, 1.0), torch.tensor([0.0, 1.0, 0.0, 0.0]))
    torch.testing.assert_close(processed_probs(lg, 1.0, 99, 1.0), torch.softmax(lg, -1))


def test_processed_probs_top_p():
    base = torch.tensor([0.15, 0.5, 0.05, 0.3])  # sorted: 0.5, 0.3, 0.15, 0.05
    lg = base.log()

    def support(top_p: float) -> list[int]:
        return torch.nonzero(processed_probs(lg, 1.0, 0, top_p) > 0).flatten().tolist()

    assert support(0.01) == [1]  # always at least one token
    assert support(0.45) == [1]
    assert support(0.6) == [1, 3]  # 0.5 < 0.6 <= 0.8
    assert support(0.81) == [0, 1, 3]  # 0.8 < 0.81 <= 0.95
    assert support(0.96) == [0, 1, 2, 3]
    assert support(1.0) == [0, 1, 2, 3]
    p = processed_probs(lg, 1.0, 0, 0.6)
    torch.testing.assert_close(p, torch.tensor([0.0, 0.5 / 0.8, 0.0, 0.3 / 0.8]))
    # top-k first, then top-p on the renormalised top-k distribution: [0.625, 0.375] -> keep 1
    torch.testing.assert_close(processed_probs(lg, 1.0, 2, 0.6), torch.tensor([0.0, 1.0, 0.0, 0.0]))


def test_processed_probs_per_row_params():
    g = torch.Generator().manual_seed(0)
    lg = torch.randn(3, 5, 10, generator=g)  # [B, T, V]
    temps = torch.tensor([0.5, 1.0, 2.0])
    ks = torch.tensor([0, 3, 1])
    ps = torch.tensor([0.7, 1.0, 1.0])
    out = processed_probs(lg, temps, ks, ps)
    assert out.shape == lg.shape and out.dtype == torch.float32
    for b in range(3):
        ref = processed_probs(lg[b], temps[b].item(), int(ks[b]), ps[b].item())
        torch.testing.assert_close(out[b], ref)
    torch.testing.assert_close(out.sum(-1), torch.ones(3, 5))
    assert bool(((out[1] > 0).sum(-1) == 3).all()) and bool(((out[2] > 0).sum(-1) == 1).all())
    torch.testing.assert_close(
        processed_probs(lg.bfloat16(), 1.0, 0, 1.0), torch.softmax(lg.bfloat16().float(), -1)
    )


# ----------------------------------------------------------------------------------------------
# sampled acceptance: deterministic properties
# ----------------------------------------------------------------------------------------------


def random_tree(gen: torch.Generator, n: int, vocab: int) -> TokenTree:
    """Random tree with n draft nodes and distinct sibling tokens."""
    nodes: list[tuple[int, int]] = []
    used: dict[int, set[int]] = {}
    while len(nodes) < n:
        par = int(torch.randint(0, len(nodes) + 1, (1,), generator=gen))
        tok = int(torch.randint(0, vocab, (1,), generator=gen))
        if tok in used.setdefault(par, set()):
            continue
        used[par].add(tok)
        nodes.append((par, tok))
    return make_tree(int(torch.randint(0, vocab, (1,), generator=gen)), nodes)


def random_batch(seed: int, B: int, vocab: int = 4) -> tuple[TokenTree, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tree = stack_trees(
        [random_tree(g, int(torch.randint(0, 12, (1,), generator=g)), vocab) for _ in range(B)]
    )
    logits = torch.randn(B, tree.num_nodes, vocab, generator=g) * 3
    return tree, logits


def test_sample_top_k_1_equals_greedy():
    tree, lg = random_batch(1, 64)
    s = sample_accept(tree, lg, 0.8, 1, 1.0, [RequestRandom(b) for b in range(64)])
    g = greedy_accept(tree, lg)
    assert as_lists(s) == as_lists(g)
    assert int(g.num_accepted.sum()) > 20  # the comparison is not vacuous


def test_sample_reproducible_and_batch_independent():
    tree, lg = random_batch(2, 16)
    temps = torch.linspace(0.5, 1.5, 16)

    def run(rows: list[int]) -> Acceptance:
        sub = TokenTree(*(t[rows] for t in (tree.tokens, tree.parents, tree.depths, tree.valid)))
        rands = [RequestRandom(100 + b) for b in rows]
        return sample_accept(sub, lg[rows], temps[rows], 0, 1.0, rands, [b % 3 for b in rows])

    full = run(list(range(16)))
    assert as_lists(full) == as_lists(run(list(range(16))))
    for b in (0, 5, 11):
        one = run([b])
        assert one.num_accepted.item() == full.num_accepted[b].item()
        assert one.bonus.item() == full.bonus[b].item()
        k = one.path.shape[1]
        assert one.path[0].tolist() == full.path[b, :k].tolist()
    # consistency of the outputs with the tree
    for b, (path, n) in enumerate(zip(full.path.tolist(), full.num_accepted.tolist(), strict=True)):
        nodes = [i for i in path if i >= 0]
        assert len(nodes) == n + 1 and nodes[0] == 0
        for d, i in enumerate(nodes[1:], 1):
            assert (
                tree.valid[b, i] and tree.parents[b, i] == nodes[d - 1] and tree.depths[b, i] == d
            )


def test_accept_mixed_batch():
    tree, lg = random_batch(3, 8)
    params = [
        SamplingParams(),
        SamplingParams(temperature=0.9, seed=1),
        SamplingParams(),
        SamplingParams(temperature=1.3, top_k=1),
        SamplingParams(temperature=0.5, top_p=0.8),
        SamplingParams(),
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(),
    ]
    rands = [RequestRandom(b) for b in range(8)]
    out = accept(tree, lg, params, rands, list(range(8)))
    ref_g = greedy_accept(tree, lg)
    greedyish = [0, 2, 3, 5, 7]  # temperature 0, or top_k = 1
    for b in greedyish:
        assert out.path[b].tolist() == ref_g.path[b].tolist()
        assert out.bonus[b].item() == ref_g.bonus[b].item()
    rows = [1, 3, 4, 6]
    sub = TokenTree(*(t[rows] for t in (tree.tokens, tree.parents, tree.depths, tree.valid)))
    ref_s = sample_accept(
        sub,
        lg[rows],
        torch.tensor([0.9, 1.3, 0.5, 1.0]),
        torch.tensor([0, 1, 0, 3]),
        torch.tensor([1.0, 1.0, 0.8, 1.0]),
        [RequestRandom(b) for b in rows],
        rows,
    )
    assert out.bonus[rows].tolist() == ref_s.bonus.tolist()
    assert out.num_accepted[rows].tolist() == ref_s.num_accepted.tolist()
    all_greedy = accept(tree, lg, [SamplingParams()] * 8, [None] * 8)
    assert as_lists(all_greedy) == as_lists(ref_g)


def _full_sort_mask(x: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The reference: top-k then top-p over a sort of the whole vocabulary (the rule before
    candidates), ``k``/``p`` per row ``[n, 1]``."""
    V = x.shape[-1]
    sorted_x, order = x.sort(dim=-1, descending=True)
    rank = torch.arange(V)
    keep = rank < torch.where(k > 0, k, V)
    csum = torch.softmax(sorted_x.masked_fill(~keep, float("-inf")), dim=-1).cumsum(dim=-1)
    before = torch.cat([torch.zeros_like(csum[..., :1]), csum[..., :-1]], dim=-1)
    keep = keep & ((before < p) | (p >= 1.0) | (rank == 0))
    return torch.zeros_like(keep).scatter(-1, order, keep)


def test_top_k_top_p_among_candidates_equal_the_full_sort():
    """processed_probs decides top-k / top-p among the 1024 largest logits (one topk) and sorts
    the whole vocabulary only for rows whose filter reaches past them; the kept tokens equal the
    full sort's, and a row's result does not depend on the rows beside it."""
    g = torch.Generator().manual_seed(0)
    V, n = 5000, 96
    scale = torch.tensor([0.3, 1.0, 3.0, 8.0]).repeat(n // 4)[:, None]     # flat .. peaked rows
    x = torch.randn(n, V, generator=g, dtype=torch.float64).float() * scale
    ks = torch.tensor([0, 1, 5, 50, 2000, 0])[torch.arange(n) % 6]
    ps = torch.tensor([1.0, 0.9, 0.5, 0.95, 1e-30, 0.99, 0.7])[torch.arange(n) % 7]
    t = torch.full((n,), 0.9)
    got = processed_probs(x, t, ks, ps)
    ref = torch.softmax((x / 0.9).masked_fill(
        ~_full_sort_mask(x / 0.9, ks[:, None], ps[:, None]), float("-inf")), dim=-1)
    assert torch.equal(got > 0, ref > 0)
    torch.testing.assert_close(got, ref)
    wide = (ks == 2000) | ((ks == 0) & (ps < 1) & (scale[:, 0] < 1))
    assert bool(wide.any()) and bool((~wide).any())            # both paths ran
    for r in range(0, n, 7):                                   # alone == in the batch, bitwise
        assert torch.equal(processed_probs(x[r:r + 1], t[r:r + 1], ks[r:r + 1], ps[r:r + 1]),
                           got[r:r + 1])


def test_tiny_temperature_and_top_p_are_greedy_not_a_failed_batch():
    """Valid but tiny values once failed the whole batch (float32 underflow: a temperature of
    1e-300 became 0, 1e-40 gave inf logits, a top_p of 1e-300 kept no token)."""
    tree, lg = random_batch(3, 4)
    ref_g = greedy_accept(tree, lg)
    params = [SamplingParams(temperature=1e-300), SamplingParams(temperature=1e-40),
              SamplingParams(temperature=1.0, top_p=1e-300), SamplingParams(temperature=1e-6)]
    assert [p.greedy for p in params] == [True, True, False, True]
    assert not SamplingParams(temperature=1e-5).greedy
    out = accept(tree, lg, params, [RequestRandom(b) for b in range(4)])
    assert as_lists(out) == as_lists(ref_g)   # top_p -> 0 keeps the most likely token alone
    probs = processed_probs(lg[:, 0], 1.0, 0, 1e-300)
    assert torch.equal(probs, torch.nn.functional.one_hot(lg[:, 0].argmax(-1), lg.shape[-1])
                       .float())


# ----------------------------------------------------------------------------------------------
# statistical losslessness
# ----------------------------------------------------------------------------------------------

SV = 6  # toy vocabulary
ROOT_PREFIX = (0,)  # the root token is the last token of the prefix
# draft tree shape: (parent, rank of the token in the drafter's ranking at the parent)
SHAPE = [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (4, 0), (7, 0)]  # depth-4 chain 1-4-7-8
_cache: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}


def _toy(prefix: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(target logits [SV], drafter ranking [SV]) at a prefix; a fixed pseudo-random function."""
    if prefix not in _cache:
        seed = int.from_bytes(hashlib.sha256(repr(prefix).encode()).digest()[:4], "little")
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(SV, generator=g, dtype=torch.float64) * 1.3
        rank = torch.argsort(
            logits + torch.randn(SV, generator=g, dtype=torch.float64), descending=True
        )
        _cache[prefix] = (logits.float(), rank)
    return _cache[prefix]


def toy_step_inputs(prefix: tuple[int, ...]) -> tuple[TokenTree, torch.Tensor]:
    """The tree a deterministic drafter builds at ``prefix``, and target logits [1, T, SV]."""
    node_prefix = [prefix]
    nodes = []
    for par, r in SHAPE:
        tok = int(_toy(node_prefix[par])[1][r])
        nodes.append((par, tok))
        node_prefix.append(node_prefix[par] + (tok,))
    tree = make_tree(prefix[-1], nodes)
    logits = torch.stack([_toy(p)[0] for p in node_prefix])[None]
    return tree, logits


Sampler = Callable[..., Acceptance]


def run_grouped(n_rows: int, n_tokens: int,
                step: Callable[[tuple[int, ...], list[int]], tuple[Acceptance, TokenTree]]
                ) -> list[tuple[int, ...]]:
    """Run ``n_rows`` independent generations until each has ``n_tokens`` tokens; each round, rows
    sharing a prefix are verified together: ``step(prefix, rows)`` -> (acceptance, tree) of those
    rows."""
    out: list[list[int]] = [[] for _ in range(n_rows)]
    while True:
        groups: dict[tuple[int, ...], list[int]] = {}
        for r, toks in enumerate(out):
            if len(toks) < n_tokens:
                groups.setdefault(ROOT_PREFIX + tuple(toks), []).append(r)
        if not groups:
            return [tuple(t[:n_tokens]) for t in out]
        for prefix, rows in groups.items():
            acc, tree = step(prefix, rows)
            for r, toks in zip(rows, emitted(acc, tree), strict=True):
                out[r].extend(toks)


def emit(
    sampler: Sampler,
    n_rows: int,
    n_tokens: int,
    temperature: float,
    top_k: int,
    top_p: float,
    seed: int,
    step_inputs: Callable[[tuple[int, ...]], tuple[TokenTree, torch.Tensor]] = toy_step_inputs,
) -> list[tuple[int, ...]]:
    """``n_rows`` generations of ``n_tokens`` (row r seeded ``seed * 1_000_003 + r``), each group
    of rows verifying one batch of identical trees (``step_inputs``) with ``sampler``."""
    rands = [RequestRandom(seed * 1_000_003 + r) for r in range(n_rows)]

    def step(prefix: tuple[int, ...], rows: list[int]) -> tuple[Acceptance, TokenTree]:
        t1, lg1 = step_inputs(prefix)
        B = len(rows)
        tree = TokenTree(*(t.expand(B, -1) for t in (t1.tokens, t1.parents, t1.depths, t1.valid)))
        pos = [len(prefix) - len(ROOT_PREFIX)] * B            # output position after the root
        return sampler(tree, lg1.expand(B, -1, -1), temperature, top_k, top_p,
                       [rands[r] for r in rows], pos), tree

    return run_grouped(n_rows, n_tokens, step)


def exact_joint(
    n_tokens: int, temperature: float, top_k: int, top_p: float
) -> dict[tuple[int, ...], float]:
    """Probability of each sequence of the first n_tokens under plain sampling from the target."""
    dist = {(): 1.0}
    for _ in range(n_tokens):
        nxt = {}
        for seq, pr in dist.items():
            p = processed_probs(
                _toy(ROOT_PREFIX + seq)[0].double(), temperature, top_k, top_p
            ).double()
            for x in range(SV):
                nxt[seq + (x,)] = pr * float(p[x])
        dist = nxt
    return dist


def chi2_pvalue(samples: Sequence[tuple[int, ...]], probs: dict[tuple[int, ...], float]) -> float:
    """Pearson chi-square goodness of fit; cells with expected count < 5 are pooled. Any sample in
    a cell of probability 0 gives p = 0."""
    n = len(samples)
    counts = Counter(samples)
    if any(probs.get(k, 0.0) <= 0.0 for k in counts):
        return 0.0
    bins_o, bins_e, pool_o, pool_e = [], [], 0, 0.0
    for k, pr in probs.items():
        if pr <= 0.0:
            continue
        if n * pr < 5.0:
            pool_o, pool_e = pool_o + counts.get(k, 0), pool_e + n * pr
        else:
            bins_o.append(counts.get(k, 0))
            bins_e.append(n * pr)
    if pool_e > 0.0:
        bins_o.append(pool_o)
        bins_e.append(pool_e)
    stat = sum((o - e) ** 2 / e for o, e in zip(bins_o, bins_e, strict=True))
    df = len(bins_o) - 1
    if df <= 0:
        return 1.0
    # survival function of chi2(df) = regularized upper incomplete gamma Q(df/2, stat/2)
    return float(
        torch.special.gammaincc(
            torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)
        )
    )


def test_chi2_pvalue_sanity():
    # chi2 with 2 dof: sf(x) = exp(-x/2)
    probs = {(0,): 1 / 3, (1,): 1 / 3, (2,): 1 / 3}
    samples = [(0,)] * 400 + [(1,)] * 300 + [(2,)] * 300  # stat = 20
    assert chi2_pvalue(samples, probs) == pytest.approx(math.exp(-10.0), rel=1e-9)
    assert chi2_pvalue([(0,)] * 10 + [(3,)], probs) == 0.0


N_ROWS = 20000
N_TOKENS = 3
CONFIGS = [(1.0, 0, 1.0), (0.7, 4, 0.9)]


def check_lossless(
    sampler: Sampler, temperature: float, top_k: int, top_p: float, seed: int, n_rows: int = N_ROWS
) -> list[float]:
    """p-values for the first 1, 2 and 3 emitted tokens."""
    seqs = emit(sampler, n_rows, N_TOKENS, temperature, top_k, top_p, seed)
    joint = exact_joint(N_TOKENS, temperature, top_k, top_p)
    pvals = []
    for n in range(1, N_TOKENS + 1):
        marg: dict[tuple[int, ...], float] = {}
        for k, pr in joint.items():
            marg[k[:n]] = marg.get(k[:n], 0.0) + pr
        pvals.append(chi2_pvalue([s[:n] for s in seqs], marg))
    return pvals


@pytest.mark.parametrize("temperature,top_k,top_p", CONFIGS)
def test_sample_accept_is_lossless(temperature, top_k, top_p):
    # the test must exercise deep acceptance, not only bonus tokens
    tree, lg = toy_step_inputs(ROOT_PREFIX)
    B = 4000
    acc = sample_accept(
        TokenTree(*(t.expand(B, -1) for t in (tree.tokens, tree.parents, tree.depths, tree.valid))),
        lg.expand(B, -1, -1),
        temperature,
        top_k,
        top_p,
        [RequestRandom(9 + b) for b in range(B)],
    )
    hist = torch.bincount(acc.num_accepted, minlength=5).tolist()
    assert sum(h > 0 for h in hist) >= 3 and sum(hist[2:]) > B // 10, hist
    pvals = check_lossless(sample_accept, temperature, top_k, top_p, seed=1234)
    assert min(pvals) > 1e-3, pvals


# --- negative controls: deliberately wrong rules must fail the same test ----------------------


def _reference_sampler(rule: str) -> Sampler:
    """A per-row re-implementation of the acceptance loop with a switchable (wrong) rule."""

    def sampler(tree, logits, temperature, top_k, top_p, randoms, positions=None) -> Acceptance:
        generators = [r.generator for r in randoms]
        probs = processed_probs(logits, temperature, top_k, top_p).double()  # [B, T, V]
        B, T = tree.tokens.shape
        width = int(tree.depths.max()) + 1
        path_t = torch.full((B, width), -1, dtype=torch.long)
        nums, bonuses = [], []
        for b in range(B):
            cur, path = 0, [0]
            while True:
                p = probs[b, cur].clone()
                children = [
                    i for i in range(1, T) if tree.valid[b, i] and tree.parents[b, i] == cur
                ]
                nxt = -1
                for j, c in enumerate(children):
                    x = int(tree.tokens[b, c])
                    u = float(torch.rand((), generator=generators[b], dtype=torch.float64))
                    if rule == "first_child_certain" and j == 0:
                        nxt = c
                        break
                    ratio = p[x] if rule == "no_renormalise" else p[x] / p.sum()
                    if u < ratio:
                        nxt = c
                        break
                    if rule != "bonus_from_original":
                        p[x] = 0.0
                if nxt < 0:
                    break
                path.append(nxt)
                cur = nxt
            if float(p.sum()) <= 0.0:
                p = probs[b, cur]
            bonuses.append(int(torch.multinomial(p.float(), 1, generator=generators[b])))
            nums.append(len(path) - 1)
            path_t[b, : len(path)] = torch.tensor(path)
        return Acceptance(path_t, torch.tensor(nums), torch.tensor(bonuses))

    return sampler


@pytest.mark.parametrize("temperature,top_k,top_p", CONFIGS)
@pytest.mark.parametrize("rule", ["first_child_certain", "no_renormalise", "bonus_from_original"])
def test_wrong_rules_fail_the_lossless_test(rule, temperature, top_k, top_p):
    # the pure-Python reference is slower, so fewer rows; the wrong rules still fail by far
    pvals = check_lossless(
        _reference_sampler(rule), temperature, top_k, top_p, seed=1234, n_rows=2000
    )
    assert min(pvals) < 1e-3, pvals


class _Remapped:
    """A RequestRandom whose positions are remapped (a deliberately wrong position key)."""

    def __init__(self, rand: RequestRandom, remap: Callable[[int], int]) -> None:
        self.rand, self.remap = rand, remap

    def exponentials(self, position: int, n: int, device="cpu") -> torch.Tensor:
        return self.rand.exponentials(self.remap(position), n, device)


def _wrong_positions(kind: str) -> Sampler:
    def sampler(tree, logits, temperature, top_k, top_p, randoms, positions=None) -> Acceptance:
        if kind == "positions_ignored":          # every step draws its first token at position 0
            positions = None
        elif kind == "off_by_one":               # a step's first draw reuses the last uniform
            positions = [max(x - 1, 0) for x in positions]
        elif kind == "no_level_increment":       # every level of a step shares one uniform
            randoms = [_Remapped(r, lambda q, base=pos: base)
                       for r, pos in zip(randoms, positions, strict=True)]
        elif kind == "seed_shared_by_rows":      # rows perfectly correlated
            randoms = [RequestRandom(5)] * len(randoms)
        return sample_accept(tree, logits, temperature, top_k, top_p, randoms, positions)

    return sampler


@pytest.mark.parametrize("kind", ["positions_ignored", "off_by_one", "no_level_increment",
                                  "seed_shared_by_rows"])
def test_wrong_position_keys_fail_the_lossless_test(kind):
    """Negative controls of position keying: each misuse of (seed, position) fails the same
    chi-square test the real rule passes."""
    pvals = check_lossless(_wrong_positions(kind), 1.0, 0, 1.0, seed=1234, n_rows=4000)
    assert min(pvals) < 1e-3, pvals


def test_reference_sampler_correct_rule_passes():
    """The same reference loop with the correct rule passes (controls fail for the rule only)."""
    pvals = check_lossless(_reference_sampler("correct"), 1.0, 0, 1.0, seed=77, n_rows=4000)
    assert min(pvals) > 1e-3, pvals


# --- sampled drafts (SpS): accept x ~ q w.p. min(1, p/q), residual max(p - q, 0) ---------------

GAMMA = 3


def _toy_q(prefix: tuple[int, ...]) -> torch.Tensor:
    """A draft distribution [SV] at ``prefix`` that differs from the target's (and misses token
    5)."""
    seed = int.from_bytes(hashlib.sha256(repr(("q",) + prefix).encode()).digest()[:4], "little")
    g = torch.Generator().manual_seed(seed)
    logits = _toy(prefix)[0].double() * 0.5 + torch.randn(SV, generator=g, dtype=torch.float64)
    logits[5] = -math.inf
    return torch.softmax(logits, -1).float()


def emit_sps(n_rows: int, temperature: float, top_k: int, top_p: float, seed: int,
             q_seen: Callable[[torch.Tensor], torch.Tensor] = lambda q: q) -> list[tuple[int, ...]]:
    """Rows draw a chain of GAMMA tokens from q and verify it with sample_accept; ``q_seen`` is the
    q handed to the acceptance rule (identity for the real rule)."""
    rand = RequestRandom(seed)      # one sequential stream, shared: the rule draws from it
    gen = rand.generator

    def step(prefix: tuple[int, ...], rows: list[int]) -> tuple[Acceptance, TokenTree]:
        B = len(rows)
        chains = torch.zeros(B, GAMMA, dtype=torch.long)
        q = torch.zeros(B, GAMMA + 1, SV)
        logits = torch.zeros(B, GAMMA + 1, SV)
        for i in range(B):
            pre = prefix
            logits[i, 0] = _toy(pre)[0]
            for j in range(GAMMA):
                qj = _toy_q(pre)
                x = int(torch.multinomial(qj, 1, generator=gen))
                chains[i, j], q[i, j + 1] = x, q_seen(qj)
                pre = pre + (x,)
                logits[i, j + 1] = _toy(pre)[0]
        base = chain_tree(torch.full((B,), prefix[-1]), chains)
        tree = TokenTree(base.tokens, base.parents, base.depths, base.valid, q)
        return sample_accept(tree, logits, temperature, top_k, top_p, [rand] * B), tree

    return run_grouped(n_rows, N_TOKENS, step)


@pytest.mark.parametrize("temperature,top_k,top_p", CONFIGS)
def test_sampled_chain_drafts_are_lossless(temperature, top_k, top_p):
    seqs = emit_sps(12000, temperature, top_k, top_p, seed=77)
    joint = exact_joint(N_TOKENS, temperature, top_k, top_p)
    for n in range(1, N_TOKENS + 1):
        marg: dict[tuple[int, ...], float] = {}
        for k, pr in joint.items():
            marg[k[:n]] = marg.get(k[:n], 0.0) + pr
        assert chi2_pvalue([s[:n] for s in seqs], marg) > 1e-3, n


def test_sampled_chain_wrong_q_fails():
    """Negative control: handing the rule a q other than the one the drafts came from is caught."""
    uniform = lambda q: torch.full_like(q, 1.0 / SV)  # noqa: E731
    seqs = emit_sps(12000, 1.0, 0, 1.0, seed=78, q_seen=uniform)
    joint = exact_joint(N_TOKENS, 1.0, 0, 1.0)
    marg: dict[tuple[int, ...], float] = {}
    for k, pr in joint.items():
        marg[k[:2]] = marg.get(k[:2], 0.0) + pr
    assert chi2_pvalue([s[:2] for s in seqs], marg) < 1e-6


def test_sampled_drafts_need_a_chain():
    tree = make_tree(0, [(0, 1), (0, 2)])
    tree = TokenTree(tree.tokens, tree.parents, tree.depths, tree.valid,
                     torch.full((1, 3, SV), 1.0 / SV))
    with pytest.raises(ValueError, match="chain"):
        sample_accept(tree, torch.zeros(1, 3, SV), 1.0, 0, 1.0, [RequestRandom(0)])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_greedy_tokens_break_ties_to_the_first_index(dtype):
    """The fast CPU path (max().indices) must pick exactly what argmax picks, ties included:
    bf16 logits tie often, and AR and every drafter share this choice."""
    from dart_ray.verify.acceptance import greedy_tokens

    g = torch.Generator().manual_seed(0)
    # integer-valued: many exact ties
    x = (torch.randn(6, 13, 4099, generator=g) * 2).round().to(dtype)
    x[0, 0] = 0
    x[0, 0, [7, 9, 4000]] = 5                                          # a three-way tie for the max
    got = greedy_tokens(x)
    assert got.shape == (6, 13)
    assert torch.equal(got, x.argmax(dim=-1))
    assert got[0, 0].item() == 7


def test_the_race_never_draws_a_token_of_probability_zero():
    """``torch.rand`` returns exactly 0 once in 2**24 (E = inf, p / E = 0): where that hit every
    token with p > 0 (top_k = 1, a peaked softmax), argmax fell to index 0 -- a token of
    probability 0 (SmolLM2's <|endoftext|>)."""
    from dart_ray.verify.randomness import race

    probs = torch.zeros(3, 8)
    probs[0, 5] = 1.0                                   # one-token support, its variate infinite
    probs[1, 2], probs[1, 6] = 0.25, 0.75               # both infinite
    probs[2, 3], probs[2, 4] = 0.5, 0.5                 # one infinite, one finite
    exps = torch.ones(3, 8)
    exps[0, 5] = exps[1, 2] = exps[1, 6] = exps[2, 3] = float("inf")
    got = race(probs, exps).tolist()
    assert got[0] == 5 and got[1] in (2, 6) and got[2] == 4
    assert race(torch.tensor([[0.1, 0.0, 0.9]]), torch.tensor([[1.0, 1e-30, 5.0]])).item() == 2
