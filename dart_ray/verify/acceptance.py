"""Acceptance rules: which draft-tree nodes the target model agrees with.

One target forward over ``[root, draft nodes]`` gives, at every node ``i``, the target's logits for
the token that *follows* node ``i`` (``logits[:, i]``). From those this module decides, per row:

* **accepted tokens** -- the draft nodes on one root-to-node path that the target agrees with
  (``num_accepted`` of them, ``0 .. d``). The root itself is the token the target chose in the
  previous step; it is always on the path but is not counted as accepted.
* **bonus token** -- one extra token chosen by the target after the last accepted node (from its
  logits there), so every step commits ``num_accepted + 1`` tokens and never fewer than one.
* **residual** -- in sampling mode, the target distribution at the current node after the mass of
  every rejected child token has been removed (set to 0) and the rest renormalised. The bonus is
  drawn from the residual, which is what makes the scheme lossless.

Greedy (``temperature == 0``): a node is correct iff its token is the argmax of its parent's
logits; the accepted path is the deepest all-correct path and the bonus is the argmax after it.
The emitted tokens are exactly those plain greedy decoding would produce.

Sampling, deterministic drafts (every drafter but SpS): position-keyed
(:mod:`dart_ray.verify.randomness`). The target draws the token at each output position by an
exponential race keyed by (the request's seed, the position); a child is
accepted iff it carries the drawn token, and the drawn token after the last accepted node is the
bonus. Each emitted token is the target's sample given its prefix -- and the very token plain
sampling with the same seed draws there, so a seeded request's output does not depend on the
tree, the method or the batch. A node's children are accepted with probability ``sum p(x)`` over
their distinct tokens, what recursive rejection sampling (SpecInfer-style multi-draft
verification, Miao et al., 2024) gives for point-mass drafts. ``tests/verify/test_acceptance.py``
checks losslessness statistically, including a negative control that must fail, and equality with
plain sampling.

Sampled drafts (``tree.draft_probs`` set, chains only -- the SpS draft model): the standard rule
of Leviathan et al. (2023) -- accept ``x ~ q`` with probability ``min(1, p(x) / q(x))``; on
rejection the bonus is drawn from ``max(p - q, 0)`` renormalised -- with the request's sequential
generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dart_ray.config import SamplingParams
from dart_ray.tree.tree import TokenTree
from dart_ray.verify.logits import NodeLogits, internal_nodes
from dart_ray.verify.randomness import RequestRandom, race

__all__ = ["Acceptance", "accept", "greedy_accept", "processed_probs", "sample_accept"]


@dataclass
class Acceptance:
    """Outcome of verifying one batch of token trees."""

    # [B, d+1] int64 node indices of the accepted path; path[:, 0] = 0 (root); -1 padded
    path: torch.Tensor
    num_accepted: torch.Tensor  # [B] int64 accepted draft nodes (path length - 1), 0..d
    bonus: torch.Tensor  # [B] int64 token chosen by the target after the last accepted node


# ----------------------------------------------------------------------------------------------
# target distribution
# ----------------------------------------------------------------------------------------------


def _per_row(value: torch.Tensor | float, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A scalar, or a tensor over the leading dims of ``like``, reshaped to broadcast against it."""
    t = torch.as_tensor(value, dtype=dtype, device=like.device)
    if t.dim() == 0:
        return t
    if t.dim() >= like.dim():
        raise ValueError(
            f"per-row parameter of shape {tuple(t.shape)} does not fit logits {tuple(like.shape)}"
        )
    return t.reshape(tuple(t.shape) + (1,) * (like.dim() - t.dim()))


TOP_CANDIDATES = 1024
"""Tokens a top-k / top-p filter looks at first, with one ``topk`` instead of a sort of the whole
vocabulary; rows whose filter reaches past them (k > 1024, a nucleus wider than 1024 tokens) fall
back to a full sort, row by row. Both give the same tokens (``tests/verify/test_acceptance.py``)."""


def _kept_mask(x: torch.Tensor, k: torch.Tensor, p: torch.Tensor, need_p: bool,
               candidates: int = TOP_CANDIDATES) -> torch.Tensor:
    """``[..., V]`` bool mask of the tokens top-k / top-p keep, decided among each row's
    ``candidates`` largest logits; rows whose filter reaches past them are decided again with all
    ``V`` as candidates (a full sort), row by row."""
    V = x.shape[-1]
    C = min(V, candidates)
    one = x.shape[:-1] + (1,)
    kk = torch.where((k > 0) & (k < V), k, V).expand(one)                 # [..., 1] effective k
    pp = p.expand(one)                                                     # [..., 1]
    vals, idx = x.topk(C, dim=-1)                                          # [..., C] descending
    rank = torch.arange(C, device=x.device)                                # [C]
    keep = rank < kk                                                       # [..., C]
    ok = kk <= C                              # every top-k token is a candidate
    if need_p:
        # the distribution top_p reads: the top-k renormalised one, or the whole
        norm = torch.where(kk <= C,
                           torch.logsumexp(vals.masked_fill(~keep, float("-inf")), -1, True),
                           torch.logsumexp(x, -1, True))                   # [..., 1]
        csum = torch.exp(vals - norm).masked_fill(~keep, 0.0).cumsum(dim=-1)   # [..., C]
        before = torch.cat([torch.zeros_like(csum[..., :1]), csum[..., :-1]], dim=-1)
        # rank 0 always stays: a top_p that underflows float32 (e.g. 1e-300) keeps it alone
        keep = keep & ((before < pp) | (pp >= 1.0) | (rank == 0))
        # no top-k and the nucleus closes inside the candidates: decided here too
        ok = ok | ((kk == V) & (pp < 1.0) & (csum[..., -1:] >= pp))
    unfiltered = (kk >= V) & (pp >= 1.0)                                   # [..., 1] keep all
    mask = torch.zeros(x.shape, dtype=torch.bool, device=x.device).scatter(-1, idx, keep)
    mask = mask | unfiltered
    wide = ~(ok | unfiltered)[..., 0]                                      # [...] (never if C == V)
    if bool(wide.any()):
        # which path decides a row depends on the row alone, not on the rows beside it
        mask[wide] = _kept_mask(x[wide], kk[wide], pp[wide], need_p, candidates=V)
    return mask


def processed_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor | float,
    top_k: torch.Tensor | int,
    top_p: torch.Tensor | float,
) -> torch.Tensor:
    """``[..., V]`` logits -> ``[..., V]`` float32 probabilities the target samples from.

    Applied in this order (the Hugging Face order): divide by ``temperature`` (> 0), keep the
    ``top_k`` largest logits (0 = off; ties broken by sort order, so exactly k stay), then keep the
    smallest set of most likely tokens whose cumulative probability (of the top-k renormalised
    distribution) reaches ``top_p`` (1.0 = off; the most likely token is always kept). Each
    parameter is a scalar or a tensor over leading dims (``[B]`` applies to dim 0).
    """
    x = logits.float()  # [..., V]
    V = x.shape[-1]
    t = _per_row(temperature, x, torch.float32)
    if bool((t <= 0).any()):
        raise ValueError(
            "processed_probs needs temperature > 0 (greedy rows are handled by argmax)"
        )
    k = _per_row(top_k, x, torch.long)
    p = _per_row(top_p, x, torch.float32)
    x = x / t
    need_k = bool(((k > 0) & (k < V)).any())
    need_p = bool((p < 1.0).any())
    if need_k or need_p:
        x = x.masked_fill(~_kept_mask(x, k, p, need_p), float("-inf"))
    return torch.softmax(x, dim=-1)


# ----------------------------------------------------------------------------------------------
# greedy
# ----------------------------------------------------------------------------------------------


def _max_depth(tree: TokenTree) -> int:
    d = tree.depths.masked_fill(~tree.valid, 0)
    return int(d.max()) if d.numel() else 0


def _path_to(tree: TokenTree, last: torch.Tensor, width: int) -> torch.Tensor:
    """[B] node indices -> [B, width] root-to-node paths (-1 padded). Loops over depth levels."""
    B = tree.batch_size
    dev = tree.tokens.device
    rows = torch.arange(B, device=dev)
    depth = tree.depths.gather(1, last[:, None])[:, 0]  # [B]
    path = torch.full((B, width), -1, dtype=torch.long, device=dev)
    cur = last.clone()  # [B]
    for s in range(width):
        pos = depth - s  # [B] path slot of `cur`
        live = pos >= 0
        path[rows[live], pos[live]] = cur[live]
        cur = tree.parents.gather(1, cur[:, None])[:, 0].clamp(min=0)
    return path


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``[..., V]`` -> ``[...]``: the argmax over the vocabulary, ties to the lowest index.

    On CPU ``max(dim).indices`` computes the same thing several times faster than ``argmax`` for
    bf16 logits (16 x 23 tree nodes x 49k vocab on 2 cores: 6.1 vs 28.6 ms), which matters when
    every node of a batch needs its greedy token; both return the first maximal index there (a test
    pins it).
    """
    if logits.device.type == "cpu":
        return logits.max(dim=-1).indices
    return logits.argmax(dim=-1)


def greedy_accept(tree: TokenTree, logits: torch.Tensor | NodeLogits) -> Acceptance:
    """Greedy verification. ``logits``: ``[B, 1+N, V]`` from one target forward over the tree, or a
    :class:`~dart_ray.verify.logits.NodeLogits` (the LM head run only where it is needed).

    Node ``i`` is correct iff it is valid and ``tokens[i] == argmax(logits[parents[i]])``; the
    accepted node is the deepest node whose whole path is correct (lowest index among equals).
    Only the root's and internal nodes' argmax decide acceptance; a leaf's logits are read only if
    it is the accepted node (its argmax is the bonus).
    Vectorised: the only Python loops run over depth levels.
    """
    B, T = tree.tokens.shape
    nl = NodeLogits.of(logits)
    if tuple(nl.shape) != (B, T):
        raise ValueError(f"logits shape {tuple(nl.shape)} does not match tree {(B, T)}")
    dev = nl.device
    rows_i, nodes_i = internal_nodes(tree).nonzero(as_tuple=True)
    # [B, T] the target's next token after each internal node
    pred = torch.full((B, T), -1, dtype=torch.long, device=dev)
    pred[rows_i, nodes_i] = greedy_tokens(nl.at(rows_i, nodes_i))
    par = tree.parents.clamp(min=0)  # [B, T]
    correct = tree.valid & (tree.tokens == pred.gather(1, par))  # [B, T]
    correct[:, 0] = True
    d = _max_depth(tree)
    ok = correct  # [B, T] whole path correct
    for _ in range(max(d - 1, 0)):  # one level of propagation per pass
        ok = correct & ok.gather(1, par)
    idx = torch.arange(T, device=dev)
    score = torch.where(ok, tree.depths * T + (T - 1 - idx), torch.full_like(tree.depths, -1))
    last = score.argmax(dim=1)  # [B] deepest, then lowest index
    num = tree.depths.gather(1, last[:, None])[:, 0]  # [B]
    bonus = pred.gather(1, last[:, None])[:, 0]  # [B]
    leaf = bonus < 0  # accepted a leaf: its logits were not needed until now
    if bool(leaf.any()):
        rows = torch.arange(B, device=dev)[leaf]
        bonus[leaf] = greedy_tokens(nl.at(rows, last[leaf]))
    return Acceptance(path=_path_to(tree, last, d + 1), num_accepted=num, bonus=bonus)


# ----------------------------------------------------------------------------------------------
# sampling
# ----------------------------------------------------------------------------------------------


def _uniforms(n: int, gen: torch.Generator | None) -> list[float]:
    if gen is None:
        return torch.rand(n, dtype=torch.float64).tolist()
    return torch.rand(n, generator=gen, dtype=torch.float64, device=gen.device).tolist()


def _row_params(params: tuple, rows: torch.Tensor) -> tuple:
    """Per-row (temperature, top_k, top_p) -- scalars or ``[B]`` tensors -- of ``rows``."""
    return tuple(v[rows] if isinstance(v, torch.Tensor) and v.dim() > 0 else v for v in params)


class _NodeProbs:
    """Processed target probabilities at tree nodes (the sampling distribution), from NodeLogits:
    eager on internal nodes, on demand elsewhere, each row with its own temperature / top-k /
    top-p. (Sampled drafts only: they need ``p`` at every draft token.)"""

    def __init__(self, tree: TokenTree, logits: NodeLogits, temperature, top_k, top_p) -> None:
        self.logits = logits
        self.params = (temperature, top_k, top_p)
        B, T = tree.tokens.shape
        dev = logits.device
        rows, nodes = internal_nodes(tree).nonzero(as_tuple=True)
        self.slot = torch.full((B, T), -1, dtype=torch.long, device=dev)  # [B, T] row of self.probs
        self.slot[rows, nodes] = torch.arange(rows.shape[0], device=dev)
        self.probs = self._compute(rows, nodes)                           # [K, V] float32

    def _compute(self, rows: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
        return processed_probs(self.logits.at(rows, nodes), *_row_params(self.params, rows))

    def at(self, rows: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
        """``[n, V]`` probabilities at (rows[j], nodes[j]); nodes without logits yet are
        computed."""
        slot = self.slot[rows, nodes]
        out = torch.empty(rows.shape[0], self.probs.shape[-1], dtype=self.probs.dtype,
                          device=self.probs.device)
        have = slot >= 0
        out[have] = self.probs[slot[have]]
        if not bool(have.all()):
            out[~have] = self._compute(rows[~have], nodes[~have])
        return out


def sample_accept(
    tree: TokenTree,
    logits: torch.Tensor | NodeLogits,
    temperature: torch.Tensor | float,
    top_k: torch.Tensor | int,
    top_p: torch.Tensor | float,
    randoms: Sequence[RequestRandom],
    positions: Sequence[int] | None = None,
) -> Acceptance:
    """Lossless multi-draft acceptance, position-keyed (:mod:`dart_ray.verify.randomness`).

    ``logits``: ``[B, 1+N, V]`` (or :class:`~dart_ray.verify.logits.NodeLogits`); ``temperature``
    (> 0), ``top_k``, ``top_p``: scalars or ``[B]``; ``randoms[b]``: row b's randomness;
    ``positions[b]``: the output position of the token after row b's root (default 0).

    Deterministic drafts: walking down from the root, the target draws the token at each position
    by the exponential race of ``randoms[b].exponentials(position, V)`` over its processed
    distribution (:func:`~dart_ray.verify.randomness.race`); the child carrying that
    token is accepted (the first one, if siblings repeat a token), and where no child does, the
    drawn token is the bonus. Each emitted token is the target's sample given its prefix, and the
    one plain sampling draws at that position with the same seed, whatever the tree was.
    """
    B, T = tree.tokens.shape
    nl = NodeLogits.of(logits)
    if tuple(nl.shape) != (B, T):
        raise ValueError(f"logits shape {tuple(nl.shape)} does not match tree {(B, T)}")
    if len(randoms) != B:
        raise ValueError(f"need one RequestRandom per row: got {len(randoms)} for batch {B}")
    positions = [0] * B if positions is None else [int(x) for x in positions]
    if len(positions) != B:
        raise ValueError(f"need one position per row: got {len(positions)} for batch {B}")
    t = _per_row(temperature, tree.tokens, torch.float32)
    if bool((t <= 0).any()):
        raise ValueError("processed_probs needs temperature > 0 (greedy rows are handled by "
                         "argmax)")
    if tree.draft_probs is not None:
        if tuple(tree.draft_probs.shape[:2]) != (B, T):
            raise ValueError(f"draft_probs {tuple(tree.draft_probs.shape)} do not match the tree "
                             f"{(B, T)}")
        return _sample_accept_pq(tree, _NodeProbs(tree, nl, temperature, top_k, top_p),
                                 [r.generator for r in randoms])
    dev = nl.device
    params = (temperature, top_k, top_p)
    tok_l = tree.tokens.cpu().tolist()
    par_l = tree.parents.cpu().tolist()
    valid_l = tree.valid.cpu().tolist()
    # kids[b][node] = {token: first child carrying it}
    kids: list[dict[int, dict[int, int]]] = []
    for b in range(B):
        k: dict[int, dict[int, int]] = {}
        for i in range(1, T):
            if valid_l[b][i]:
                k.setdefault(par_l[b][i], {}).setdefault(tok_l[b][i], i)
        kids.append(k)
    paths: list[list[int]] = [[0] for _ in range(B)]
    bonus = [0] * B
    active = list(range(B))
    level = 0
    while active:                       # one level per pass: the rows still on their trees
        rows = torch.tensor(active, dtype=torch.long, device=dev)
        nodes = torch.tensor([paths[b][-1] for b in active], dtype=torch.long, device=dev)
        probs = processed_probs(nl.at(rows, nodes), *_row_params(params, rows))   # [n, V]
        V = probs.shape[-1]
        exps = torch.stack([randoms[b].exponentials(positions[b] + level, V, dev)
                            for b in active])                                    # [n, V]
        drawn = race(probs, exps).tolist()                                         # [n]
        still = []
        for b, x in zip(active, drawn, strict=True):
            child = kids[b].get(paths[b][-1], {}).get(x, -1)
            if child < 0:
                bonus[b] = x
            else:
                paths[b].append(child)
                still.append(b)
        active = still
        level += 1
    return _acceptance(tree, paths, torch.tensor(bonus, dtype=torch.long, device=dev))


def _draw(resid: torch.Tensor, orig: torch.Tensor, u: list[float]) -> torch.Tensor:
    """One token per row from the (unnormalised) residual ``[B, V]`` with uniforms ``u``."""
    dev = resid.device
    empty = resid.sum(dim=-1) <= 0  # [B] cannot happen exactly
    resid = torch.where(empty[:, None], orig, resid)
    cdf = resid.double().cumsum(dim=-1)  # [B, V]
    thr = torch.tensor(u, dtype=torch.float64, device=dev) * cdf[:, -1]  # [B]
    bonus = torch.searchsorted(cdf, thr[:, None], right=True)[:, 0]  # first index with cdf > thr
    V = resid.shape[-1]
    last_pos = torch.where(resid > 0, torch.arange(V, device=dev), -1).amax(dim=-1)  # [B]
    return torch.minimum(bonus, last_pos)  # guard rounding at the top


def _sample_accept_pq(tree: TokenTree, probs: _NodeProbs,
                      generators: Sequence[torch.Generator | None]) -> Acceptance:
    """Sampled chain drafts: accept x ~ q w.p. min(1, p(x)/q(x)); else bonus ~ max(p - q, 0).

    Uniforms come from each row's sequential generator: ``n_valid_nodes(b) + 1`` per call."""
    B, T = tree.tokens.shape
    # p_child[b, i] = p(tokens[i] | parent of i) (every valid node's parent is internal)
    par_slot = probs.slot.gather(1, tree.parents.clamp(min=0)).clamp(min=0)    # [B, T]
    p_child = (probs.probs[par_slot, tree.tokens] if probs.probs.shape[0]      # [B, T]
               else torch.zeros(B, T, device=probs.probs.device))
    p_child_l = p_child.double().cpu().tolist()
    valid_l = tree.valid.cpu().tolist()
    dev = probs.probs.device
    if T > 1 and not bool(((tree.parents[:, 1:] == torch.arange(T - 1, device=tree.parents.device))
                           | ~tree.valid[:, 1:]).all()):
        raise ValueError("draft_probs (sampled drafts) are only supported for chain trees")
    q = tree.draft_probs                                          # [B, T, V]
    q_child = q.gather(2, tree.tokens.unsqueeze(-1)).squeeze(-1)  # [B, T] q(token_i)
    q_child_l = q_child.double().cpu().tolist()
    paths: list[list[int]] = []
    last_nodes: list[int] = []
    rejected: list[int] = []                                      # rejected node per row (-1: none)
    bonus_u: list[float] = []
    for b in range(B):
        n_valid = sum(valid_l[b][1:])
        u = _uniforms(n_valid + 1, generators[b])
        path, rej = [0], -1
        for i in range(1, n_valid + 1):
            px, qx = p_child_l[b][i], q_child_l[b][i]
            if qx <= 0:
                raise ValueError("a sampled draft token has q(x) = 0")
            if u[i - 1] * qx < px:                                # accept w.p. min(1, p/q)
                path.append(i)
            else:
                rej = i
                break
        paths.append(path)
        last_nodes.append(path[-1])
        rejected.append(rej)
        bonus_u.append(u[n_valid])
    rows = torch.arange(B, device=dev)
    last = torch.tensor(last_nodes, dtype=torch.long, device=dev)
    orig = probs.at(rows, last)                                   # [B, V]
    rej_t = torch.tensor(rejected, dtype=torch.long, device=dev)
    q_rej = q[rows, rej_t.clamp(min=0)]                           # [B, V]
    resid = torch.where((rej_t >= 0)[:, None], (orig - q_rej).clamp(min=0), orig)
    return _acceptance(tree, paths, _draw(resid, orig, bonus_u))


def _acceptance(tree: TokenTree, paths: list[list[int]], bonus: torch.Tensor) -> Acceptance:
    B = len(paths)
    dev = bonus.device
    width = _max_depth(tree) + 1
    path_t = torch.full((B, width), -1, dtype=torch.long)
    for b, pth in enumerate(paths):
        path_t[b, : len(pth)] = torch.tensor(pth, dtype=torch.long)
    num = torch.tensor([len(pth) - 1 for pth in paths], dtype=torch.long)
    return Acceptance(path=path_t.to(dev), num_accepted=num.to(dev), bonus=bonus.long())


# ----------------------------------------------------------------------------------------------
# mixed batches
# ----------------------------------------------------------------------------------------------


def accept(
    tree: TokenTree,
    logits: torch.Tensor | NodeLogits,
    params_list: Sequence[SamplingParams],
    randoms: Sequence[RequestRandom | None],
    positions: Sequence[int] | None = None,
) -> Acceptance:
    """Verify a batch whose rows may mix greedy and sampled requests.

    Greedy rows get :func:`greedy_accept` semantics, sampled rows :func:`sample_accept` with their
    own temperature / top-k / top-p, ``randoms[b]`` and ``positions[b]`` (the output position of
    the token after the root; default 0).
    """
    B = tree.batch_size
    if len(params_list) != B or len(randoms) != B:
        raise ValueError(f"need one SamplingParams and one RequestRandom per row (batch {B})")
    positions = [0] * B if positions is None else list(positions)
    greedy = [b for b, sp in enumerate(params_list) if sp.greedy]
    logits = NodeLogits.of(logits)
    if len(greedy) == B:
        return greedy_accept(tree, logits)
    # Mixed or all-sampled batch: each rule sees only its own rows (the vocabulary argmax of
    # greedy_accept is not spent on sampled rows), merged into one [B, d+1] result.
    dev = logits.device
    out = Acceptance(path=torch.full((B, _max_depth(tree) + 1), -1, dtype=torch.long, device=dev),
                     num_accepted=torch.zeros(B, dtype=torch.long, device=dev),
                     bonus=torch.zeros(B, dtype=torch.long, device=dev))
    if greedy:
        idx = torch.tensor(greedy, dtype=torch.long, device=dev)
        _put_rows(out, idx, greedy_accept(tree.select_rows(idx), logits.select_rows(idx)))
    sampled = [b for b, sp in enumerate(params_list) if not sp.greedy]
    missing = [b for b in sampled if randoms[b] is None]
    if missing:
        raise ValueError(f"sampled rows {missing} have no RequestRandom")
    idx = torch.tensor(sampled, dtype=torch.long, device=dev)
    temps = torch.tensor([params_list[b].temperature for b in sampled], dtype=torch.float32,
                         device=dev)
    ks = torch.tensor([params_list[b].top_k for b in sampled], dtype=torch.long, device=dev)
    ps = torch.tensor([params_list[b].top_p for b in sampled], dtype=torch.float32, device=dev)
    sub = sample_accept(tree.select_rows(idx), logits.select_rows(idx), temps, ks, ps,
                        [randoms[b] for b in sampled], [positions[b] for b in sampled])
    _put_rows(out, idx, sub)
    return out


def _put_rows(out: Acceptance, idx: torch.Tensor, sub: Acceptance) -> None:
    """Write the per-row results ``sub`` (rows ``idx`` of ``out``, possibly narrower paths) into
    ``out``."""
    out.path[idx, :sub.path.shape[1]] = sub.path
    out.num_accepted[idx] = sub.num_accepted
    out.bonus[idx] = sub.bonus
