"""Medusa drafting: K heads read the target's final residual at the last committed position and
give K level distributions at once; the same (optionally N-gram-pruned) beam search as DART turns
them into a tree. Per-row state is just that one hidden vector."""

from __future__ import annotations

import time

import torch

from dart_ray.drafters.base import BatchView, Drafter, to_target_vocab
from dart_ray.drafters.medusa_model import MedusaModel
from dart_ray.tree import TokenTree


class MedusaDrafter(Drafter):
    name = "medusa"

    def __init__(self, model: MedusaModel, ngram=None) -> None:
        super().__init__()
        self.model = model
        self.model_cfg = model.cfg           # the heads' shape (MedusaConfig); knobs come per step
        self.taps = model.cfg.tap_layers     # (L,): the final residual
        self.max_draft_depth = model.cfg.depth      # one head per level
        self.ngram = ngram
        self.last: torch.Tensor | None = None       # [B_max, H] final residual at each row's end

    def allocate(self, max_batch: int, max_seq_len: int) -> None:
        w = self.model.head.weight
        self.last = torch.zeros(max_batch, self.model_cfg.target_hidden, dtype=w.dtype,
                                device=w.device)

    def prefill(self, rows, prompt_lens, taps, next_tokens) -> None:
        for i, n in enumerate(prompt_lens):
            self.last[rows.start + i] = taps[i, n - 1]

    def observe(self, view, num_committed, taps, next_tokens) -> None:
        idx = torch.tensor(num_committed, device=taps.device) - 1                 # [B]
        self.last[:len(num_committed)] = taps[torch.arange(len(num_committed),
                                                           device=taps.device), idx]

    def move_row(self, src: int, dst: int) -> None:
        self.last[dst] = self.last[src]

    @torch.inference_mode()
    def draft_logits(self, B: int, depth: int) -> torch.Tensor:
        """[B, depth, V] float32 level logits (-inf outside the draft vocabulary)."""
        logits = self.model(self.last[:B])[:, :depth].float()                       # [B, depth, Vd]
        return to_target_vocab(logits, self.model.d2t, self.model_cfg.target_vocab)

    def propose(self, view: BatchView) -> TokenTree:
        from dart_ray.tree.search import build_trees

        decoding = view.decoding
        logits = self.draft_logits(view.batch_size, min(decoding.draft_depth, self.max_draft_depth))
        t0 = time.perf_counter()
        ctx = view.tail_context(max(getattr(self.ngram, "order", 3) - 2, 1))
        tree = build_trees(view.roots, logits, decoding, context=ctx, ngram=self.ngram)
        self.tree_time_s += time.perf_counter() - t0
        return tree
