"""The draft vocabulary: which target tokens a drafter's own head can predict.

A drafter with a reduced vocabulary (``d2t`` [Vd]: draft id -> target id) can never draft a token
outside it, so its coverage of what the target writes caps every level's accuracy.
:func:`choose_draft_vocab` takes the most frequent tokens of the data's *answers* (what the drafter
drafts when serving; prompt tokens are only read). :func:`revocab_head` moves a trained drafter to
another vocabulary (``train-drafter --revocab``): rows of tokens both share keep their trained
weights; a new token's row starts from the target's head row of that token mapped by the one linear
map that best takes the target's rows to the trained ones on the shared tokens (least squares), so
it starts where the trained head would put a token like it rather than at zero.
"""

from __future__ import annotations

import torch

__all__ = ["choose_draft_vocab", "coverage", "revocab_head", "target_to_draft"]


def choose_draft_vocab(seqs: list[tuple[list[int], int]], size: int, vocab: int,
                       keep: torch.Tensor | None = None) -> torch.Tensor:
    """The ``size`` most frequent tokens of the answers (``ids[plen:]`` of each ``(ids, plen)``),
    sorted ascending [size]. Ties (and unused slots) go to the lower token id. With ``keep`` (token
    ids, at most ``size``): every one of them, the rest of the slots filled that way."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for ids, plen in seqs:
        if len(ids) > plen:
            counts += torch.bincount(torch.tensor(ids[plen:]), minlength=vocab)
    if keep is not None:
        if len(keep) > size:
            raise ValueError(f"cannot keep {len(keep)} tokens in a draft vocabulary of {size}")
        counts[keep.long()] = torch.iinfo(torch.long).max                # ranked before any count
    order = torch.sort(counts, descending=True, stable=True).indices
    return order[:min(size, vocab)].sort().values


def target_to_draft(d2t: torch.Tensor, vocab: int) -> torch.Tensor:
    """The inverse map of ``d2t``: [vocab] draft id of each target token, -1 outside it."""
    t2d = torch.full((vocab,), -1, dtype=torch.long, device=d2t.device)
    t2d[d2t] = torch.arange(len(d2t), device=d2t.device)
    return t2d


def coverage(seqs: list[tuple[list[int], int]], d2t: torch.Tensor, vocab: int) -> float:
    """Fraction of the answer tokens of ``seqs`` inside the draft vocabulary ``d2t``."""
    inside = target_to_draft(d2t.cpu(), vocab) >= 0
    n = hit = 0
    for ids, plen in seqs:
        ans = torch.tensor(ids[plen:], dtype=torch.long)
        n += len(ans)
        hit += int(inside[ans].sum())
    return hit / max(n, 1)


def revocab_head(head: torch.Tensor, old_d2t: torch.Tensor, new_d2t: torch.Tensor,
                 target_head: torch.Tensor, ridge: float = 1e-4) -> torch.Tensor:
    """A trained head [Vd_old, H] over ``old_d2t`` as a head [Vd_new, H] over ``new_d2t``.

    Shared tokens keep their rows. The rest are ``target_head[tok] @ A`` with A [H, H] the ridge
    least-squares fit of ``target_head[old_d2t] @ A ~= head``.
    """
    head, target_head = head.float().cpu(), target_head.float().cpu()
    old_d2t, new_d2t = old_d2t.long().cpu(), new_d2t.long().cpu()
    X = target_head[old_d2t]                                                      # [Vd_old, H]
    H = X.shape[1]
    A = torch.linalg.solve(X.t() @ X + ridge * len(X) * torch.eye(H), X.t() @ head)  # [H, H]
    out = target_head[new_d2t] @ A                                                # [Vd_new, H]
    pos = target_to_draft(old_d2t, len(target_head))[new_d2t]                     # [Vd_new]
    shared = pos >= 0
    out[shared] = head[pos[shared]]
    return out
