"""The drafter interface: propose a token tree per running sequence, observe what was accepted.

Every drafting method (DART, N-gram-only, none; later EAGLE-style, Medusa, draft model) implements
:class:`Drafter`. The engine owns the rows (one per running request, compacted to ``0..B-1``) and
tells the drafter about row lifecycle; the drafter owns whatever per-row state it needs (its KV
cache, pending context).

Step protocol (rows ``0..B-1`` are the running requests)::

    prefill(rows, ...)         new requests joined at ``rows`` (after the target prefilled them)
    c = context(view)          (adaptive engines) what the step can be told by before drafting
    tree = propose(view)       draft for every running row (skipped on a plain step)
    ... target verifies, acceptance picks a path ...
    observe(view, ...)         what was committed this step (and the target taps of it)
    move_row(src, dst)         compaction when a request leaves
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import numpy as np
import torch

from dart_ray.config import DecodingConfig, RenamedAttribute
from dart_ray.tree import TokenTree


@dataclass
class BatchView:
    """What a drafter may read about the running batch (rows ``0..B-1``)."""

    roots: torch.Tensor    # [B] int64 next root token per row (chosen, not yet in the target cache)
    lengths: list[int]     # committed target tokens per row
    tokens: np.ndarray     # [B_max, S_max] int64 committed token ids (row r valid up to lengths[r])
    decoding: DecodingConfig       # current runtime knobs
    # per-row SamplingParams (drafters that sample their drafts need them)
    params: list | None = None
    # per-row RequestRandom (None for greedy rows): a drafter that samples its drafts draws with
    # its ``generator``
    randoms: list | None = None
    # draft nodes the engine keeps this step: it cuts the tree to its first ``max_nodes`` (priority
    # order), so a drafter may skip work that cannot reach them (None: the whole tree is kept)
    max_nodes: int | None = None
    # the knobs before the cut to ``max_nodes`` (``decoding`` is then the budget-``max_nodes``
    # search's); None: ``decoding`` is them
    full_decoding: DecodingConfig | None = None
    # set by ``propose`` (None: ``max_nodes``): per row, the largest budget m for which the first m
    # nodes of the returned tree are the tree this drafter builds with budget m. A drafter that
    # returns nodes beyond ``max_nodes`` on that promise (prompt lookup's trie) lets the engine
    # learn bigger budgets' acceptance in hindsight (``dart_ray.engine.hindsight``)
    exact_nodes: list[int] | None = None

    @property
    def configured_decoding(self) -> DecodingConfig:
        """The step's knobs before any cut to ``max_nodes``."""
        return self.full_decoding or self.decoding

    @property
    def batch_size(self) -> int:
        return int(self.roots.shape[0])

    def sequences(self) -> list[np.ndarray]:
        """Per row: the committed ids followed by the root -- the text a prompt lookup searches."""
        roots = self.roots.tolist()
        return [np.append(self.tokens[b, :self.lengths[b]], roots[b])
                for b in range(self.batch_size)]

    def tail_context(self, c: int) -> torch.Tensor:
        """[B, c] int64 the last ``c`` committed tokens per row (-1 left-padded) -- N-gram
        context."""
        B = self.batch_size
        ctx = torch.full((B, c), -1, dtype=torch.long)
        for b in range(B):
            n = self.lengths[b]
            tail = self.tokens[b, max(0, n - c):n]
            if len(tail):
                ctx[b, c - len(tail):] = torch.from_numpy(tail)
        return ctx


def to_target_vocab(logits: torch.Tensor, d2t: torch.Tensor, vocab: int) -> torch.Tensor:
    """[..., Vd] logits over a reduced draft vocabulary (ids ``d2t`` [Vd]) -> [..., V] with -inf
    outside it, so the tree search and the sampler see target token ids."""
    full = logits.new_full((*logits.shape[:-1], vocab), float("-inf"))
    return full.scatter_(-1, d2t.expand_as(logits), logits)


class Drafter(abc.ABC):
    """One drafting method. Subclasses set ``name`` and ``taps``."""

    name: str = "base"
    taps: tuple[int, ...] = ()
    """Target layers whose input residual the drafter needs (captured in the verify forward)."""

    max_draft_depth: int = 0
    """Deepest level this drafter can propose, its trained depth: it drafts
    ``min(decoding.draft_depth, max_draft_depth)`` positions per step."""

    max_depth = RenamedAttribute("max_draft_depth")

    def __init__(self) -> None:
        self.tree_time_s = 0.0
        """Cumulative seconds spent building trees (the rest of propose() counts as drafting)."""
        self.caught_up = False
        """The last :meth:`propose` also took a new row's prompt (DART, EAGLE and SpS take a row's
        prompt with its first drafter forward). Its time is then not a step's drafting cost, and
        the adaptive controller does not learn it as one: a HumanEval prompt (~115 tokens) through
        DART's layer costs 4-15 ms against ~2.3 ms per step on the Zen 5, and learned as the price
        of the budget the request's first step used, it priced that budget out."""

    def max_tree_nodes(self, decoding: DecodingConfig) -> int:
        """Most draft nodes one ``propose`` may return (the engine reserves that much cache
        scratch)."""
        return decoding.tree_budget

    def allocate(self, max_batch: int, max_seq_len: int) -> None:
        """Allocate per-row state for up to ``max_batch`` rows (called once by the engine)."""

    def pack_weights(self) -> int:
        """Apply the CPU packing transform (``dart_ray.models.packing``) to the drafter's own
        network, if it has one (``self.model``); called by the engine after ``allocate`` when it
        packs the target. Returns the number of linears packed."""
        from dart_ray.models.packing import pack_linears

        model = getattr(self, "model", None)
        return pack_linears(model) if isinstance(model, torch.nn.Module) else 0

    def prefill(self, rows: slice, prompt_lens: list[int], taps: torch.Tensor | None,
                next_tokens: torch.Tensor) -> None:
        """Rows ``rows`` were prefilled. taps: [n, T, nT*H] target taps at the prompt positions
        (None if ``self.taps`` is empty); next_tokens: [n, T] the token following each position
        (prompt shifted by one, then the first generated token at position len-1)."""

    def context(self, view: BatchView) -> int:
        """What this step's drafts can be told apart by before drafting, cheaply (0: nothing).

        The adaptive controller keeps acceptance and timing estimates per context and plans each
        step from its own: prompt lookup returns the suffix match length, since a step that
        continues a 3-token match accepts far more, and drafts faster, than one with no match.
        Called once per speculative-capable step, before :meth:`propose` on the same ``view``."""
        return 0

    @abc.abstractmethod
    def propose(self, view: BatchView) -> TokenTree:
        """Return a tree per running row, rooted at ``view.roots``."""

    def observe(self, view: BatchView, num_committed: list[int], taps: torch.Tensor | None,
                next_tokens: torch.Tensor) -> None:
        """The last step committed ``num_committed[b]`` tokens to row b (root + accepted drafts).

        taps: [B, A, nT*H] the target's taps at those positions (padded to A = max committed);
        next_tokens: [B, A] the token that follows each committed position (the accepted drafts
        shifted by one, then the new root). ``view`` already reflects the new state.
        """

    def move_row(self, src: int, dst: int) -> None:
        """Row ``src`` moves to ``dst`` (compaction after a request left)."""

    def release_row(self, row: int) -> None:
        """Row ``row`` is free."""


class NoDrafter(Drafter):
    """Plain autoregressive decoding through the same engine: every tree is just the root."""

    name = "none"

    def max_tree_nodes(self, decoding: DecodingConfig) -> int:
        return 0

    def propose(self, view: BatchView) -> TokenTree:
        from dart_ray.tree import empty_tree
        return empty_tree(view.roots)
