"""EAGLE-style drafting: the DART layer run autoregressively, one tree level per drafter forward.

Context handling is DART's (pending committed positions with their taps, appended to the drafter's
own KV cache). Then the tree grows level by level as in EAGLE-2 (dynamic tree by draft confidence):

    level 1     the context output's distribution -> top-k children of the root
    level m+1   the ``beam_width`` most likely frontier nodes (cumulative draft log-prob) each run
                through the layer -- input: the node's token embedding and its parent's layer output
                as feature, attending to the committed context and its own ancestors -- and give
                top-k children each
    finally     the ``tree_budget`` most likely nodes overall (a prefix-closed set)

Drafted nodes' keys/values go to scratch slots past the committed context and are never committed.
That is ``draft_depth`` drafter forwards per step where DART needs one -- the cost DART removes.
"""

from __future__ import annotations

import time

import torch

from dart_ray.drafters.base import BatchView
from dart_ray.drafters.dart import DartDrafter
from dart_ray.tree import TokenTree
from dart_ray.tree.tree import pack_trees

MAX_WIDTH = 16
"""Most frontier nodes expanded per level (bounds the drafter's scratch)."""
MAX_CHILDREN = 16


class EagleDrafter(DartDrafter):
    name = "eagle"

    def allocate(self, max_batch: int, max_seq_len: int) -> None:
        super().allocate(max_batch, max_seq_len + MAX_WIDTH * self.max_draft_depth + 1)

    @torch.inference_mode()
    def _context_forward(self, B: int) -> torch.Tensor:
        """Append every row's pending context to the drafter cache -> [B, H] layer output (pre-norm)
        at each row's last context position (DART's context pass without mask slots)."""
        x, plen, _ = self._context_block(B, 0)                                     # [B, P, H]
        return x[torch.arange(B, device=x.device), plen[:, 0] - 1]                 # [B, H]

    def _logp(self, x: torch.Tensor) -> torch.Tensor:
        """[.., H] layer output -> [.., Vd] float32 draft log-probs."""
        return torch.log_softmax(self.model.logits(self.model.norm(x), self.head_weight).float(),
                                 dim=-1)

    def _to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.d2t[ids] if self.model_cfg.draft_vocab is not None else ids

    def max_tree_nodes(self, decoding) -> int:
        return decoding.tree_budget  # no lookup paths: the EAGLE-2 tree is its own

    @torch.inference_mode()
    def propose(self, view: BatchView) -> TokenTree:
        decoding = view.decoding
        B = view.batch_size
        D = min(decoding.draft_depth, self.max_draft_depth)   # levels = drafter forwards
        W = min(decoding.beam_width, MAX_WIDTH)               # frontier nodes expanded
        K = min(decoding.top_k, MAX_CHILDREN)                 # children per node
        feat0 = self._context_forward(B)                      # [B, H]
        dev = feat0.device
        lens = torch.tensor(self.cache.lengths[:B], device=dev)          # committed context per row
        # level 1: children of the root
        lp, ids = self._logp(feat0).topk(K, dim=-1)           # [B, K]
        node_tok = [self._to_target_ids(ids)]                 # per level: [B, n_l]
        node_score = [lp]
        node_parent = [torch.full_like(ids, -1)]              # index into previous level (-1: root)
        parent_feat = feat0[:, None, :].expand(B, K, -1)      # [B, K, H] feature for each node
        scr_vis = torch.zeros(B, K, 0, dtype=torch.bool, device=dev)      # ancestors' scratch slots
        for m in range(1, D):
            # frontier: the W most likely nodes of the last level
            w = min(W, node_score[-1].shape[1])
            sel_score, sel = node_score[-1].topk(w, dim=-1)   # [B, w]
            tok = torch.gather(node_tok[-1], 1, sel)          # [B, w]
            feat = torch.gather(parent_feat, 1,  # [B, w, H]
                                sel[..., None].expand(-1, -1, parent_feat.shape[-1]))
            vis = torch.gather(scr_vis, 1,                                # [B, w, S_prev]
                               sel[..., None].expand(-1, -1, scr_vis.shape[-1]))
            off = scr_vis.shape[-1]                                      # scratch slots used so far
            vis = torch.cat([vis, torch.eye(w, dtype=torch.bool, device=dev).expand(B, w, w)],
                            dim=-1)  # + own slot
            x = self.expand(tok, feat, vis, lens, m)                               # [B, w, H]
            lp, ids = self._logp(x).topk(K, dim=-1)                                # [B, w, K]
            node_tok.append(self._to_target_ids(ids).reshape(B, w * K))
            node_score.append((sel_score[..., None] + lp).reshape(B, w * K))
            node_parent.append(sel[..., None].expand(B, w, K).reshape(B, w * K))
            parent_feat = x[:, :, None, :].expand(B, w, K, x.shape[-1]).reshape(B, w * K, -1)
            scr_vis = vis[:, :, None, :].expand(B, w, K, off + w).reshape(B, w * K, off + w)
        t0 = time.perf_counter()
        tree = self._select(view.roots, node_tok, node_score, node_parent, decoding.tree_budget)
        self.tree_time_s += time.perf_counter() - t0
        return tree

    def expand(self, tok: torch.Tensor, feat: torch.Tensor, vis: torch.Tensor, lens: torch.Tensor,
               m: int) -> torch.Tensor:
        """One drafter forward over w drafted nodes per row at depth m (>= 1).

        tok [B, w] node tokens (target ids), feat [B, w, H] their parents' layer outputs,
        vis [B, w, S] which scratch slots each node sees (its ancestors' and, last, its own: the w
        new nodes are written to scratch slots S-w .. S-1), lens [B] committed drafter context.
        Returns the nodes' layer outputs [B, w, H] (pre-norm; the next level's features).
        """
        B, w = tok.shape
        dev = tok.device
        S = vis.shape[-1]
        off = S - w
        h, resid = self.model.feature_inputs(feat, self.embed(tok))          # [B, w, 2H], [B, w, H]
        positions = (lens - 1 + m)[:, None].expand(B, w)
        s_used = self.cache.begin_write(slice(0, B), w, (lens + off).tolist())
        rel = torch.arange(s_used, device=dev)[None, None] - lens[:, None, None]   # [B, 1, s_used]
        seen = torch.gather(vis, 2, rel.clamp(0, S - 1).expand(B, w, s_used))      # [B, w, s_used]
        visible = (rel < 0) | ((rel < S) & seen)
        mask = torch.zeros(B, 1, w, s_used, dtype=h.dtype, device=dev)
        mask.masked_fill_(~visible[:, None], float("-inf"))
        return self.model.layer_out(h, resid, positions, mask, self.cache, s_used)

    @staticmethod
    def _select(roots: torch.Tensor, node_tok: list[torch.Tensor], node_score: list[torch.Tensor],
                node_parent: list[torch.Tensor], budget: int) -> TokenTree:
        """Keep the ``budget`` best nodes per row (scores only fall along a path and ties prefer the
        shallower node, so the kept set is prefix-closed; a node whose parent was not kept -- only
        possible with non-finite scores -- is dropped with its subtree) and pack them in priority
        order (score descending, parents first), so the first n nodes are the best n-node tree."""
        B = roots.shape[0]
        sizes = [s.shape[1] for s in node_score]
        offsets = [0]
        for n in sizes[:-1]:
            offsets.append(offsets[-1] + n)
        depth = torch.cat([torch.full((n,), lvl, dtype=torch.float64)
                           for lvl, n in enumerate(sizes)])
        score = torch.cat(node_score, dim=1).double().cpu() - 1e-9 * depth     # [B, N_all]
        keep = score.topk(min(budget, score.shape[1]), dim=1).indices          # priority order
        tok = torch.cat(node_tok, dim=1).cpu().tolist()
        # parent as a global node index (-1: root)
        par_glob = torch.cat([torch.where(p < 0, p, p + (offsets[lvl - 1] if lvl else 0))
                              for lvl, p in enumerate(node_parent)], dim=1).cpu().tolist()
        trees = []
        for b in range(B):
            kept = keep[b].tolist()
            index: dict[int, int] = {}                                         # global -> tree node
            toks, pars = [], []
            for g in kept:                                                     # parents first
                pg = par_glob[b][g]
                if pg >= 0 and pg not in index:
                    continue
                toks.append(tok[b][g])
                pars.append(index[pg] if pg >= 0 else 0)
                index[g] = len(toks)
            trees.append((toks, pars))
        return pack_trees(roots, trees)
