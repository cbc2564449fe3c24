"""A batch of token trees (one per sequence), padded to a common node count.

Indexing: node 0 of every tree is the **root** (the token already chosen by the target, not yet
in the KV cache); draft nodes are 1..N. Nodes are topologically ordered: ``parents[b, i] < i``
for every valid draft node, so the depth-i node of any path has index >= i. Invalid (padding)
nodes have ``valid = False``, parent 0 and depth 1; they are never accepted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class TokenTree:
    tokens: torch.Tensor   # [B, 1+N] int64; column 0 = root token
    parents: torch.Tensor  # [B, 1+N] int64; parents[:, 0] = -1 (root has none)
    depths: torch.Tensor   # [B, 1+N] int64; root depth 0
    valid: torch.Tensor    # [B, 1+N] bool; root always valid
    draft_probs: torch.Tensor | None = None
    """[B, 1+N, V] float32, only for drafters that *sample* their drafts (SpS): the draft
    distribution q that node i's token was drawn from (row 0 unused). With it, sampled rows use the
    standard p/q rejection rule (chains only); without it drafts are treated as deterministic."""

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_nodes(self) -> int:
        """Nodes per tree including the root (padded count)."""
        return self.tokens.shape[1]

    def ancestors(self) -> torch.Tensor:
        """[B, 1+N, 1+N] bool: ``anc[b, i, j]`` iff j is i or an ancestor of i."""
        return ancestor_mask(self.parents, self.depths)

    def to(self, device: torch.device | str) -> TokenTree:
        q = None if self.draft_probs is None else self.draft_probs.to(device)
        return TokenTree(*(t.to(device) for t in (self.tokens, self.parents, self.depths,
                                                  self.valid)), q)

    def truncate(self, n: int) -> TokenTree:
        """The trees cut to their first ``n`` draft nodes (and the columns no row uses dropped).

        Drafters emit nodes in priority order with parents first, so the cut is prefix-closed and is
        the best ``n``-node tree the drafter would have built (``dart_ray.engine.controller``)."""
        n_cols = min(1 + max(n, 0), self.num_nodes)
        used = self.valid[:, :n_cols].any(0).nonzero()
        n_cols = int(used.max()) + 1 if used.numel() else 1
        if n_cols == self.num_nodes:
            return self
        q = None if self.draft_probs is None else self.draft_probs[:, :n_cols]
        return TokenTree(self.tokens[:, :n_cols], self.parents[:, :n_cols], self.depths[:, :n_cols],
                         self.valid[:, :n_cols], q)

    def select_rows(self, idx: torch.Tensor) -> TokenTree:
        """The trees of rows ``idx`` ([n] int64)."""
        q = None if self.draft_probs is None else self.draft_probs.index_select(0, idx)
        cols = (self.tokens, self.parents, self.depths, self.valid)
        return TokenTree(*(t.index_select(0, idx) for t in cols), q)

    def validate(self) -> None:
        """Raise ValueError if the structural invariants do not hold (used in tests)."""
        B, T = self.tokens.shape
        for name in ("parents", "depths", "valid"):
            if getattr(self, name).shape != (B, T):
                raise ValueError(f"{name} has shape {tuple(getattr(self, name).shape)}, want "
                                 f"{(B, T)}")
        if not bool(self.valid[:, 0].all()) or not bool((self.parents[:, 0] == -1).all()):
            raise ValueError("node 0 must be a valid root with parent -1")
        if T > 1:
            idx = torch.arange(1, T)
            par = self.parents[:, 1:]
            if not bool(((par >= 0) & (par < idx)).all()):
                raise ValueError("parents must precede children (topological order)")
            pd = torch.gather(self.depths, 1, par)
            v = self.valid[:, 1:]
            if not bool((self.depths[:, 1:][v] == pd[v] + 1).all()):
                raise ValueError("depth of a node must be its parent's depth + 1")
            pv = torch.gather(self.valid, 1, par)
            if not bool(pv[v].all()):
                raise ValueError("a valid node has an invalid parent (tree not prefix-closed)")


def ancestor_mask(parents: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
    """[B, T] parents -> [B, T, T] bool, ``anc[b, i, j]`` iff j == i or j is an ancestor of i.

    Vectorised by pointer jumping: ``max depth`` gathers, no Python loop over nodes.
    """
    B, T = parents.shape
    anc = torch.eye(T, dtype=torch.bool, device=parents.device).expand(B, T, T).clone()
    cur = parents.clamp(min=0)  # [B, T] current ancestor pointer
    alive = parents >= 0        # [B, T]
    max_depth = int(depths.max()) if depths.numel() else 0
    rows = torch.arange(B, device=parents.device)[:, None]
    cols = torch.arange(T, device=parents.device)[None, :]
    for _ in range(max_depth):
        anc[rows.expand(B, T)[alive], cols.expand(B, T)[alive], cur[alive]] = True
        nxt = torch.gather(parents, 1, cur)
        alive = alive & (nxt >= 0)
        cur = nxt.clamp(min=0)
    return anc


def empty_tree(roots: torch.Tensor) -> TokenTree:
    """Root-only trees (plain autoregressive step). roots: [B] int64."""
    B = roots.shape[0]
    dev = roots.device
    return TokenTree(
        tokens=roots.view(B, 1).long(),
        parents=torch.full((B, 1), -1, dtype=torch.long, device=dev),
        depths=torch.zeros((B, 1), dtype=torch.long, device=dev),
        valid=torch.ones((B, 1), dtype=torch.bool, device=dev),
    )


def chain_tree(roots: torch.Tensor, chains: torch.Tensor,
               lengths: torch.Tensor | None = None) -> TokenTree:
    """Trees that are single chains: root -> chains[b, 0] -> chains[b, 1] -> ...

    roots: [B]; chains: [B, K]; lengths: [B] valid chain length per row (default K).
    """
    B, K = chains.shape
    dev = chains.device
    idx = torch.arange(K + 1, device=dev)
    parents = (idx - 1).expand(B, K + 1).clone()
    depths = idx.expand(B, K + 1).clone()
    if lengths is None:
        valid = torch.ones((B, K + 1), dtype=torch.bool, device=dev)
    else:
        valid = idx[None, :] <= lengths.to(dev)[:, None]
    tokens = torch.cat([roots.view(B, 1).long(), chains.long()], dim=1)
    # padding nodes: parent root, depth 1 (never accepted, harmless in the mask)
    parents = torch.where(valid, parents, torch.zeros_like(parents))
    parents[:, 0] = -1
    depths = torch.where(valid, depths, torch.ones_like(depths))
    depths[:, 0] = 0
    tokens = torch.where(valid, tokens, torch.zeros_like(tokens))
    return TokenTree(tokens=tokens, parents=parents, depths=depths, valid=valid)


def pack_trees(roots: torch.Tensor, trees: list[tuple[list[int], list[int]]]) -> TokenTree:
    """Pack per-row trees given as (tokens, parents) lists of draft nodes into a TokenTree.

    For row b, ``tokens[i]`` is draft node i+1 and ``parents[i]`` its parent's node index
    (0 = root); parents must precede children.
    """
    B = len(trees)
    N = max((len(t) for t, _ in trees), default=0)
    tokens = torch.zeros(B, 1 + N, dtype=torch.long)
    parents = torch.zeros(B, 1 + N, dtype=torch.long)
    depths = torch.ones(B, 1 + N, dtype=torch.long)
    valid = torch.zeros(B, 1 + N, dtype=torch.bool)
    tokens[:, 0] = roots.cpu()
    parents[:, 0] = -1
    depths[:, 0] = 0
    valid[:, 0] = True
    for b, (toks, pars) in enumerate(trees):
        n = len(toks)
        if n == 0:
            continue
        tokens[b, 1:1 + n] = torch.tensor(toks, dtype=torch.long)
        parents[b, 1:1 + n] = torch.tensor(pars, dtype=torch.long)
        valid[b, 1:1 + n] = True
        d = [0]
        for p in pars:
            d.append(d[p] + 1)
        depths[b, 1:1 + n] = torch.tensor(d[1:], dtype=torch.long)
    return TokenTree(tokens, parents, depths, valid).to(roots.device)


class Trie:
    """Draft nodes of one tree built from (parent, token) pairs; a pair already present is shared.

    Node 0 is the root; draft nodes are numbered 1.. in insertion order, so parents precede
    children (the order :func:`pack_trees` takes). ``budget`` caps the draft nodes (None: no cap).
    """

    def __init__(self, budget: int | None = None) -> None:
        self.tokens: list[int] = []     # tokens[i - 1] = token of node i
        self.parents: list[int] = []    # parents[i - 1] = parent node of node i
        self.budget = budget
        self._node: dict[tuple[int, int], int] = {}

    def add(self, parent: int, token: int) -> int | None:
        """The node of ``token`` under ``parent``, added if new; None if it is new and the budget is
        spent."""
        node = self._node.get((parent, token))
        if node is None:
            if self.budget is not None and len(self.tokens) >= self.budget:
                return None
            self.tokens.append(token)
            self.parents.append(parent)
            node = self._node[(parent, token)] = len(self.tokens)
        return node

    @classmethod
    def of(cls, paths: Sequence[Sequence[int]], budget: int | None = None) -> Trie:
        """The trie of token paths below the root, in order (shared prefixes become one path)."""
        trie = cls(budget)
        for path in paths:
            trie.add_path(path)
        return trie

    def add_path(self, path: Sequence[int]) -> None:
        """Add a token path below the root (cut where the budget runs out)."""
        node: int | None = 0
        for token in path:
            node = self.add(node, token)
            if node is None:
                return


def trie_from_paths(paths: Sequence[Sequence[int]],
                    budget: int | None = None) -> tuple[list[int], list[int]]:
    """Merge token paths into one trie -> (tokens, parents) of its draft nodes (``pack_trees``
    rows)."""
    trie = Trie.of(paths, budget)
    return trie.tokens, trie.parents


def merge_paths(tree: TokenTree, paths: list[list[list[int]]]) -> TokenTree:
    """Add token paths (each starting below the root) to every row's tree, sharing nodes:
    :func:`merge_tries` of each row's ``Trie.of(paths[b])``."""
    if len(paths) != tree.batch_size:
        raise ValueError(f"merge_paths: {len(paths)} path lists for {tree.batch_size} rows")
    return merge_tries(tree, [Trie.of(p) for p in paths])


def merge_tries(tree: TokenTree, tries: list[Trie]) -> TokenTree:
    """Every row's trie (of token paths below the root) followed by that row's tree nodes.

    The trie's nodes come FIRST in the merged node list (prompt-lookup paths: copies of earlier
    text, accepted in long runs where they match, so they lead the priority order the adaptive
    controller truncates by), then the tree's own valid nodes in their order; a node whose
    (parent, token) already exists is shared, not repeated. Parents precede children, so the
    result stays topologically ordered. The tries are extended in place. Only deterministic trees
    can be merged (``draft_probs`` is None).
    """
    if tree.draft_probs is not None:
        raise ValueError("merge_paths: trees with sampled drafts (draft_probs) cannot take extra "
                         "paths")
    if len(tries) != tree.batch_size:
        raise ValueError(f"merge_tries: {len(tries)} tries for {tree.batch_size} rows")
    if not any(t.tokens for t in tries):
        return tree
    toks, pars, valid = tree.tokens.tolist(), tree.parents.tolist(), tree.valid.tolist()
    for b, trie in enumerate(tries):
        new_index = {0: 0}
        for i in range(1, len(toks[b])):
            if valid[b][i]:
                new_index[i] = trie.add(new_index[pars[b][i]], toks[b][i])
    return pack_tries(tree.tokens[:, 0], tries)


def pack_tries(roots: torch.Tensor, tries: list[Trie]) -> TokenTree:
    """One tree per row: ``roots[b]`` over the draft nodes of ``tries[b]`` (:func:`pack_trees`)."""
    return pack_trees(roots, [(t.tokens, t.parents) for t in tries])
