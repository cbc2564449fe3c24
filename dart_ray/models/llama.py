"""A small Llama-family decoder (Llama/SmolLM2, Mistral, Qwen2, Qwen3) with explicit inputs.

Everything is passed in: token ids, position ids, an additive attention mask (so arbitrary tree
masks work), a static :class:`~dart_ray.kv_cache.KVCache`, and which layers to *tap* (return the
residual stream entering them, as DART's drafter needs). There is no hidden state between calls
besides the cache. Projections are fused (qkv, gate+up) to keep the per-layer op count low — on
CPU at batch 1 the decode step is dominated by per-op overhead, not FLOPs.

The model knows nothing of tensor parallelism; ``dart_ray.parallel`` shards it as a transform.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dart_ray.kv_cache import KVCache
from dart_ray.models.args import ModelArgs
from dart_ray.models.rope import RopeCache, apply_rope


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        H = x.shape[-1]
        if x.device.type == "cpu" and not torch.is_grad_enabled():
            # F.rms_norm is a ~20-op composite on CPU (torch 2.13), layer_norm one fused kernel:
            # [x, -x] has mean 0, so layer norm over it divides by sqrt(mean(x^2) + eps), the RMS
            # norm of x. A SmolLM2 bf16 decode step on 2 Zen 4 cores: 0.9-2.0 ms less (61 norms).
            both = torch.cat([x, -x], dim=-1)                                   # [..., 2H]
            normed = F.layer_norm(both, (2 * H,), None, None, self.eps)[..., :H]
            return normed * self.weight.to(x.dtype)        # x's dtype, as F.rms_norm returns
        return F.rms_norm(x, (H,), self.weight, self.eps)


def fold_mask(mask: torch.Tensor | None, rep: int, T: int) -> torch.Tensor | None:
    """An additive mask [B, 1, T, S] for the GQA-folded query layout ([B, H_kv, rep*T, D], row
    r*T + t = token t): [B, 1, rep*T, S]. None, a mask already folded (rep*T rows) and one that
    broadcasts over the queries (1 row) pass through, so a caller may fold once for all layers."""
    if mask is None or rep == 1 or T == 1 or mask.shape[-2] in (1, rep * T):
        return mask
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[-2] != T:
        raise ValueError(f"mask must be [B, 1, {T} or {rep * T} or 1, S] (one mask for every "
                         f"head), got {tuple(mask.shape)}")
    return mask.repeat(1, 1, rep, 1)                                          # [B, 1, rep*T, S]


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int, in_dim: int | None = None) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.n_heads, self.n_kv, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        q_out, kv_out = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        self.qkv = nn.Linear(in_dim or args.hidden_size, q_out + 2 * kv_out, bias=args.qkv_bias)
        self.o = nn.Linear(q_out, args.hidden_size, bias=args.o_bias)
        self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.split = (q_out, kv_out, kv_out)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None, cache: KVCache, s_used: int) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(x).split(self.split, dim=-1)
        q = q.view(B, T, -1, self.head_dim)                      # [B, T, H, D]
        k = k.view(B, T, -1, self.head_dim)                      # [B, T, H_kv, D]
        v = v.view(B, T, -1, self.head_dim).transpose(1, 2)      # [B, H_kv, T, D]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)              # [B, H, T, D]
        k = apply_rope(k.transpose(1, 2), cos, sin)              # [B, H_kv, T, D]
        if cache is None:                                        # training: attend within the block
            keys, values = k, v
        else:
            keys, values = cache.write(self.layer_id, k, v, s_used)   # [B, H_kv, S, D]
        rep = self.n_heads // self.n_kv
        if rep > 1 and (T == 1 or q.device.type == "cpu"):
            # fold each KV group's query heads into the query-length axis, [B, H, T, D] ->
            # [B, H_kv, rep*T, D] (row r*T + t = query head kv*rep + r, token t), so attention is
            # one small matmul per KV head: the same math as enable_gqa (query head h reads KV
            # head h // rep) without the CPU kernel's slow GQA path -- 29 -> 22 ms per SmolLM2
            # bf16 decode step at 600 cached tokens; for tree verification (T > 1) 20-45 % less
            # attention time at T <= 8 (2 cores, AMD EPYC Zen 4). The mask follows the fold.
            out = F.scaled_dot_product_attention(
                q.reshape(B, self.n_kv, rep * T, self.head_dim), keys, values,
                attn_mask=fold_mask(mask, rep, T),
            ).reshape(B, self.n_heads, T, self.head_dim)                      # [B, H, T, D]
        else:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                                 enable_gqa=rep > 1)          # [B, H, T, D]
        return self.o(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate_up = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=False)
        self.down = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.attn = Attention(args, layer_id)
        self.mlp_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)

    def forward(self, x, cos, sin, mask, cache, s_used):
        x = x + self.attn(self.attn_norm(x), cos, sin, mask, cache, s_used)
        return x + self.mlp(self.mlp_norm(x))


@dataclass
class ForwardOutput:
    logits: torch.Tensor | None  # [B, T', V] (T' = T, or the gathered positions)
    taps: torch.Tensor | None    # [B, T, len(taps) * H] residual inputs of the tapped layers
    hidden: torch.Tensor | None = None  # [B, T, H] final residual, pre-norm (if logits not asked)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs, max_seq_len: int = 4096) -> None:
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Block(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        # tables built on first use, on the weights' dtype/device
        self.rope = RopeCache(args, max_seq_len)

    def new_cache(self, max_batch: int, max_seq_len: int) -> KVCache:
        w = self.embed.weight
        a = self.args
        return KVCache(a.num_layers, max_batch, a.num_kv_heads, max_seq_len, a.head_dim, w.dtype,
                       w.device)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head: [..., H] -> [..., V]."""
        return self.lm_head(self.norm(hidden))

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,           # [B, T] int64
        positions: torch.Tensor,        # [B, T] int64
        mask: torch.Tensor | None,      # [B, 1, T, S] additive (0 / -inf), or None = see all S
        cache: KVCache,
        rows: slice | None = None,      # cache rows of this batch (default 0..B-1)
        starts: list[int] | None = None,      # per-row write start slot (default: committed length)
        taps: tuple[int, ...] = (),     # layers whose input residual to return (L = final residual)
        logits_at: torch.Tensor | None = None,  # [B, K] positions to compute logits at (None = all)
        return_logits: bool = True,     # False: return the final residual (``hidden``) instead
    ) -> ForwardOutput:
        B, T = tokens.shape
        rows = slice(0, B) if rows is None else rows
        s_used = cache.begin_write(rows, T, starts)
        if mask is not None and mask.shape[-1] != s_used:
            raise ValueError(f"mask covers {mask.shape[-1]} key slots, cache needs {s_used}")
        if tokens.device.type == "cpu":      # every layer's attention folds GQA heads (above)
            mask = fold_mask(mask, self.args.num_heads // self.args.num_kv_heads, T)
        cos, sin = self.rope.gather(positions, self.embed.weight)  # [B, 1, T, D] each
        x = self.embed(tokens)                               # [B, T, H]
        tapped: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            if i in taps:
                tapped.append(x)
            x = layer(x, cos, sin, mask, cache, s_used)
        if len(self.layers) in taps:
            tapped.append(x)                                 # tap L = the final residual (pre-norm)
        tap_out = None
        if taps:
            order = sorted(taps)
            tap_out = torch.cat([tapped[order.index(t)] for t in taps], dim=-1)  # [B, T, nT*H]
        if not return_logits:                               # the caller runs self.head where needed
            return ForwardOutput(logits=None, taps=tap_out, hidden=x)
        if logits_at is not None:
            x = torch.gather(x, 1, logits_at.unsqueeze(-1).expand(-1, -1, x.shape[-1]))  # [B, K, H]
        return ForwardOutput(logits=self.head(x), taps=tap_out)
