"""Hindsight acceptance: what a step's uncut tree would have accepted, read from the text the
target generated afterwards.

The adaptive controller verifies the first ``n`` nodes of a drafter's tree. A drafter whose tree is
*prefix-exact* beyond that cut -- its first ``m`` nodes are the tree it would have built with budget
``m``, for every ``m`` up to some ``known`` (prompt lookup: the trie of the continuations it found)
-- returns the whole tree, and the engine learns every budget up to ``known`` from this one step:
under greedy decoding the target's continuation is unique, so a tree cut to ``m`` nodes accepts the
longest path of its nodes ``<= m`` that the continuation follows. The first ``n`` nodes of that
path are the accepted ones; if the bonus token is a child of the last one beyond the cut, the path
goes on with the tokens of the next steps (usually one or two) and the step's acceptance is learned
when the path ends (or the request does). No probe has to verify a bigger tree to learn it: prompt
lookup's acceptance is bimodal (copy runs accept the whole 10-token path, other matches one or two
tokens), and a handful of probes misjudged it.

Exact under greedy decoding, as the controller's own counterfactual for smaller trees; an estimate
under sampling.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from dart_ray.tree import TokenTree


@dataclass
class _Walk:
    """One row of a step whose accepted path went past the cut: its uncut tree as a child map."""

    children: dict[tuple[int, int], int]
    """(parent node, token) -> child node, nodes ``<= known`` of the uncut tree."""
    inner: set[int]
    """Nodes with a child (a walk at any other node has ended)."""
    node: int
    """The path's last node so far."""
    path: list[int]
    """The path's node indices (root excluded), increasing."""


@dataclass
class HindsightStep:
    """A speculative step whose acceptance is learned once every row's path has ended."""

    context: Hashable
    known: int
    """Budgets up to this are learned (every row's tree is prefix-exact that far)."""
    paths: list[list[int] | None]
    """Per row: the path in the uncut tree (None while its walk waits for text)."""
    walks: dict[int, _Walk] = field(default_factory=dict)
    """Row index in the step -> its walk still waiting for text."""

    @property
    def done(self) -> bool:
        return not self.walks


class Hindsight:
    """Pending hindsight steps, fed the text each request generates."""

    def __init__(self) -> None:
        self._by_request: dict[str, list[tuple[HindsightStep, int]]] = {}

    def begin(self, context: Hashable, known: int, n_used: int, full: TokenTree,
              paths: list[list[int]], bonus: list[int], request_ids: list[str]) -> HindsightStep:
        """A step verified ``full`` cut to ``n_used`` nodes; ``paths[b]`` the accepted node
        indices of row b (root excluded; the same in the cut and the uncut tree), ``bonus[b]`` the
        token sampled after them. Rows whose bonus is a child of their last accepted node among
        nodes ``n_used+1..known`` of ``full`` wait for the next tokens of their request
        (:meth:`feed`); the step is :attr:`~HindsightStep.done` when none does."""
        step = HindsightStep(context, known, paths)
        if known <= n_used:
            return step
        dev = full.tokens.device
        last = torch.tensor([p[-1] if p else 0 for p in paths], device=dev)[:, None]  # [B, 1]
        idx = torch.arange(full.num_nodes, device=dev)[None, :]                        # [1, 1+N]
        bon = torch.tensor(bonus, device=dev)[:, None]                                 # [B, 1]
        cont = (full.valid & (full.parents == last) & (full.tokens == bon)
                & (idx > n_used) & (idx <= known))                                     # [B, 1+N]
        rows = cont.any(1).nonzero().flatten().tolist()
        if not rows:
            return step
        child = cont.int().argmax(1).tolist()                                          # [B]
        cols = min(known + 1, full.num_nodes)
        toks, pars = full.tokens[:, :cols].tolist(), full.parents[:, :cols].tolist()
        valid = full.valid[:, :cols].tolist()
        for b in rows:
            kids = {(pars[b][i], toks[b][i]): i for i in range(1, cols) if valid[b][i]}
            inner = {p for p, _ in kids}
            if child[b] not in inner:              # the bonus was a leaf: the path ends there
                step.paths[b].append(child[b])
                continue
            step.walks[b] = _Walk(kids, inner, child[b], step.paths[b] + [child[b]])
            step.paths[b] = None
            self._by_request.setdefault(request_ids[b], []).append((step, b))
        return step

    def running(self, request_id: str) -> bool:
        """An earlier step's path of this request went past its cut and has not ended: the text
        is following a copy the drafter proposed, which tends to go on (HumanEval, DART with
        24-node trees on the Zen 4: after a step that accepted 6 or more tokens, a 3-token
        lookup match accepted its whole 10-token path on 62 % of the steps; after one that
        accepted 1-2, on 16 %)."""
        return bool(self._by_request.get(request_id))

    def feed(self, request_id: str, tokens: list[int]) -> list[HindsightStep]:
        """``tokens`` were generated for ``request_id``: walks go on; returns the steps that
        finished."""
        pending = self._by_request.get(request_id)
        if not pending:
            return []
        done, still = [], []
        for step, b in pending:
            walk = step.walks[b]
            ended = False
            for t in tokens:
                nxt = walk.children.get((walk.node, t))
                if nxt is None:
                    ended = True
                    break
                walk.node = nxt
                walk.path.append(nxt)
            if ended or walk.node not in walk.inner:
                if self._finish(step, b):
                    done.append(step)
            else:
                still.append((step, b))
        if still:
            self._by_request[request_id] = still
        else:
            del self._by_request[request_id]
        return done

    def end(self, request_id: str) -> list[HindsightStep]:
        """The request left: its walks end where they are; returns the steps that finished."""
        return [step for step, b in self._by_request.pop(request_id, []) if self._finish(step, b)]

    @staticmethod
    def _finish(step: HindsightStep, b: int) -> bool:
        step.paths[b] = step.walks.pop(b).path
        return step.done
