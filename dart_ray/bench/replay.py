"""Offline acceptance replay: what a draft tree of each size would accept, for any tree knobs,
without running the target or the drafter again per setting.

Under greedy decoding the committed text is the target's greedy continuation whatever the drafter
proposes, and a DART drafter's level distributions at a position depend only on the text before
it (its cache holds committed context; the mask slots are scratch). So one pass per prompt
records, at every position a step could start from, the drafter's top-``K`` candidates per level
(:func:`collect`); any later setting of the tree-building knobs then costs only the tree search
(:func:`accepted_by_budget`), vectorised over every recorded position at once.

What it measures is acceptance, which is a property of the drafter, the knobs and the text, not of
the machine: the same figures hold on an AMX Xeon and an AVX2 EPYC. What a machine adds is the
price of each tree size (:mod:`dart_ray.engine.cost`), so the controller picks different sizes
there; a knob change that accepts at least as much at every budget is better on every machine.

Every position of a reference counts once (a real run visits only the positions its steps start
from); the figures are means over positions, the same weighting as ``scripts/eval_drafters.py``'s
chain figures. Drafts are scored within the reference: a position near its end accepts at most the
tokens left in it. :func:`simulate` walks the references the way decoding does instead (each
step starts where the last one's accepted path ended), with a fixed budget or the adaptive
controller choosing it, and prices the steps with a verify cost model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dart_ray.config import DecodingConfig, SamplingParams
from dart_ray.drafters.dart import build_tree, find_lookups, max_tree_nodes, ngram_context_len
from dart_ray.masks import attention_mask, causal_ancestors
from dart_ray.tree import TokenTree, Trie


@dataclass
class Replay:
    """Every recorded drafting position of a set of greedy references (``N`` positions)."""

    vals: np.ndarray
    """[N, d, K] float32: the drafter's top-``K`` logits per level, sorted descending."""
    ids: np.ndarray
    """[N, d, K] int64: their target token ids."""
    seqs: list[np.ndarray]
    """Per prompt: prompt + greedy reference, int64 token ids."""
    seq_of: np.ndarray
    """[N] int64: the prompt each position belongs to."""
    root_at: np.ndarray
    """[N] int64: the root's index in its sequence (the drafted tokens follow it)."""

    @property
    def num_positions(self) -> int:
        return int(self.seq_of.shape[0])

    def future(self, depth: int) -> np.ndarray:
        """[N, depth] int64: the reference tokens after each root (-1 past a sequence's end)."""
        out = np.full((self.num_positions, depth), -1, np.int64)
        for i, (s, r) in enumerate(zip(self.seq_of.tolist(), self.root_at.tolist(), strict=True)):
            nxt = self.seqs[s][r + 1:r + 1 + depth]
            out[i, :len(nxt)] = nxt
        return out

    def ngram_context(self, c: int) -> np.ndarray:
        """[N, c] int64: the ``c`` committed tokens before each root (-1 left-padded)."""
        out = np.full((self.num_positions, c), -1, np.int64)
        for i, (s, r) in enumerate(zip(self.seq_of.tolist(), self.root_at.tolist(), strict=True)):
            tail = self.seqs[s][max(0, r - c):r]
            out[i, c - len(tail):] = tail
        return out

    def text(self, i: int) -> np.ndarray:
        """Committed text + root of position ``i`` (what a prompt lookup searches)."""
        return self.seqs[int(self.seq_of[i])][:int(self.root_at[i]) + 1]

    def lookups(self, decoding: DecodingConfig) -> list[tuple[list[list[int]], int]]:
        """Per position: its prompt-lookup paths and the suffix length they match
        (:func:`~dart_ray.drafters.dart.find_lookups`; none when ``lookup_paths`` is 0)."""
        if not decoding.lookup_paths:
            return [([], 0)] * self.num_positions
        return [find_lookups(self.text(i), decoding) for i in range(self.num_positions)]

    def save(self, path: str | Path) -> None:
        """An ``.npz`` that :meth:`load` reads back."""
        seqs = np.empty(len(self.seqs), dtype=object)
        seqs[:] = self.seqs
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        np.savez(path, vals=self.vals, ids=self.ids, seqs=seqs, seq_of=self.seq_of,
                 root_at=self.root_at)

    @classmethod
    def load(cls, path: str | Path) -> Replay:
        z = np.load(path, allow_pickle=True)
        return cls(vals=z["vals"], ids=z["ids"], seqs=list(z["seqs"]), seq_of=z["seq_of"],
                   root_at=z["root_at"])


@torch.inference_mode()
def collect(engine, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int = 128,
            top_k: int = 32, depth: int | None = None) -> Replay:
    """Greedy references for ``prompt_ids`` from ``engine`` (a DART engine) and its drafter's
    top-``top_k`` candidates at every position after each prompt.

    The target runs once over each prompt + reference (its taps feed the drafter); the drafter
    then takes the text one position at a time, as a decode step that commits one token would
    feed it, and is asked for its levels at each."""
    drafter = engine.drafter
    if not hasattr(drafter, "draft_candidates"):
        raise ValueError(f"replay needs a DART drafter, got {drafter.name!r}")
    depth = drafter.max_draft_depth if depth is None else min(depth, drafter.max_draft_depth)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    vals, ids, seqs, seq_of, root_at = [], [], [], [], []
    dev = engine.device
    for s_i, prompt in enumerate(prompt_ids):
        ref = engine.generate([list(prompt)], params)[0].token_ids
        seq = np.asarray(list(prompt) + list(ref), dtype=np.int64)
        seqs.append(seq)
        P, L = len(prompt), len(seq)
        if L - P < 2:
            continue
        # the target over the whole text: taps of every position (row 0, then released)
        engine.cache.reset_row(0)
        tokens = torch.from_numpy(seq)[None].to(dev)                                 # [1, L]
        positions = torch.arange(L, device=dev)[None]                                 # [1, L]
        mask = attention_mask([0], causal_ancestors(L, dev), L, engine.dtype)
        out = engine.model(tokens, positions, mask, engine.cache, rows=slice(0, 1), starts=[0],
                           taps=drafter.taps, return_logits=False)
        engine.cache.reset_row(0)
        taps = out.taps                                                               # [1, L, nT*H]
        nxt = torch.cat([tokens[:, 1:], tokens[:, :1]], dim=1)                        # [1, L]
        drafter.prefill(slice(0, 1), [P], taps[:, :P], nxt[:, :P])
        for r in range(P, L - 1):                    # root s[r]; its drafts are scored on s[r+1:]
            v, i = drafter.draft_candidates(1, depth, top_k)                          # [1, d, K]
            vals.append(v[0].cpu().numpy())
            ids.append(i[0].cpu().numpy())
            seq_of.append(s_i)
            root_at.append(r)
            drafter.observe(None, [1], taps[:, r:r + 1], nxt[:, r:r + 1])
        drafter.release_row(0)
    return Replay(vals=np.stack(vals).astype(np.float32), ids=np.stack(ids).astype(np.int64),
                  seqs=seqs, seq_of=np.asarray(seq_of, np.int64),
                  root_at=np.asarray(root_at, np.int64))


TreeBuilder = Callable[[Replay, np.ndarray, DecodingConfig, object, list], TokenTree]
"""(replay, position indices, knobs, N-gram model, those positions' :meth:`Replay.lookups`) ->
the trees of those positions, nodes in priority order."""


def dart_trees(replay: Replay, idx: np.ndarray, decoding: DecodingConfig, ngram,
               lookups: list) -> TokenTree:
    """The trees ``DartDrafter.propose`` builds at positions ``idx``
    (:func:`~dart_ray.drafters.dart.build_tree` over the recorded candidates)."""
    k = min(decoding.top_k, replay.vals.shape[2])
    roots = torch.from_numpy(np.asarray([replay.text(i)[-1] for i in idx.tolist()]))
    ctx = replay.ngram_context(ngram_context_len(ngram))[idx]
    tries = [Trie.of(paths) for paths, _ in lookups] if decoding.lookup_paths else None
    return build_tree(roots, torch.from_numpy(replay.vals[idx, :, :k]),
                      torch.from_numpy(replay.ids[idx, :, :k]), decoding, ngram,
                      torch.from_numpy(ctx), tries)


def accepted_paths(tree: TokenTree, future: np.ndarray) -> np.ndarray:
    """[B, 1+N] bool: node i lies on the path the reference ``future`` ([B, D] tokens after the
    root, -1 padded) accepts -- its parent does and its token is the reference's at its depth."""
    toks, par = tree.tokens.numpy(), tree.parents.numpy()
    dep, valid = tree.depths.numpy(), tree.valid.numpy()
    B, n = toks.shape
    rows = np.arange(B)
    want = np.full((B, n), -2, np.int64)                        # the reference token at each depth
    d_ok = (dep >= 1) & (dep <= future.shape[1])
    want[d_ok] = future[np.nonzero(d_ok)[0], dep[d_ok] - 1]
    on = np.zeros((B, n), bool)
    on[:, 0] = True
    for i in range(1, n):              # parents precede children: one pass in node order
        on[:, i] = valid[:, i] & on[rows, np.maximum(par[:, i], 0)] & (toks[:, i] == want[:, i])
    return on


def _walk(replay: Replay, decoding: DecodingConfig, ngram, build: TreeBuilder, idx_all: np.ndarray,
          lookups: list, chunk: int = 1024):
    """Per chunk of positions: (offset, the chunk's trees, [b, 1+N] nodes on the accepted path)."""
    future = replay.future(max(decoding.draft_depth, decoding.lookup_len) + 1)
    for c0 in range(0, len(idx_all), chunk):
        idx = idx_all[c0:c0 + chunk]
        tree = build(replay, idx, decoding, ngram, [lookups[i] for i in idx.tolist()])
        yield c0, tree, accepted_paths(tree, future[idx])


def accepted_by_budget(replay: Replay, decoding: DecodingConfig, ngram, sizes: Sequence[int],
                       build: TreeBuilder = dart_trees,
                       positions: np.ndarray | None = None) -> dict[int, np.ndarray]:
    """Size ``m`` -> [N] accepted draft tokens per position with the tree cut to its first ``m``
    nodes (what the adaptive controller's budget-``m`` step verifies)."""
    idx_all = np.arange(replay.num_positions) if positions is None else np.asarray(positions)
    out = {m: np.zeros(len(idx_all), np.int64) for m in sizes}
    for c0, _, on in _walk(replay, decoding, ngram, build, idx_all, replay.lookups(decoding)):
        node = np.arange(1, on.shape[1])[None, :]
        for m in sizes:
            # a path's nodes increase in index, so the nodes within the first m are its prefix
            out[m][c0:c0 + len(on)] = (on[:, 1:] & (node <= m)).sum(1)
    return out


def flat_prices(cost, ratio: float):
    """``cost``'s grid re-priced so a verify forward of ``T`` tokens per row costs ``1 + (T - 1) /
    ratio`` of its plain step (``ratio`` ~ 60: an AMX Xeon's bf16 shape, docs/BENCHMARKS.md)."""
    from dart_ray.engine.cost import CostModel

    plain_s = cost.verify_s(1, 1)
    return CostModel.from_function(lambda b, t: plain_s * (1 + (t - 1) / ratio), cost.batches,
                                   cost.tokens)


@dataclass
class SimResult:
    """One :func:`simulate` walk over every reference."""

    speedup: float
    """Committed tokens per second relative to plain decoding at the same prices."""
    tokens_per_step: float
    """Committed tokens per decode step (tau)."""
    sizes: dict[tuple[int, int], int]
    """(context, budget) -> steps that verified it."""
    controller: object = None
    """The adaptive controller at the end of the walk (None with a fixed budget)."""


def simulate(replay: Replay, decoding: DecodingConfig, ngram, cost, *,
             draft_s: float | Callable[[int, int, int], float],
             overhead_s: float, plain_overhead_s: float, fixed: int | None = None,
             controller_config=None, order: Sequence[int] | None = None) -> SimResult:
    """Decode every reference step by step: a budget ``fixed`` every step, or the adaptive
    controller's choice (``controller_config``; contexts are the prompt-lookup match length, as the
    engine's, without its hindsight and its "running" flag). A step costs ``draft_s`` (none when
    plain; a function ``(budget, context, lookup nodes) -> seconds`` where it depends on them, as
    DART's search does on the budget and its forward on whether the lookup paths fill it) +
    ``cost.verify_s(1, nodes + 1)`` + an overhead; the controller learns from the same
    prices, so this measures its choices, not the machine's noise. ``order``: the references'
    order (default as recorded); one controller serves them all, as one engine serves a run's
    requests, so another order is another run of the same workload."""
    from dart_ray.engine.controller import ContextualController, ControllerConfig
    from dart_ray.engine.cost import CostModel

    n_max = max_tree_nodes(decoding)
    found = replay.lookups(decoding)
    paths: list[np.ndarray] = []
    widths: list[int] = []
    for _, tree, on in _walk(replay, decoding, ngram, dart_trees,
                             np.arange(replay.num_positions), found):
        paths.extend(np.nonzero(row[1:])[0] + 1 for row in on)
        widths.extend((tree.valid.numpy().sum(1) - 1).tolist())
    context = [k for _, k in found]
    trie_nodes = [len(Trie.of(conts).tokens) for conts, _ in found]
    drafting = draft_s if callable(draft_s) else (lambda n, ctx, lookup: draft_s)
    ctl = ContextualController(CostModel.from_dict(cost.to_dict()),
                               controller_config or ControllerConfig())
    plain = cost.verify_s(1, 1) + plain_overhead_s
    tokens = seconds = steps = 0.0
    sizes: dict[tuple[int, int], int] = {}
    for s in (range(len(replay.seqs)) if order is None else order):
        pos = np.nonzero(replay.seq_of == s)[0]
        at = dict(zip(replay.root_at[pos].tolist(), pos.tolist(), strict=True))  # root -> position
        r = min(at, default=0)
        while r in at:
            i = at[r]
            ctx = context[i]
            n = fixed if fixed is not None else ctl.plan(1, n_max, ctx)
            sizes[(ctx, n)] = sizes.get((ctx, n), 0) + 1
            if n:
                path = [int(j) for j in paths[i] if j <= n]    # the accepted path's prefix in n
                w = min(n, widths[i])
                verify = cost.verify_s(1, w + 1)
                d = drafting(n, ctx, trie_nodes[i])
                ctl.record(1, n, [path], draft_s=d, verify_s=verify, tokens_per_row=w + 1,
                           overhead_s=overhead_s, context=ctx, full_width=widths[i])
                seconds += d + verify + overhead_s
            else:
                ctl.record(1, 0, [], draft_s=0.0, verify_s=cost.verify_s(1, 1), tokens_per_row=1,
                           overhead_s=plain_overhead_s, context=ctx)
                path = []
                seconds += plain
            tokens += len(path) + 1
            steps += 1
            r += len(path) + 1
    return SimResult(speedup=tokens / seconds * plain if seconds else 0.0,
                     tokens_per_step=tokens / steps if steps else 0.0, sizes=sizes,
                     controller=None if fixed is not None else ctl)
