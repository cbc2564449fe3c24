"""N-gram-only drafting (no model): prompt lookup merged into a trie, corpus N-gram fallback.

For each row, the trailing ``k`` tokens (k = max_match .. min_match) of committed text + root are
searched for earlier occurrences in the same sequence; the tokens that followed each occurrence
(most recent first) are candidate continuations. Up to ``beam_width`` distinct continuations of at
most ``draft_depth`` tokens are merged into a trie (shared prefixes become one path) and cut to
``tree_budget`` nodes. If nothing matches and a corpus N-gram model is loaded, a greedy chain of
its most likely next tokens is proposed instead.
"""

from __future__ import annotations

import numpy as np

from dart_ray.drafters.base import BatchView, Drafter
from dart_ray.tree import TokenTree, pack_trees, trie_from_paths


def lookup_continuations(seq: np.ndarray, depth: int, max_cands: int, max_match: int = 3,
                         min_match: int = 1) -> list[list[int]]:
    """Distinct continuations (most recent match first) of the suffix of ``seq`` found earlier in
    ``seq``."""
    return lookup_match(seq, depth, max_cands, max_match, min_match)[0]


def lookup_match(seq: np.ndarray, depth: int, max_cands: int, max_match: int = 3,
                 min_match: int = 1) -> tuple[list[list[int]], int]:
    """:func:`lookup_continuations` and the length of the suffix they continue (0: none found).
    The longest suffix (``max_match`` down to ``min_match`` tokens) that occurred earlier wins."""
    n = len(seq)
    out: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    for k in range(min(max_match, n - 1), min_match - 1, -1):
        suffix = seq[n - k:]
        # [n-k, k]: every earlier window of length k (excludes the suffix itself)
        windows = np.lib.stride_tricks.sliding_window_view(seq[: n - 1], k)
        hits = np.nonzero((windows == suffix).all(axis=1))[0]  # window start indices
        for start in hits[::-1]:
            cont = seq[start + k: start + k + depth]
            if len(cont) == 0:
                continue
            key = tuple(int(t) for t in cont)
            if key in seen:
                continue
            seen.add(key)
            out.append(list(key))
            if len(out) >= max_cands:
                return out, k
        if out:
            return out, k  # prefer the longest matching suffix
    return out, 0


class ViewLookups:
    """Prompt lookups of one step, each row's computed at most once: a drafter's
    :meth:`~Drafter.context` needs only their shortest match length (the step's context) before
    the controller plans the step, and stops at the first row without a match; ``propose``, if
    the step speculates, reuses the rows found and searches the rest. Keyed on the
    :class:`BatchView` object and the search knobs."""

    def __init__(self) -> None:
        self._view: BatchView | None = None
        self._key: tuple[int, int, int, int] | None = None
        self._found: list[tuple[list[list[int]], int] | None] = []
        self._seqs: list[np.ndarray] = []

    def _row(self, view: BatchView, key: tuple[int, int, int, int],
             b: int) -> tuple[list[list[int]], int]:
        if self._view is not view or self._key != key:
            self._view, self._key = view, key
            self._seqs = view.sequences()
            self._found = [None] * len(self._seqs)
        found = self._found[b]
        if found is None:
            found = self._found[b] = lookup_match(self._seqs[b], *key)
        return found

    def get(self, view: BatchView, depth: int, max_cands: int, max_match: int,
            min_match: int) -> list[tuple[list[list[int]], int]]:
        """Per row: (continuations, suffix length matched) of :func:`lookup_match`."""
        key = (depth, max_cands, max_match, min_match)
        return [self._row(view, key, b) for b in range(view.batch_size)]

    def shortest_match(self, view: BatchView, depth: int, max_cands: int, max_match: int,
                       min_match: int) -> int:
        """The shortest suffix match over the rows (0 as soon as one row has none): at large
        batches some row usually has none, and the step then most often runs plain, so the other
        rows' lookups are not searched unless ``propose`` needs them."""
        key = (depth, max_cands, max_match, min_match)
        matched = []
        for b in range(view.batch_size):
            k = self._row(view, key, b)[1]
            if k == 0:
                return 0
            matched.append(k)
        return min(matched, default=0)

    def clear(self) -> None:
        self._view, self._found, self._seqs = None, [], []


class NGramDrafter(Drafter):
    name = "ngram"
    max_draft_depth = 32

    def __init__(self, ngram_model=None, max_match: int = 3, min_match: int = 1) -> None:
        super().__init__()
        self.ngram = ngram_model
        self.max_match = max_match
        self.min_match = min_match
        self.lookups = ViewLookups()

    def _knobs(self, view: BatchView) -> tuple[int, int, int, int]:
        # the configured knobs' paths, not the budget-n search's (its beams and depth are cut)
        knobs = view.configured_decoding
        return (min(knobs.draft_depth, self.max_draft_depth), knobs.beam_width, self.max_match,
                self.min_match)

    def _lookups(self, view: BatchView) -> list[tuple[list[list[int]], int]]:
        return self.lookups.get(view, *self._knobs(view))

    def context(self, view: BatchView) -> int:
        """The shortest suffix match over the rows (0: some row has none and drafts from the
        corpus N-gram model): steps that copy from a 3-token match accept far more."""
        return self.lookups.shortest_match(view, *self._knobs(view))

    def propose(self, view: BatchView) -> TokenTree:
        # the whole trie of the configured knobs, whatever the engine keeps: its first m nodes are
        # the budget-m trie, so the engine learns bigger budgets in hindsight
        decoding = view.configured_decoding
        depth = min(decoding.draft_depth, self.max_draft_depth)
        found = self._lookups(view)
        self.lookups.clear()
        seqs = (view.sequences() if self.ngram is not None and not all(p for p, _ in found)
                else None)                              # the text, for the corpus fallback only
        trees = []
        for b, (paths, _) in enumerate(found):
            if not paths and seqs is not None:
                paths = [self._corpus_chain(seqs[b], depth, decoding.ngram_min_count)]
            trees.append(trie_from_paths(paths, decoding.tree_budget))
        view.exact_nodes = [decoding.tree_budget] * len(trees)
        return pack_trees(view.roots, trees)

    def _corpus_chain(self, seq: np.ndarray, depth: int, min_count: int) -> list[int]:
        order = self.ngram.order
        ctx = list(seq[-(order - 1):]) if order > 1 else []
        ctx = [-1] * (order - 1 - len(ctx)) + [int(t) for t in ctx]
        chain: list[int] = []
        for _ in range(depth):
            toks, probs = self.ngram.top_next(np.array([ctx], dtype=np.int64), 1,
                                              min_count=min_count)
            if toks[0, 0] < 0 or probs[0, 0] < 0.1:
                break
            t = int(toks[0, 0])
            chain.append(t)
            ctx = (ctx + [t])[1:] if order > 1 else []
        return chain
