"""N-gram-pruned beam search that turns one DART drafter forward into a draft tree.

Inputs per sequence ``b``: the root token (already chosen by the target), the drafter's ``d``
per-level logits (level ``l`` predicts the token ``l + 1`` positions after the root; all levels come
from ONE forward, so the level-``l`` distribution is the same for every path), the last committed
tokens (N-gram context) and optionally an N-gram scorer.

Algorithm (vectorised over the batch, the beams and the candidates; the only Python loop is over
the ``d`` levels):

1. ``d = min(decoding.draft_depth, draft_logits.shape[1])`` (the draft depth used),
   ``k = min(decoding.top_k, V)``. One ``topk`` over the vocabulary for all levels, on the
   logits' device: ``[B, d, V] -> [B, d, k]`` (an exact two-stage block-max topk for large V, see
   :func:`topk_last`), or the caller's own candidates (:func:`build_trees_from_candidates`: a
   drafter with a reduced draft vocabulary takes its top-k there and maps the ids). Everything
   after is a few thousand pool nodes, searched on host numpy arrays (per op, numpy's dispatch
   costs a fraction of torch's; measured on the AMX Xeon, bs 1 with the shipped N-gram model:
   3.2 -> 2.0 ms per tree). ``p_draft`` is the softmax over those ``k`` logits (renormalised). A
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
from dart_ray.tree.tree import TokenTree, empty_tree

__all__ = ["NGramScorer", "build_trees", "build_trees_from_candidates", "build_trees_with_scores",
           "topk_last"]



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
    _check_decoding(decoding)
    if draft_logits.dim() != 3:
        raise ValueError(f"draft_logits must be [B, d, V], got shape {tuple(draft_logits.shape)}")
    if not draft_logits.is_floating_point():
        raise ValueError(f"draft_logits must be floating point, got {draft_logits.dtype}")
    B, D, V = draft_logits.shape
    if D < 1 or V < 1:
        raise ValueError(f"draft_logits needs >= 1 level and >= 1 vocab entry, got {(B, D, V)}")
    d = min(decoding.draft_depth, D)
    top_v, top_i = topk_last(draft_logits[:, :d], min(decoding.top_k, V))   # [B, d, k] each
    return build_trees_from_candidates(roots, top_v, top_i, decoding, context=context, ngram=ngram)


def build_trees_from_candidates(
    roots: torch.Tensor,
    cand_logits: torch.Tensor,
    cand_ids: torch.Tensor,
    decoding: DecodingConfig,
    context: torch.Tensor | None = None,
    ngram: NGramScorer | None = None,
) -> tuple[TokenTree, torch.Tensor]:
    """:func:`build_trees_with_scores` from each level's top-k candidates, taken by the caller.

    A drafter with a reduced draft vocabulary takes ``topk`` over its own ``Vd`` logits and maps the
    ids to the target's (``d2t``) instead of scattering ``[B, d, Vd]`` into ``[B, d, V]`` first:
    the same candidates, a fraction of the work.

    Args:
        cand_logits: ``[B, d, k]`` float logits of each level's candidates, sorted descending along
            ``k`` (``-inf`` = no candidate); the candidate probabilities are their softmax over
            ``k``. Only the first ``min(decoding.draft_depth, d)`` levels are used.
        cand_ids: ``[B, d, k]`` int64 target token ids of those candidates (distinct per level).
        Others as in :func:`build_trees_with_scores`.
    """
    # ---------------------------------------------------------------- validation
    _check_decoding(decoding)
    if cand_logits.dim() != 3 or cand_ids.shape != cand_logits.shape:
        raise ValueError("cand_logits and cand_ids must both be [B, d, k], got shapes "
                         f"{tuple(cand_logits.shape)} and {tuple(cand_ids.shape)}")
    if not cand_logits.is_floating_point():
        raise ValueError(f"cand_logits must be floating point, got {cand_logits.dtype}")
    B, D, k = cand_logits.shape
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

    dev = cand_logits.device
    if B == 0 or D == 0 or k == 0:
        tree = empty_tree(roots.to(device=dev, dtype=torch.long))
        return tree, torch.zeros((B, 1), dtype=torch.float32, device=dev)
    d = min(decoding.draft_depth, D)
    # The search itself runs on host numpy arrays: at these sizes (a few thousand pool nodes) each
    # torch op costs more in dispatch than in work, numpy's a fraction of that. One copy in
    # ([B, d, k] candidates), one out (the tree), whatever the device.
    top_v = cand_logits[:, :d].float().cpu().numpy()                          # [B, d, k]
    top_i = cand_ids[:, :d].to(torch.long).cpu().numpy()                      # [B, d, k]
    if bool((np.isnan(top_v) | np.isposinf(top_v)).any()):
        raise ValueError("draft_logits contain NaN or +inf")
    roots_np = roots.to(torch.long).cpu().numpy()                             # [B]
    tail = None
    if use_ngram:
        hist = roots_np[:, None]                                              # [B, 1]
        if context is not None:
            hist = np.concatenate([context.to(torch.long).cpu().numpy(), hist], 1)  # [B, c+1]
        if hist.shape[1] < o1:
            hist = np.concatenate([np.full((B, o1 - hist.shape[1]), -1, np.int64), hist], 1)
        tail = hist[:, hist.shape[1] - o1:]                                   # [B, o1]
    tokens, parents, depths, valid, scores = _beam_search(top_v, top_i, decoding, ngram
                                                          if use_ngram else None, tail, o1)
    cols = [np.concatenate([roots_np[:, None], tokens], 1),                   # [B, 1+N]
            np.concatenate([np.full((B, 1), -1, np.int64), parents], 1),
            np.concatenate([np.zeros((B, 1), np.int64), depths], 1)]
    tree = TokenTree(*(torch.from_numpy(c).to(dev) for c in cols),
                     valid=torch.from_numpy(np.concatenate([np.ones((B, 1), bool), valid], 1))
                     .to(dev))
    out_scores = torch.from_numpy(np.concatenate([np.zeros((B, 1), np.float32), scores], 1))
    return tree, out_scores.to(dev)


def _check_decoding(decoding) -> None:
    if not isinstance(decoding, DecodingConfig):
        raise TypeError(f"decoding must be a DecodingConfig, got {type(decoding).__name__}")


def _stable_desc(x: np.ndarray) -> np.ndarray:
    """Indices sorting each row of ``x`` ([B, n] float32, no NaN) by value descending, exact ties
    by lower index first (-0.0 ties +0.0)."""
    return np.argsort(-x, axis=1, kind="stable")


def _beam_search(top_v: np.ndarray, top_i: np.ndarray, decoding: DecodingConfig,
                 ngram: NGramScorer | None, tail: np.ndarray | None, o1: int):
    """The beam search and selection of the module docstring on host arrays.

    ``top_v``/``top_i`` [B, d, k] candidates (sorted descending), ``tail`` [B, o1] the N-gram
    context after the root (None without an N-gram term). Returns the draft nodes in priority
    order, padded: tokens, parents (0 = root), depths, valid [B, N] and scores [B, N] float32.
    """
    B, d, k = top_v.shape
    W, eps = decoding.beam_width, decoding.eps
    lvl_w = [(lvl + 1) ** (-decoding.level_weight_exp) for lvl in range(d)]    # (l+1)^-a
    draft_w = np.array([lvl_w[lvl] * decoding.logit_weight_base ** lvl for lvl in range(d)],
                       dtype=np.float32)                                      # [d]
    finite = top_v > -np.inf                                                  # [B, d, k]
    # softmax over the k candidates (a level with no candidate: all zero)
    vmax = np.where(finite.any(-1, keepdims=True), top_v.max(-1, keepdims=True), 0.0)
    e = np.where(finite, np.exp(top_v - vmax), 0.0)                           # [B, d, k]
    tot = e.sum(-1, keepdims=True)
    p_draft = (e / np.where(tot > 0, tot, 1.0)).astype(np.float32)            # [B, d, k]
    with np.errstate(divide="ignore"):
        d_inc = np.log(p_draft + np.float32(eps)) * draft_w[None, :, None]   # [B, d, k]
    d_inc[~finite] = -np.inf

    rows = np.arange(B)[:, None]                                              # [B, 1]
    # Pool (level-major). Slot 0 is the root; pool node i lives in slot i + 1.
    s0 = d_inc[:, 0]                                                          # [B, k]
    pool_tok, pool_par, pool_score, pool_eff = [top_i[:, 0]], [np.zeros((B, k), np.int64)], \
        [s0], [s0]
    pool_sizes = [k]
    if d > 1:
        nb = min(W, k)
        bidx = _stable_desc(s0)[:, :nb]                                       # [B, nb]
        beam_score = beam_eff = s0[rows, bidx]                                # [B, nb]
        beam_slot = bidx + 1                                                  # [B, nb] pool slot
        if ngram is not None:
            beam_tail = _push(np.broadcast_to(tail[:, None, :], (B, nb, o1)),
                              top_i[:, 0][rows, bidx], o1)                    # [B, nb, o1]
    offset = k
    budget = decoding.tree_budget
    for lvl in range(1, d):
        # Early exit, exact: every deeper node descends from a beam, so its effective (path-min)
        # score is <= its beam's; once no beam beats the budget-th best node pooled so far, no
        # deeper node can be selected (a tie loses too: ties go to the lower pool id). Small trees
        # (the adaptive controller's usual pick) skip the deep levels and their N-gram lookups.
        if offset >= budget:
            pooled = np.concatenate(pool_eff, 1)                              # [B, offset]
            nth = np.partition(pooled, offset - budget, axis=1)[:, offset - budget]  # [B]
            if bool((np.isfinite(nth) & (beam_eff.max(1) <= nth)).all()):
                break
        cand_tok = top_i[:, lvl]                                              # [B, k]
        inc = d_inc[:, lvl][:, None, :]                                       # [B, 1, k]
        if ngram is not None:
            ctx = np.broadcast_to(beam_tail[:, :, None, :], (B, nb, k, o1)).reshape(B * nb * k, o1)
            toks = np.broadcast_to(cand_tok[:, None, :], (B, nb, k)).reshape(-1)   # [B*nb*k]
            p_ng = _ngram_prob(ngram, ctx, toks, decoding.ngram_min_count)    # [B*nb*k]
            ng_w = np.float32(lvl_w[lvl] * decoding.ngram_weight)
            inc = inc + ng_w * np.log(p_ng.reshape(B, nb, k) + np.float32(eps))   # [B, nb, k]
        child = beam_score[:, :, None] + inc                                  # [B, nb, k]
        n_l = nb * k
        child_eff = np.minimum(child, beam_eff[:, :, None]).reshape(B, n_l)   # [B, nb*k]
        child = child.reshape(B, n_l)                                         # [B, nb*k]
        child_tok = np.broadcast_to(cand_tok[:, None, :], (B, nb, k)).reshape(B, n_l)
        pool_tok.append(child_tok)
        pool_par.append(np.repeat(beam_slot, k, axis=1))                      # [B, nb*k]
        pool_score.append(child)
        pool_eff.append(child_eff)
        pool_sizes.append(n_l)
        if lvl < d - 1:  # next beams
            nb2 = min(W, n_l)
            cidx = _stable_desc(child)[:, :nb2]                               # [B, nb2]
            beam_score, beam_eff = child[rows, cidx], child_eff[rows, cidx]   # [B, nb2]
            beam_slot = cidx + (offset + 1)                                   # [B, nb2]
            if ngram is not None:
                par_tail = beam_tail[rows, cidx // k]                         # [B, nb2, o1]
                beam_tail = _push(par_tail, child_tok[rows, cidx], o1)        # [B, nb2, o1]
            nb = nb2
        offset += n_l

    # ---------------------------------------------------------------- selection
    P = offset
    tok_all = np.concatenate(pool_tok, 1)                                     # [B, P]
    par_all = np.concatenate(pool_par, 1)                                     # [B, P] parent slot
    score_all = np.concatenate(pool_score, 1).astype(np.float32)              # [B, P]
    eff_all = np.concatenate(pool_eff, 1).astype(np.float32)                  # [B, P]
    starts = np.cumsum([0] + pool_sizes[:-1])                                 # [d]
    n = min(decoding.tree_budget, P)
    sel = _stable_desc(eff_all)[:, :n]                                        # [B, n] pool ids
    sel_valid = eff_all[rows, sel] > -np.inf                                  # [B, n]
    n_out = int(sel_valid.sum(1).max())
    sel, sel_valid = sel[:, :n_out], sel_valid[:, :n_out]                     # [B, N]
    # Output order = priority order: effective score descending, ties by pool id ascending, valid
    # nodes first. A parent always precedes its children, and every prefix of the node list is the
    # best tree of that size -- the adaptive controller truncates trees to their first n nodes.
    pos = np.full((B, 1 + P), -1, np.int64)                                   # [B, 1+P]
    pos[:, 0] = 0
    pos[rows, sel + 1] = np.arange(1, n_out + 1)[None, :]
    parents = pos[rows, par_all[rows, sel]]                                   # [B, N]
    if not bool(((parents >= 0) | ~sel_valid).all()):
        raise RuntimeError("internal error: selected draft tree is not prefix-closed")
    depths = np.searchsorted(starts, sel, side="right")                       # [B, N] level + 1
    tokens = np.where(sel_valid, tok_all[rows, sel], 0)
    parents = np.where(sel_valid, parents, 0)
    depths = np.where(sel_valid, depths, 1).astype(np.int64)
    scores = np.where(sel_valid, score_all[rows, sel], -np.inf).astype(np.float32)
    return tokens.astype(np.int64), parents, depths, sel_valid, scores


_TOPK_BLOCK = 64


def topk_last(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
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


def _push(tail: np.ndarray, tok: np.ndarray, o1: int) -> np.ndarray:
    """Append ``tok`` ([B, n]) to the context windows ``tail`` ([B, n, o1]), keeping the last o1."""
    if o1 == 0:
        return tail
    return np.concatenate([tail[:, :, 1:], tok[:, :, None]], 2)  # [B, n, o1]


def _ngram_prob(ngram: NGramScorer, ctx: np.ndarray, toks: np.ndarray,
                min_count: int) -> np.ndarray:
    """One batched ``ngram.prob`` call; ctx [M, o1], toks [M] -> [M] float32, validated."""
    M = toks.shape[0]
    ctx_np = np.ascontiguousarray(ctx, dtype=np.int64)                  # [M, o1]
    tok_np = np.ascontiguousarray(toks, dtype=np.int64)                 # [M]
    p = np.asarray(ngram.prob(ctx_np, tok_np, min_count), dtype=np.float32)  # [M]
    if p.shape != (M,):
        raise ValueError(f"ngram.prob returned shape {p.shape}, want {(M,)}")
    if not bool(np.all((p >= 0.0) & (p <= 1.0))):
        raise ValueError("ngram.prob returned values outside [0, 1] (or NaN)")
    return p
