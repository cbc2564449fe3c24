"""N-gram-pruned beam search that turns one DART drafter forward into a draft tree.

Inputs per sequence ``b``: the root token (already chosen by the target), the drafter's ``d``
per-level logits (level ``l`` predicts the token ``l + 1`` positions after the root; all levels come
from ONE forward, so the level-``l`` distribution is the same for every path), the last committed
tokens (N-gram context) and optionally an N-gram scorer.

Algorithm (vectorised over the batch, the beams and the candidates; the only Python loop is over
the ``d`` levels):

1. ``d = min(decoding.draft_depth, draft_logits.shape[1])`` (the draft depth used),
   ``k = min(decoding.top_k, V)``. One ``topk`` over the vocabulary for all levels:
   ``[B, d, V] -> [B, d, k]`` (an exact two-stage block-max topk for large V, see
   :func:`_topk_last`); ``p_draft`` is the softmax over those ``k`` logits (renormalised). A
   candidate whose logit is ``-inf`` (masked token) gets score ``-inf`` and is never put in the
   tree.
2. Level 0: the ``k`` candidates are children of the root with score
   ``ln(p_draft + eps)`` (level weight ``1**-a = 1``, logit weight ``b**0 = 1``; the N-gram term is
   skipped at level 0, as in DART). The best ``beam_width`` become beams.
3. Level ``l >= 1``: every beam expands all ``k`` candidates of level ``l``::

       child = parent + (l+1)**-a * (b**l * ln(p_draft + eps) + ngram_weight * ln(p_ngram + eps))

   where ``p_ngram = ngram.prob(last order-1 tokens of (context + root + beam path), candidate)``.
   The N-gram lookups of all ``B * beams * k`` expansions of a level are ONE ``prob()`` call. The
   N-gram term is dropped entirely when ``ngram is None`` or ``ngram_weight == 0``. The best
   ``beam_width`` children (by score) become the next beams.
4. Every expansion of every level is a pool node ``(level, token, parent, score)``. The tree is the
   best ``tree_budget`` pool nodes.

Prefix closure (choice made here, deterministic): nodes are ranked by the *effective* score
``eff(node) = min(score(node), eff(parent))`` (the path minimum), ties broken by pool id, which is
level-major, so a parent always has a smaller pool id than its children. Hence a parent ranks
strictly before each of its children and the top-``tree_budget`` set is prefix-closed by
construction (no orphan removal needed). Every log term is ``<= ln(1 + eps)``, so scores are
non-increasing along a path up to ``eps``-sized noise; whenever they are, ``eff == score`` and the
selection is exactly "top ``tree_budget`` by score". Only a child that scores above its parent
(``p ~ 1`` + eps, ties) is capped to its parent's score, i.e. it is kept only if its parent is.
A runtime check still verifies closure and raises if it were ever violated.

Duplicate siblings cannot occur: the children of one parent are the ``k`` distinct ``topk`` indices
of a single distribution, and every beam is a distinct pool node.

Output: a :class:`~dart_ray.tree.tree.TokenTree` with ``1 + N`` nodes, ``N`` = the largest number
of valid nodes over the batch (``<= tree_budget``). Draft nodes are in *priority order*: effective
score descending, ties by pool id ascending -- so parents precede children and the first ``n`` nodes
are exactly the tree this search returns with ``tree_budget = n`` (the adaptive controller truncates
trees that way). Rows with fewer valid nodes are padded (``valid=False``, parent 0, depth 1, token
0). :func:`build_trees_with_scores` also returns the node scores ``[B, 1+N]`` (root 0, padding
``-inf``).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np
import torch

from dart_ray.config import DecodingConfig
from dart_ray.tree.tree import TokenTree

__all__ = ["NGramScorer", "build_trees", "build_trees_with_scores"]

_NEG_INF = float("-inf")


@runtime_checkable
class NGramScorer(Protocol):
    """What the tree search needs from an N-gram model.

    ``order`` is the N-gram order (context length ``order - 1``). ``prob(ctx, tokens, min_count)``
    takes ``ctx: [M, order-1] int64`` (oldest token first; ``-1`` = no token) and
    ``tokens: [M] int64`` and returns ``[M]`` probabilities ``P(token | ctx)`` (0 for unseen),
    ignoring counts below ``min_count``.
    """

    order: int

    def prob(self, ctx: np.ndarray, tokens: np.ndarray, min_count: int) -> np.ndarray: ...


def build_trees(
    roots: torch.Tensor,
    draft_logits: torch.Tensor,
    decoding: DecodingConfig,
    context: torch.Tensor | None = None,
    ngram: NGramScorer | None = None,
) -> TokenTree:
    """Draft trees for a batch; see the module docstring. Shapes as in
    :func:`build_trees_with_scores`."""
    tree, _ = build_trees_with_scores(roots, draft_logits, decoding, context=context, ngram=ngram)
    return tree


def build_trees_with_scores(
    roots: torch.Tensor,
    draft_logits: torch.Tensor,
    decoding: DecodingConfig,
    context: torch.Tensor | None = None,
    ngram: NGramScorer | None = None,
) -> tuple[TokenTree, torch.Tensor]:
    """Draft trees plus node scores.

    Args:
        roots: ``[B]`` int64 root tokens.
        draft_logits: ``[B, D, V]`` float drafter logits; level 0 predicts the token after the root.
            Only the first ``min(decoding.draft_depth, D)`` levels are used.
        decoding: the knobs (``draft_depth, top_k, beam_width, tree_budget, ngram_weight,
            ngram_min_count, level_weight_exp, logit_weight_base, eps``).
        context: ``[B, c]`` int64 last committed tokens before the root (``-1`` = none); only used
            for N-gram contexts. ``None`` = no context.
        ngram: N-gram scorer, or ``None`` to disable the N-gram term.

    Returns:
        ``(tree, scores)``: ``tree`` has ``[B, 1+N]`` tensors, ``N <= decoding.tree_budget``;
        ``scores`` is ``[B, 1+N]`` float32 (root 0, padding ``-inf``).
    """
    # ---------------------------------------------------------------- validation
    if not isinstance(decoding, DecodingConfig):
        raise TypeError(f"decoding must be a DecodingConfig, got {type(decoding).__name__}")
    if draft_logits.dim() != 3:
        raise ValueError(f"draft_logits must be [B, d, V], got shape {tuple(draft_logits.shape)}")
    if not draft_logits.is_floating_point():
        raise ValueError(f"draft_logits must be floating point, got {draft_logits.dtype}")
    B, D, V = draft_logits.shape
    if D < 1 or V < 1:
        raise ValueError(f"draft_logits needs >= 1 level and >= 1 vocab entry, got {(B, D, V)}")
    if roots.shape != (B,):
        raise ValueError(f"roots must be [B]={[B]}, got shape {tuple(roots.shape)}")
    if roots.is_floating_point() or roots.dtype == torch.bool:
        raise ValueError(f"roots must be an integer tensor, got {roots.dtype}")
    if context is not None:
        if context.dim() != 2 or context.shape[0] != B:
            raise ValueError(f"context must be [B={B}, c], got shape {tuple(context.shape)}")
        if context.is_floating_point() or context.dtype == torch.bool:
            raise ValueError(f"context must be an integer tensor, got {context.dtype}")
    use_ngram = ngram is not None and decoding.ngram_weight > 0.0
    o1 = 0  # N-gram context length (order - 1)
    if use_ngram:
        order = getattr(ngram, "order", None)
        if not isinstance(order, (int, np.integer)) or int(order) < 1:
            raise ValueError(f"ngram.order must be an int >= 1, got {order!r}")
        o1 = int(order) - 1

    dev = draft_logits.device
    roots = roots.to(device=dev, dtype=torch.long)  # [B]
    if B == 0:
        empty_l = torch.empty((0, 1), dtype=torch.long, device=dev)
        tree = TokenTree(tokens=empty_l, parents=empty_l.clone(), depths=empty_l.clone(),
                         valid=torch.empty((0, 1), dtype=torch.bool, device=dev))
        return tree, torch.empty((0, 1), dtype=torch.float32, device=dev)

    d = min(decoding.draft_depth, D)
    k = min(decoding.top_k, V)
    W = decoding.beam_width
    eps = decoding.eps
    a = decoding.level_weight_exp
    lvl_w = [(lvl + 1) ** (-a) for lvl in range(d)]  # level weight (l+1)^-a
    draft_w = torch.tensor([lvl_w[lvl] * decoding.logit_weight_base ** lvl for lvl in range(d)],
                           dtype=torch.float32, device=dev)  # [d]

    # ---------------------------------------------------------------- per-level candidates
    top_v, top_i = _topk_last(draft_logits[:, :d], k)       # [B, d, k] each, sorted desc
    top_v = top_v.float()                                   # [B, d, k]
    if bool((torch.isnan(top_v) | torch.isposinf(top_v)).any()):
        raise ValueError("draft_logits contain NaN or +inf")
    finite = top_v > _NEG_INF                               # [B, d, k]
    p_draft = torch.softmax(top_v, dim=-1)                  # [B, d, k] (NaN if a level is all -inf)
    p_draft = torch.where(finite, p_draft, torch.zeros_like(p_draft))  # [B, d, k]
    d_inc = torch.log(p_draft + eps) * draft_w[None, :, None]  # [B, d, k] draft term per level
    d_inc = d_inc.masked_fill(~finite, _NEG_INF)               # [B, d, k]

    # N-gram tail of the committed text + root: last o1 tokens, left-padded with -1.
    if use_ngram:
        if context is None:
            hist = roots[:, None]                                            # [B, 1]
        else:
            ctx_ids = context.to(device=dev, dtype=torch.long)               # [B, c]
            hist = torch.cat([ctx_ids, roots[:, None]], 1)                   # [B, c+1]
        if hist.shape[1] < o1:
            pad = torch.full((B, o1 - hist.shape[1]), -1, dtype=torch.long, device=dev)  # [B, pad]
            hist = torch.cat([pad, hist], 1)                                 # [B, >=o1]
        base_tail = hist[:, hist.shape[1] - o1:]                             # [B, o1]

    # ---------------------------------------------------------------- pool (level-major)
    # Pool slot 0 is the root; pool node with id i lives in slot i + 1.
    pool_tok: list[torch.Tensor] = []    # per level [B, n_l] int64
    pool_par: list[torch.Tensor] = []    # per level [B, n_l] parent slot
    pool_score: list[torch.Tensor] = []  # per level [B, n_l] float32
    pool_eff: list[torch.Tensor] = []    # per level [B, n_l] path-min score
    pool_sizes: list[int] = []

    # Level 0: children of the root, no N-gram term.
    s0 = d_inc[:, 0]                                                     # [B, k]
    tok0 = top_i[:, 0]                                                   # [B, k]
    pool_tok.append(tok0)
    pool_par.append(torch.zeros((B, k), dtype=torch.long, device=dev))   # [B, k] parent = root slot
    pool_score.append(s0)
    pool_eff.append(s0)
    pool_sizes.append(k)

    if d > 1:
        nb = min(W, k)
        bidx = torch.sort(s0, dim=1, descending=True, stable=True).indices[:, :nb]  # [B, nb]
        beam_score = s0.gather(1, bidx)                                  # [B, nb]
        beam_eff = beam_score                                            # [B, nb]
        beam_slot = bidx + 1                                             # [B, nb] pool slot
        beam_tok = tok0.gather(1, bidx)                                  # [B, nb]
        if use_ngram:
            beam_tail = _push(base_tail[:, None, :].expand(B, nb, o1), beam_tok, o1)  # [B, nb, o1]
    offset = k  # pool nodes so far

    for lvl in range(1, d):
        cand_tok = top_i[:, lvl]                                           # [B, k]
        inc = d_inc[:, lvl][:, None, :]                                    # [B, 1, k]
        if use_ngram:
            ctx = beam_tail[:, :, None, :].expand(B, nb, k, o1)                  # [B, nb, k, o1]
            ctx = ctx.reshape(B * nb * k, o1)                                     # [B*nb*k, o1]
            toks = cand_tok[:, None, :].expand(B, nb, k).reshape(-1)              # [B*nb*k]
            p_ng = _ngram_prob(ngram, ctx, toks, decoding.ngram_min_count)        # [B*nb*k]
            ng_w = lvl_w[lvl] * decoding.ngram_weight
            inc = inc + ng_w * torch.log(p_ng.to(dev).view(B, nb, k) + eps)      # [B, nb, k]
        child = beam_score[:, :, None] + inc                             # [B, nb, k]
        child_eff = torch.minimum(child, beam_eff[:, :, None])           # [B, nb, k]
        n_l = nb * k
        child = child.reshape(B, n_l)                                    # [B, nb*k]
        child_tok = cand_tok[:, None, :].expand(B, nb, k).reshape(B, n_l)  # [B, nb*k]
        pool_tok.append(child_tok)
        pool_par.append(beam_slot[:, :, None].expand(B, nb, k).reshape(B, n_l))  # [B, nb*k]
        pool_score.append(child)
        pool_eff.append(child_eff.reshape(B, n_l))
        pool_sizes.append(n_l)

        if lvl < d - 1:  # next beams
            nb2 = min(W, n_l)
            ranked = torch.sort(child, dim=1, descending=True, stable=True).indices
            cidx = ranked[:, :nb2]                                       # [B, nb2]
            beam_score = child.gather(1, cidx)                           # [B, nb2]
            beam_eff = pool_eff[-1].gather(1, cidx)                      # [B, nb2]
            beam_slot = cidx + (offset + 1)                              # [B, nb2]
            beam_tok = child_tok.gather(1, cidx)                         # [B, nb2]
            if use_ngram:
                # [B, nb2] index into the old beams
                par_beam = torch.div(cidx, k, rounding_mode="floor")
                par_idx = par_beam[:, :, None].expand(B, nb2, o1)
                par_tail = beam_tail.gather(1, par_idx)                  # [B, nb2, o1]
                beam_tail = _push(par_tail, beam_tok, o1)                # [B, nb2, o1]
            nb = nb2
        offset += n_l

    # ---------------------------------------------------------------- selection
    P = offset
    tok_all = torch.cat(pool_tok, 1)      # [B, P]
    par_all = torch.cat(pool_par, 1)      # [B, P] parent slot (0 = root)
    score_all = torch.cat(pool_score, 1)  # [B, P]
    eff_all = torch.cat(pool_eff, 1)      # [B, P]
    starts = torch.tensor(np.cumsum([0] + pool_sizes[:-1]), dtype=torch.long, device=dev)  # [d]

    n = min(decoding.tree_budget, P)
    sel = _top_desc(eff_all, n)                                          # [B, n] pool ids
    sel_valid = eff_all.gather(1, sel) > _NEG_INF                        # [B, n] (valid ones first)
    n_out = int(sel_valid.sum(1).max())
    sel = sel[:, :n_out]                                                 # [B, N]
    sel_valid = sel_valid[:, :n_out]                                     # [B, N]

    # Output order = priority order: effective score descending, ties by pool id ascending (what
    # _top_desc returns), valid nodes first. A parent always precedes its children, and every prefix
    # of the node list is the best tree of that size -- the engine's adaptive controller truncates
    # trees to their first n nodes.
    sel_lvl = torch.searchsorted(starts, sel, right=True) - 1            # [B, N] level of each node
    # Map pool slots to output positions with one scatter; unselected slots stay -1.
    pos = torch.full((B, 1 + P), -1, dtype=torch.long, device=dev)       # [B, 1+P]
    pos[:, 0] = 0
    out_pos = torch.arange(1, n_out + 1, device=dev).expand(B, n_out)    # [B, N]
    pos.scatter_(1, sel + 1, out_pos)
    parents = pos.gather(1, par_all.gather(1, sel))                      # [B, N]
    if not bool(((parents >= 0) | ~sel_valid).all()):
        raise RuntimeError("internal error: selected draft tree is not prefix-closed")

    tokens = tok_all.gather(1, sel)                                      # [B, N]
    depths = sel_lvl + 1                                                 # [B, N]
    scores = score_all.gather(1, sel)                                    # [B, N]
    zero = torch.zeros_like(tokens)
    one = torch.ones_like(tokens)
    tokens = torch.where(sel_valid, tokens, zero)
    parents = torch.where(sel_valid, parents, zero)
    depths = torch.where(sel_valid, depths, one)
    scores = scores.masked_fill(~sel_valid, _NEG_INF)

    col = torch.ones((B, 1), dtype=torch.bool, device=dev)               # [B, 1]
    tree = TokenTree(
        tokens=torch.cat([roots[:, None], tokens], 1),                   # [B, 1+N]
        parents=torch.cat([torch.full((B, 1), -1, dtype=torch.long, device=dev), parents], 1),
        depths=torch.cat([torch.zeros((B, 1), dtype=torch.long, device=dev), depths], 1),
        valid=torch.cat([col, sel_valid], 1),                            # [B, 1+N]
    )
    out_scores = torch.cat([torch.zeros((B, 1), dtype=torch.float32, device=dev), scores], 1)
    return tree, out_scores


_TOPK_BLOCK = 64


def _topk_last(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(x, k, dim=-1)`` (sorted, descending) for ``x: [B, d, V]``, faster for large V.

    Two-stage exact search: split the vocabulary into blocks of ``_TOPK_BLOCK``, take the k blocks
    with the largest maxima, and run topk over their ``k * block`` entries (plus the ragged tail).
    Every element above the k-th largest value t lies in a block whose max exceeds t (at most k-1
    such blocks), and each other chosen block holds a value == t, so the k values are exact; only
    the choice among exactly tied values may differ from a plain topk (which leaves it unspecified
    too). A NaN makes its block's max NaN, which topk ranks first, so NaNs still surface.
    """
    B, d, V = x.shape
    blk = _TOPK_BLOCK
    nblk = V // blk
    if V < 16 * k * blk:
        return torch.topk(x, k, dim=-1)                                   # [B, d, k]
    v0 = nblk * blk
    xb = x[..., :v0].reshape(B, d, nblk, blk)                              # [B, d, nblk, blk]
    bidx = torch.topk(xb.amax(-1), k, dim=-1).indices                      # [B, d, k] block ids
    cand = torch.gather(xb, 2, bidx[..., None].expand(B, d, k, blk))       # [B, d, k, blk]
    cand = cand.reshape(B, d, k * blk)                                     # [B, d, k*blk]
    if v0 < V:  # ragged tail joins the candidates
        cand = torch.cat([cand, x[..., v0:]], -1)                          # [B, d, k*blk+V-v0]
    vals, j = torch.topk(cand, k, dim=-1)                                  # [B, d, k] candidate pos
    blk_pos = torch.div(j, blk, rounding_mode="floor").clamp_(max=k - 1)   # [B, d, k]
    idx = bidx.gather(2, blk_pos) * blk + j % blk                          # [B, d, k] vocab ids
    if v0 < V:
        idx = torch.where(j >= k * blk, j - k * blk + v0, idx)             # [B, d, k]
    return vals, idx


def _top_desc(x: torch.Tensor, m: int) -> torch.Tensor:
    """Indices of the ``m`` largest entries per row of ``x: [B, P]`` float32 -> ``[B, m]``.

    Ordered by value descending, exact ties broken by LOWER index first (like a stable descending
    sort, but via one ``topk`` on unique int64 keys: the float's order-preserving int32 image in
    the high word, ``P-1-index`` in the low word). ``-0.0`` is treated as ``+0.0``; no NaNs allowed.
    """
    P = x.shape[1]
    bits = (x.float() + 0.0).contiguous().view(torch.int32)               # [B, P]
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).long()      # [B, P] monotone in x
    low = torch.arange(P - 1, -1, -1, device=x.device)                   # [P] = P-1-index
    key = (ordered << 32) | low                                           # [B, P] unique per row
    return torch.topk(key, m, dim=1).indices                              # [B, m]


def _push(tail: torch.Tensor, tok: torch.Tensor, o1: int) -> torch.Tensor:
    """Append ``tok`` ([B, n]) to the context windows ``tail`` ([B, n, o1]), keeping the last o1."""
    if o1 == 0:
        return tail
    return torch.cat([tail[:, :, 1:], tok[:, :, None]], 2)  # [B, n, o1]


def _ngram_prob(ngram: NGramScorer, ctx: torch.Tensor, toks: torch.Tensor,
                min_count: int) -> torch.Tensor:
    """One batched ``ngram.prob`` call; ctx [M, o1], toks [M] -> [M] float32 (CPU), validated."""
    M = toks.shape[0]
    ctx_np = np.ascontiguousarray(ctx.cpu().numpy(), dtype=np.int64)    # [M, o1]
    tok_np = np.ascontiguousarray(toks.cpu().numpy(), dtype=np.int64)   # [M]
    p = np.asarray(ngram.prob(ctx_np, tok_np, min_count), dtype=np.float32)  # [M]
    if p.shape != (M,):
        raise ValueError(f"ngram.prob returned shape {p.shape}, want {(M,)}")
    if not bool(np.all((p >= 0.0) & (p <= 1.0))):
        raise ValueError("ngram.prob returned values outside [0, 1] (or NaN)")
    return torch.from_numpy(p)
