"""Target logits at draft-tree nodes, computed only where the acceptance can use them.

The LM head is the dearest single op of a verify forward (SmolLM2: a 49152 x 576 matmul; on an
AVX2 CPU in fp32, 9 ms at 1 row and 48 ms at 61 rows). Acceptance reads the logits of a node only

* at a node that has children (its distribution decides which child is accepted), and
* at the final accepted node, for the bonus token.

So :meth:`NodeLogits.lazy` computes the head eagerly on the root and every node with a valid child,
and :meth:`NodeLogits.at` computes any other node (an accepted leaf, for its bonus) on demand, in
one call for all rows that need it. Where the batch's trees have no more leaves than rows (chains:
prompt lookup, small adaptive trees) the leaves join the eager call: one more row per row costs
little next to a second call, which re-reads the whole head (~1-2.5 ms for SmolLM2 in bf16 on 2
cores, ~9 ms in fp32 on AVX2) whenever a chain is accepted to its end. Small trees fill the
eager call up to :data:`EAGER_HEAD_ROWS` rows with their best leaves for the same reason. Outputs
are those of the dense head: the same rows go through the same head (tests check greedy and
sampled tokens against dense logits in fp32; in bf16 a row's rounding depends on which rows share
its head call, so near-ties may fall either way).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dart_ray.tree.tree import TokenTree

EAGER_HEAD_ROWS = 6
"""Total rows (internal nodes + leaves, over the batch) the eager head call may reach by adding
leaves, best first; past it only internal nodes (and chains' leaves) are eager. One LM-head
call costs about the same at 1 to 6 rows (its weight read dominates; SmolLM2 bf16 on 2 Zen 4
cores: ~2.3 ms, then ~0.15 ms per row more), and an accepted leaf left out costs a second call for
its bonus token: DART trees at bs 1 accept a leaf on 42-55 % of steps, most often their first.
Same-process A/B on that machine (``scripts/ab_model.py const``, 24 prompts, 0 = the rule
before):
acceptance 1.86 -> 1.33 ms per step on HumanEval and 1.70 -> 1.21 on the chat set, the verify
forward up to 0.5 ms dearer for the extra rows; net within 1 % (101.5 -> 101.7 and 68.9 -> 69.6
tok/s)."""


def internal_nodes(tree: TokenTree) -> torch.Tensor:
    """[B, T] bool: the root and every node that is the parent of a valid node."""
    B, T = tree.tokens.shape
    children = torch.zeros(B, T, dtype=torch.long, device=tree.tokens.device)
    if T > 1:
        valid = tree.valid[:, 1:]                                         # [B, T-1]
        par = torch.where(valid, tree.parents[:, 1:].clamp(min=0), 0)     # [B, T-1] padding -> root
        children.scatter_add_(1, par, valid.long())                       # duplicates add up
    has_child = children > 0
    has_child[:, 0] = True
    return has_child


class NodeLogits:
    """Logits ``[V]`` per (row, node) of a ``[B, T]`` tree batch: dense, or computed on demand."""

    def __init__(self, shape: tuple[int, int], dense: torch.Tensor | None = None,
                 hidden: torch.Tensor | None = None,
                 head: Callable[[torch.Tensor], torch.Tensor] | None = None
                 ) -> None:
        self.shape = shape
        self._dense = dense                   # [B, T, V] or None
        self._hidden = hidden                 # [B, T, H] final residual (pre-norm) or None
        self._head = head                     # [n, H] -> [n, V]
        # [B, T] int64: the row of _cat holding (b, i); -1 = not computed
        self._slot: torch.Tensor | None = None
        self._cat: torch.Tensor | None = None  # [n, V] the logits computed so far
        self._count = [0]                     # LM-head rows computed (shared with row selections)
        if dense is not None:
            if tuple(dense.shape[:2]) != tuple(shape):
                raise ValueError(f"logits shape {tuple(dense.shape)} does not match tree {shape}")
            self._count[0] = shape[0] * shape[1]
        elif hidden is None or head is None:
            raise ValueError("NodeLogits needs dense logits, or hidden states and a head")
        else:
            self._slot = torch.full(shape, -1, dtype=torch.long, device=hidden.device)

    @classmethod
    def of(cls, logits: torch.Tensor | NodeLogits) -> NodeLogits:
        """Wrap a dense ``[B, T, V]`` tensor (tests, prefill); pass a NodeLogits through."""
        if isinstance(logits, NodeLogits):
            return logits
        return cls((int(logits.shape[0]), int(logits.shape[1])), dense=logits)

    @classmethod
    def lazy(cls, tree: TokenTree, hidden: torch.Tensor,
             head: Callable[[torch.Tensor], torch.Tensor]
             ) -> NodeLogits:
        """Head eagerly on the root and internal nodes of ``tree``, and on leaves: all of them when
        there are at most as many as rows (chains) or they fit :data:`EAGER_HEAD_ROWS`, else the
        best ones up to it; other nodes on demand."""
        out = cls(tuple(tree.tokens.shape), hidden=hidden, head=head)
        B = tree.batch_size
        eager = internal_nodes(tree)                                         # [B, T]
        leaves = tree.valid & ~eager                                         # [B, T]
        n_leaves, n_eager = torch.stack([leaves.sum(), eager.sum()]).tolist()   # one host sync
        room = EAGER_HEAD_ROWS - n_eager
        if n_leaves <= max(B, room):
            eager = eager | leaves
        elif room > 0:
            # the best leaves first: nodes are in priority order, so a row's first leaf is the
            # one most often accepted (with DART's lookup paths leading: the first path's tip);
            # round-robin over the rows by leaf rank
            rank = leaves.long().cumsum(1)                                   # [B, T] 1-based
            row = torch.arange(B, device=rank.device)[:, None]               # [B, 1]
            key = torch.where(leaves, rank * B + row, torch.iinfo(torch.long).max)   # [B, T]
            pick = key.flatten().topk(room, largest=False).indices           # [room]
            eager = eager.flatten().index_fill(0, pick, True).view(B, -1)
        rows, nodes = eager.nonzero(as_tuple=True)
        out.at(rows, nodes)
        return out

    @property
    def head_rows(self) -> int:
        """Rows the LM head has run on so far (dense: B * T)."""
        return self._count[0]

    @property
    def device(self) -> torch.device:
        return (self._dense if self._dense is not None else self._hidden).device

    def at(self, rows: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
        """Logits at ``(rows[j], nodes[j])`` -> ``[n, V]``; missing ones computed in one head
        call."""
        if self._dense is not None:
            return self._dense[rows, nodes]
        slot = self._slot[rows, nodes]                                          # [n]
        missing = slot < 0
        if bool(missing.any()):
            mr, mn = rows[missing], nodes[missing]
            key = mr * self.shape[1] + mn                                      # dedupe (b, i) pairs
            uniq, inv = torch.unique(key, return_inverse=True)
            ur, un = uniq // self.shape[1], uniq % self.shape[1]
            new = self._head(self._hidden[ur, un])                              # [u, V]
            base = self._cat.shape[0] if self._cat is not None else 0
            self._slot[ur, un] = base + torch.arange(new.shape[0], device=new.device)
            self._cat = new if self._cat is None else torch.cat([self._cat, new])
            self._count[0] += int(new.shape[0])
            slot = self._slot[rows, nodes]
        return self._cat[slot]

    def select_rows(self, idx: torch.Tensor) -> NodeLogits:
        """The rows ``idx`` ([n] int64) as their own NodeLogits (sharing computed values)."""
        if self._dense is not None:
            return NodeLogits.of(self._dense.index_select(0, idx))
        sub = NodeLogits((int(idx.shape[0]), self.shape[1]),
                         hidden=self._hidden.index_select(0, idx), head=self._head)
        sub._slot = self._slot.index_select(0, idx)
        sub._cat = self._cat
        sub._count = self._count
        return sub
