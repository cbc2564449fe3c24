"""Draft-model speculative sampling (Leviathan et al., 2023; Chen et al., 2023).

A shallow causal LM (:mod:`dart_ray.drafters.sps_model`) drafts a chain of ``draft_depth`` tokens
autoregressively. Greedy rows take its argmax; sampled rows draw each token from the draft
distribution q processed with the request's own temperature/top-k/top-p, and hand q to the
verifier (``TokenTree.draft_probs``) for the p/q rejection rule.

Per-row state: the draft model's KV cache and how many of the row's tokens it holds. Each step
the first draft forward catches up on the tokens committed since (accepted drafts + the root) in
one chunk; the drafted chain lives in scratch slots and is recomputed next step if accepted.
"""

from __future__ import annotations

import torch

from dart_ray.drafters.base import BatchView, Drafter, to_target_vocab
from dart_ray.drafters.sps_model import SpsModel
from dart_ray.kv_cache import KVCache
from dart_ray.masks import attention_mask, causal_ancestors
from dart_ray.tree import TokenTree
from dart_ray.tree.tree import chain_tree


class SpsDrafter(Drafter):
    name = "sps"

    def __init__(self, model: SpsModel, embed: torch.nn.Embedding,
                 head_weight: torch.Tensor) -> None:
        super().__init__()
        self.model = model
        self.model_cfg = model.cfg                             # the draft model's shape (SpsConfig)
        self.embed = embed                                     # the target's embedding (shared)
        self.head = head_weight[model.d2t].to(model.norm.weight.dtype)  # [Vd, H] target head rows
        self.vocab = head_weight.shape[0]
        self.max_draft_depth = model.cfg.max_depth
        self.cache: KVCache | None = None

    def max_tree_nodes(self, decoding) -> int:
        return min(decoding.draft_depth, self.max_draft_depth)

    def allocate(self, max_batch: int, max_seq_len: int) -> None:
        # the catch-up chunk is padded to the longest row's (a new prompt next to a long-running
        # row)
        self.cache = self.model.new_cache(max_batch, 2 * max_seq_len + self.max_draft_depth + 2)

    def prefill(self, rows, prompt_lens, taps, next_tokens) -> None:
        for i in range(len(prompt_lens)):
            self.cache.reset_row(rows.start + i)

    def move_row(self, src: int, dst: int) -> None:
        self.cache.move_row(src, dst)

    def release_row(self, row: int) -> None:
        self.cache.reset_row(row)

    # ---- drafting ---------------------------------------------------------------------------
    def _logits(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                starts: list[int], B: int) -> torch.Tensor:
        """Draft model over [B, T] tokens written at ``starts`` -> [B, T, Vd] float32 logits."""
        s_used = self.cache.begin_write(slice(0, B), tokens.shape[1], starts)
        x = self.embed(tokens).to(self.head.dtype)
        hidden = self.model.hidden(x, positions, mask, self.cache, s_used)      # [B, T, H]
        return (hidden @ self.head.t()).float()

    def _choose(self, logits: torch.Tensor, params: list, gens: list, sampled: list[int]
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[B, Vd] draft logits -> next draft token per row (target ids) and q [B, V] for sampled
        rows (drawn with each row's own generator, so a seeded request stays reproducible)."""
        from dart_ray.verify.acceptance import processed_probs

        d2t = self.model.d2t
        tok = d2t[logits.argmax(dim=-1)]                                          # greedy rows
        if not sampled:
            return tok, None
        full = to_target_vocab(logits, d2t, self.vocab)                            # [B, V]
        q = torch.zeros_like(full)
        idx = torch.tensor(sampled, device=logits.device)
        sp = [params[b] for b in sampled]
        q[idx] = processed_probs(full[idx], torch.tensor([p.temperature for p in sp]),
                                 torch.tensor([p.top_k for p in sp]),
                                 torch.tensor([p.top_p for p in sp]))
        for b in sampled:
            tok[b] = torch.multinomial(q[b], 1, generator=gens[b])[0]
        return tok, q

    @torch.inference_mode()
    def propose(self, view: BatchView) -> TokenTree:
        B = view.batch_size
        d = min(view.decoding.draft_depth, self.max_draft_depth)  # chain length (the papers' gamma)
        params = view.params or []
        gens = [r and r.generator for r in view.randoms or [None] * B]
        sampled = [b for b, p in enumerate(params) if not p.greedy]
        dev = view.roots.device
        done = self.cache.lengths[:B]
        self.caught_up = 0 in done                           # a row's first chunk is its prompt
        # catch up: tokens committed since the last step, then the root -- one chunk
        pend = [list(view.tokens[b, done[b]:view.lengths[b]]) + [int(view.roots[b])]
                for b in range(B)]
        P_b = [len(p) for p in pend]
        P = max(P_b)
        toks = torch.zeros(B, P, dtype=torch.long, device=dev)               # [B, P] right-padded
        for b, p in enumerate(pend):
            toks[b, :len(p)] = torch.tensor(p, dtype=torch.long)
        plen = torch.tensor(P_b, device=dev)[:, None]
        t = torch.arange(P, device=dev)
        positions = torch.tensor(done, device=dev)[:, None] + torch.minimum(t[None, :], plen - 1)
        anc = (causal_ancestors(P, dev)[None] & (t[None, None, :] < plen[:, :, None])) \
            | torch.eye(P, dtype=torch.bool, device=dev)
        s_used = max(done) + P
        logits = self._logits(toks, positions,
                              attention_mask(done, anc, s_used, self.embed.weight.dtype),
                              list(done), B)                                 # [B, P, Vd]
        logits = logits[torch.arange(B, device=dev), plen[:, 0] - 1]         # [B, Vd]
        self.cache.commit_all(slice(0, B), P_b)
        committed = list(self.cache.lengths[:B])
        chain = torch.zeros(B, d, dtype=torch.long, device=dev)              # [B, d] drafted tokens
        # [B, 1+d, V] q of each chain node (greedy rows stay zero: they are verified by argmax)
        q_all = torch.zeros(B, d + 1, self.vocab, device=dev) if sampled else None
        for i in range(d):
            tok, q = self._choose(logits, params, gens, sampled)
            chain[:, i] = tok
            if q is not None:
                q_all[:, i + 1] = q
            if i + 1 == d:
                break
            starts = [c + i for c in committed]
            pos = torch.tensor(starts, device=dev)[:, None]
            mask = attention_mask(starts, causal_ancestors(1, dev), max(starts) + 1,
                                  self.embed.weight.dtype)
            logits = self._logits(tok[:, None], pos, mask, starts, B)[:, 0]
        tree = chain_tree(view.roots, chain)
        if q_all is not None:
            tree = TokenTree(tree.tokens, tree.parents, tree.depths, tree.valid, q_all)
        return tree
