"""Additive attention masks for the explicit-mask forward.

A forward over T new tokens per row writes them at cache slots ``start[b] .. start[b]+T-1``
(``start`` = the row's committed length). Query t of row b may see:

* every committed slot ``s < start[b]``, and
* new slot ``start[b] + j`` iff ``anc[b, t, j]`` (j is t itself or one of its tree ancestors;
  for a plain causal chunk, ``anc`` is lower-triangular).

The result is ``[B, 1, T, S]`` with 0 where visible and ``-inf`` elsewhere (an additive float mask;
boolean masks are easy to get silently wrong with SDPA backends).
"""

from __future__ import annotations

import torch


def causal_ancestors(T: int, device=None) -> torch.Tensor:
    """[T, T] bool lower-triangular (a chain is a tree in which everyone is an ancestor)."""
    return torch.ones(T, T, dtype=torch.bool, device=device).tril()


def attention_mask(starts: list[int], anc: torch.Tensor, s_used: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """starts: per-row committed lengths; anc: [B, T, T] or [T, T] bool -> [B, 1, T, S] additive."""
    dev = anc.device
    B = len(starts)
    T = anc.shape[-1]
    if anc.dim() == 2:
        anc = anc.expand(B, T, T)
    start = torch.tensor(starts, device=dev).view(B, 1, 1)     # [B, 1, 1]
    slot = torch.arange(s_used, device=dev).view(1, 1, s_used)      # [1, 1, S]
    rel = slot - start                                         # [B, 1, S] offset into the new block
    in_new = (rel >= 0) & (rel < T)                            # [B, 1, S]
    visible_new = torch.gather(anc, 2, rel.clamp(0, T - 1).expand(B, T, s_used))  # [B, T, S]
    visible = (rel < 0) | (in_new & visible_new)                   # [B, T, S]
    mask = torch.zeros(B, 1, T, s_used, dtype=dtype, device=dev)
    return mask.masked_fill_(~visible.unsqueeze(1), float("-inf"))
