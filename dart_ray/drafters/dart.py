"""DART drafting: one drafter forward per step yields d distributions; an N-gram-pruned beam
search turns them into a token tree (see ``dart_ray.tree.search``).

Per-row state: the drafter's own KV cache over context positions, and *pending* context — the
positions the target committed since the last drafter forward, with their taps and next tokens.
``propose`` runs the drafter over [pending context, d-1 mask slots] in one forward: it appends the
pending context to the drafter cache (committed) and reads the d level distributions; mask-slot
KV is written to scratch slots and never committed.
"""

from __future__ import annotations

import time

import torch

from dart_ray.config import DecodingConfig
from dart_ray.drafters.base import BatchView, Drafter, to_target_vocab
from dart_ray.drafters.dart_model import DartModel
from dart_ray.drafters.ngram import ViewLookups, lookup_match
from dart_ray.kv_cache import KVCache
from dart_ray.masks import attention_mask
from dart_ray.tree import TokenTree, Trie, merge_tries, pack_tries

LOOKUP_MAX_MATCH = 3
"""Longest text suffix (tokens) a prompt-lookup path continues."""


def max_tree_nodes(decoding: DecodingConfig) -> int:
    """Most draft nodes of a DART tree: the beam search's budget plus the lookup paths."""
    return decoding.tree_budget + decoding.lookup_paths * decoding.lookup_len


def lookup_knobs(decoding: DecodingConfig) -> tuple[int, int, int, int]:
    """:func:`~dart_ray.drafters.ngram.lookup_match`'s (depth, max_cands, max_match, min_match)
    for DART's lookup paths."""
    return (decoding.lookup_len, decoding.lookup_paths, LOOKUP_MAX_MATCH,
            decoding.lookup_min_match)


def find_lookups(seq, decoding: DecodingConfig) -> tuple[list[list[int]], int]:
    """One row's prompt-lookup paths (continuations of ``seq``'s suffix found earlier in it) and
    the suffix length matched: what :meth:`DartDrafter.propose` merges into that row's tree."""
    return lookup_match(seq, *lookup_knobs(decoding))


def ngram_context_len(ngram) -> int:
    """Committed tokens before the root that the N-gram term reads (the root completes its
    order - 1 context)."""
    return max(getattr(ngram, "order", 3) - 2, 1)


def build_tree(roots: torch.Tensor, cand_vals: torch.Tensor, cand_ids: torch.Tensor,
               decoding: DecodingConfig, ngram, context: torch.Tensor,
               tries: list[Trie] | None) -> TokenTree:
    """DART's trees from each level's candidates (``[B, d, k]``): the N-gram-pruned beam search,
    led by each row's lookup trie (None: no lookup paths); ``context`` [B, c] the committed tokens
    before the roots (:func:`ngram_context_len`)."""
    from dart_ray.tree.search import build_trees_from_candidates

    tree, _ = build_trees_from_candidates(roots, cand_vals, cand_ids, decoding, context=context,
                                          ngram=ngram)
    return tree if tries is None else merge_tries(tree, tries)


class DartDrafter(Drafter):
    name = "dart"

    def __init__(self, model: DartModel, embed: torch.nn.Embedding, head_weight: torch.Tensor,
                 ngram=None) -> None:
        super().__init__()
        self.model = model
        self.embed = embed                   # the target's (frozen, shared) embedding
        self.model_cfg = model.cfg           # the network's shape (DartConfig); knobs come per step
        self.taps = model.cfg.tap_layers
        self.max_draft_depth = model.cfg.depth
        if model.cfg.tie_head:
            self.head_weight = head_weight   # [V, H] target LM head (shared, not copied)
        else:
            self.head_weight = None
        self.ngram = ngram
        self.cache: KVCache | None = None
        self.lookups = ViewLookups()
        self.lookup_only_steps = 0
        """Proposals whose kept nodes were all lookup paths (no drafter forward, no search)."""
        self.pending: list[list[tuple[torch.Tensor, torch.Tensor]] | None] = []
        """Per row: chunks of (taps [n, nT*H], next tokens [n]) committed since the last drafter
        forward. Kept raw -- a plain step costs a list append -- and turned into layer inputs in one
        batched call when the drafter next runs (its catch-up after skipped steps)."""

    def allocate(self, max_batch: int, max_seq_len: int) -> None:
        c = self.model_cfg
        w = self.model.fc.weight
        # one forward writes every row's pending context padded to the longest (a newly admitted
        # prompt next to a long-running row), plus the mask slots: twice the length covers it
        self.cache = KVCache(1, max_batch, c.num_kv_heads, 2 * max_seq_len + self.max_draft_depth,
                             c.head_dim, w.dtype, w.device)
        self.pending = [None] * max_batch

    # ---- state updates ----------------------------------------------------------------------
    def _append_pending(self, rows: list[int], lens: list[int], taps: torch.Tensor,
                        nxt: torch.Tensor) -> None:
        """taps [n, P, nT*H], nxt [n, P] (padded; row i has ``lens[i]`` valid positions): append to
        each row's pending context (views; nothing is computed until the drafter runs)."""
        for i, (r, n) in enumerate(zip(rows, lens, strict=True)):
            chunk = (taps[i, :n], nxt[i, :n])
            if self.pending[r] is None:
                self.pending[r] = [chunk]
            else:
                self.pending[r].append(chunk)

    def prefill(self, rows, prompt_lens, taps, next_tokens) -> None:
        idx = list(range(rows.start, rows.start + len(prompt_lens)))
        for r in idx:
            self.cache.reset_row(r)
            self.pending[r] = None
        self._append_pending(idx, prompt_lens, taps, next_tokens)

    def observe(self, view, num_committed, taps, next_tokens) -> None:
        self._append_pending(list(range(len(num_committed))), num_committed, taps, next_tokens)

    def move_row(self, src: int, dst: int) -> None:
        self.cache.move_row(src, dst)
        self.pending[dst], self.pending[src] = self.pending[src], None

    def release_row(self, row: int) -> None:
        self.cache.reset_row(row)
        self.pending[row] = None

    @property
    def prompted(self) -> list[bool]:
        """Per row: its pending context holds its prompt (no drafter forward since prefill, which
        empties the row's drafter cache; the first forward fills it)."""
        return [p is not None and n == 0 for p, n in zip(self.pending, self.cache.lengths,
                                                           strict=True)]

    # ---- drafting ---------------------------------------------------------------------------
    def _context_block(self, B: int, M: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """One layer pass over every row's pending context (committed to the drafter cache) followed
        by ``M`` mask slots (scratch, never committed) -> (layer output [B, P+M, H] pre-norm,
        pending lengths [B, 1], P = the padded context length)."""
        from torch.nn.utils.rnn import pad_sequence

        pend = [self.pending[b] for b in range(B)]
        if any(p is None for p in pend):
            raise RuntimeError(f"{self.name} drafter has no pending context for a running row")
        starts = self.cache.lengths[:B]
        # an empty drafter cache: the row's prompt rides on this forward (a few chunks of skipped
        # steps are a step's cost: a lookup-only step is timed cheap, the forward after it too)
        self.caught_up = 0 in starts
        taps = [torch.cat([c[0] for c in p]) if len(p) > 1 else p[0][0] for p in pend]
        nxt = [torch.cat([c[1] for c in p]) if len(p) > 1 else p[0][1] for p in pend]
        P_b = [t.shape[0] for t in nxt]
        P = max(P_b)
        taps_p = pad_sequence(taps, batch_first=True)                  # [B, P, nT*H]
        nxt_p = pad_sequence(nxt, batch_first=True)                    # [B, P]
        h_ctx, r_ctx = self.model.context_inputs(taps_p, self.embed(nxt_p))
        # h_ctx [B, P, 2H], r_ctx [B, P, H] (padding positions are masked out below)
        h_m, r_m = self.model.mask_inputs((B, M))                      # [B, M, 2H], [B, M, H]
        h = torch.cat([h_ctx, h_m], dim=1)                             # [B, T, 2H]
        resid = torch.cat([r_ctx, r_m], dim=1)                         # [B, T, H]
        T = P + M
        dev = h.device
        plen = torch.tensor(P_b, device=dev)[:, None]                  # [B, 1]
        t = torch.arange(T, device=dev)[None, :]                       # [1, T]
        is_mask = t >= P                                               # [1, T]
        # positions: context j -> start+j; mask slot m (1..M) -> start + P_b - 1 + m
        base = torch.tensor(starts, device=dev)[:, None]
        positions = torch.where(is_mask, base + plen - 1 + (t - P + 1), base + t.clamp(max=P - 1))
        positions = torch.minimum(positions, base + plen - 1 + M)      # pads: any in-range position
        # visibility inside the new block: causal over real context and within the mask block
        q = torch.arange(T, device=dev)[:, None]
        k = torch.arange(T, device=dev)[None, :]
        causal = k <= q                                                # [T, T]
        k_real = (k < plen[:, :, None]) | (k >= P)                     # [B, 1, T] keys that exist
        anc = causal & k_real                                          # [B, T, T]
        anc = anc | torch.eye(T, dtype=torch.bool, device=dev)         # pads see themselves
        s_used = self.cache.begin_write(slice(0, B), T, starts)
        mask = attention_mask(starts, anc, s_used, h.dtype)
        x = self.model.layer_out(h, resid, positions, mask, self.cache, s_used)  # [B, T, H]
        self.cache.commit_all(slice(0, B), P_b)
        for b in range(B):
            self.pending[b] = None
        return x, plen, P

    @torch.inference_mode()
    def _level_logits(self, B: int, depth: int) -> torch.Tensor:
        """One drafter forward over rows 0..B-1 -> [B, depth, Vd] level logits over the draft
        vocabulary (``Vd = V`` without one)."""
        M = depth - 1
        x, plen, P = self._context_block(B, M)                             # [B, P+M, H]
        sel = torch.cat([plen - 1, P + torch.arange(M, device=x.device)[None, :].expand(B, M)],
                        dim=1)  # [B, d]
        hsel = torch.gather(x, 1, sel.unsqueeze(-1).expand(-1, -1, x.shape[-1]))        # [B, d, H]
        return self.model.logits(self.model.norm(hsel), self.head_weight)             # [B, d, Vd]

    def draft_logits(self, B: int, depth: int) -> torch.Tensor:
        """One drafter forward over rows 0..B-1 -> [B, depth, V] float32 level logits over the
        target vocabulary (``depth``: the draft depth used this step, <= ``max_draft_depth``)."""
        logits = self._level_logits(B, depth).float()
        if self.model_cfg.draft_vocab is not None:
            logits = to_target_vocab(logits, self.model.d2t, self.model_cfg.target_vocab)
        return logits

    @torch.inference_mode()
    def draft_candidates(self, B: int, depth: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafter forward -> each level's top-``k`` candidates: logits [B, depth, k] float32
        (sorted descending) and target token ids [B, depth, k]. The top-k is taken over the draft
        vocabulary and mapped through ``d2t``: the candidates of :meth:`draft_logits`, without
        widening [B, d, Vd] to the target's vocabulary first."""
        from dart_ray.tree.search import topk_last

        logits = self._level_logits(B, depth)                               # [B, d, Vd]
        vals, idx = topk_last(logits, min(k, logits.shape[-1]))           # [B, d, k] each
        if self.model_cfg.draft_vocab is not None:
            idx = self.model.d2t[idx]                                      # target ids
        return vals.float(), idx

    def propose(self, view: BatchView) -> TokenTree:
        decoding = view.decoding
        t0 = time.perf_counter()
        draft_s = 0.0
        self.caught_up = False
        # per row: the prompt-lookup paths' trie, which leads the merged tree
        tries = ([Trie.of(paths) for paths, _ in self._lookups(view)]
                 if decoding.lookup_paths else None)
        self.lookups.clear()
        if tries is not None and view.max_nodes is not None:
            # the lookup nodes lead every budget's tree: exact as far as they go
            view.exact_nodes = [max(view.max_nodes, len(t.tokens)) for t in tries]
        if (tries is not None and view.max_nodes is not None
                and all(len(t.tokens) >= view.max_nodes for t in tries)):
            # the lookup nodes alone fill what the engine keeps in every row: DART's nodes would
            # all be cut, so skip its forward and the search (the same tree after the cut; the
            # drafter takes this step's context with its next forward)
            self.lookup_only_steps += 1
            tree = pack_tries(view.roots, tries)
        else:
            depth = min(decoding.draft_depth, self.max_draft_depth)
            t1 = time.perf_counter()
            vals, ids = self.draft_candidates(view.batch_size, depth, decoding.top_k)
            draft_s = time.perf_counter() - t1
            tree = build_tree(view.roots, vals, ids, decoding, self.ngram,
                              view.tail_context(ngram_context_len(self.ngram)), tries)
        self.tree_time_s += time.perf_counter() - t0 - draft_s
        return tree

    def max_tree_nodes(self, decoding) -> int:
        return max_tree_nodes(decoding)

    def context(self, view: BatchView) -> int:
        """With prompt-lookup paths on: the shortest suffix match over the rows (0: some row has
        none). A matched step's lookup path usually fills the small trees the controller picks,
        so it also skips the drafter forward: its acceptance and its cost both differ."""
        if not view.decoding.lookup_paths:
            return 0
        return self.lookups.shortest_match(view, *lookup_knobs(view.decoding))

    def _lookups(self, view: BatchView) -> list[tuple[list[list[int]], int]]:
        """Per row: continuations of the text's suffix found earlier in the same sequence, and the
        suffix length matched."""
        return self.lookups.get(view, *lookup_knobs(view.decoding))
