"""The DART drafter network: one Llama-style layer over three fused target taps.

Context position j (a committed target position) gets::

    h_j = concat(RMSNorm_e(E[x_{j+1}]), RMSNorm_h(fc(taps_j)))  # [2H], E: target embedding (frozen)
    residual_j = fc(taps_j)                                     # [H]

and each of the d-1 masked future slots gets the learned vector ``mask`` (2H) with residual
``mask[H:]``. One layer (attention with q/k/v from 2H, SwiGLU MLP) runs over
[new context positions, mask slots] attending to the drafter's own KV cache of earlier context;
then norm + head. **Shifted logits**: the output at the last context position (which sees the
root's embedding) predicts x_{n+1}; mask slot m predicts x_{n+1+m}.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from dart_ray.drafters.persist import load_drafter, save_drafter
from dart_ray.models.args import ModelArgs
from dart_ray.models.llama import MLP, Attention, RMSNorm
from dart_ray.models.rope import RopeCache

FORMAT_VERSION = 1


@dataclass(frozen=True)
class DartConfig:
    """Shape of a DART drafter and the target it belongs to."""

    target_id: str
    """Name of the target model this drafter was trained for (checked at load)."""
    target_hidden: int
    target_vocab: int
    target_layers: int
    tap_layers: tuple[int, ...]
    """Target layers whose input residual is fused (DART default {2, L//2, L-3})."""
    depth: int = 8
    """Trained draft depth d (levels per forward = 1 context output + d-1 mask slots)."""
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    intermediate_size: int = 1536
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    draft_vocab: int | None = None
    """Size of a reduced draft vocabulary (an id map ``d2t`` is stored), None = full target
    vocab."""
    tie_head: bool = True
    """Use the target's LM head weight (frozen, shared) instead of an own head."""
    arch: str = "dart"
    """``dart`` (masked future slots, one forward per step) or ``eagle`` (the same layer run
    autoregressively, its own output fed back as the next position's feature)."""
    format_version: int = FORMAT_VERSION
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.arch not in ("dart", "eagle"):
            raise ValueError(f"arch must be 'dart' or 'eagle', got {self.arch!r}")
        if len(self.tap_layers) < 1:
            raise ValueError("tap_layers must not be empty")
        if any(not 0 <= t < self.target_layers for t in self.tap_layers):
            raise ValueError(f"tap_layers {self.tap_layers} out of range for {self.target_layers} "
                             "layers")
        if self.depth < 1:
            raise ValueError("depth must be >= 1")
        if self.tie_head and self.draft_vocab is not None:
            raise ValueError("a tied head uses the full target vocabulary; set tie_head=False for "
                             "draft_vocab")
        object.__setattr__(self, "tap_layers", tuple(self.tap_layers))

    @classmethod
    def for_target(cls, args: ModelArgs, target_id: str, **kw) -> DartConfig:
        return cls(target_id=target_id, target_hidden=args.hidden_size,
                   target_vocab=args.vocab_size, target_layers=args.num_layers,
                   tap_layers=kw.pop("tap_layers", args.default_taps), num_heads=args.num_heads,
                   num_kv_heads=args.num_kv_heads, head_dim=args.head_dim,
                   intermediate_size=kw.pop("intermediate_size", args.intermediate_size),
                   rms_norm_eps=args.rms_norm_eps, rope_theta=args.rope_theta, **kw)

    def layer_args(self) -> ModelArgs:
        return ModelArgs(model_type="llama", vocab_size=self.target_vocab,
                         hidden_size=self.target_hidden, intermediate_size=self.intermediate_size,
                         num_layers=1, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                         head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps,
                         rope_theta=self.rope_theta)

    def check_target(self, args: ModelArgs, target_id: str) -> None:
        problems = []
        if self.target_hidden != args.hidden_size:
            problems.append(f"hidden {self.target_hidden} != {args.hidden_size}")
        if self.target_vocab != args.vocab_size:
            problems.append(f"vocab {self.target_vocab} != {args.vocab_size}")
        if self.target_layers != args.num_layers:
            problems.append(f"layers {self.target_layers} != {args.num_layers}")
        if self.target_id != target_id:
            problems.append(f"trained for {self.target_id!r}, target is {target_id!r}")
        if problems:
            raise ValueError("DART drafter does not match the target: " + "; ".join(problems))


class DartModel(nn.Module):
    def __init__(self, cfg: DartConfig) -> None:
        super().__init__()
        self.cfg = cfg
        H = cfg.target_hidden
        la = cfg.layer_args()
        self.fc = nn.Linear(len(cfg.tap_layers) * H, H, bias=False)
        self.norm_emb = RMSNorm(H, cfg.rms_norm_eps)
        self.norm_tap = RMSNorm(H, cfg.rms_norm_eps)
        self.mask = nn.Parameter(torch.zeros(2 * H))
        self.attn_norm = RMSNorm(2 * H, cfg.rms_norm_eps)
        self.attn = Attention(la, 0, in_dim=2 * H)
        self.mlp_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.mlp = MLP(la)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        if not cfg.tie_head:
            self.head = nn.Linear(H, cfg.draft_vocab or cfg.target_vocab, bias=False)
        if cfg.draft_vocab is not None:
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab, dtype=torch.long))
        self.rope = RopeCache(la)  # rope(needed, like) -> cos, sin tables (built on first use)

    def init_random(self, seed: int) -> DartModel:
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            with torch.no_grad():
                if name.endswith("norm.weight") or "norm_" in name:
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        return self

    def context_inputs(self, taps: torch.Tensor,
                       next_emb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """taps [.., nT*H], next_emb [.., H] -> (layer input [.., 2H], residual [.., H])."""
        fused = self.fc(taps)
        return torch.cat([self.norm_emb(next_emb), self.norm_tap(fused)], dim=-1), fused

    def mask_inputs(self, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs/residuals for mask slots: [*shape, 2H], [*shape, H]."""
        H = self.cfg.target_hidden
        m = self.mask.expand(*shape, 2 * H)
        return m, m[..., H:]

    def layer_out(self, h: torch.Tensor, resid: torch.Tensor, positions: torch.Tensor,
                  mask: torch.Tensor | None, cache, s_used: int) -> torch.Tensor:
        """One decoder layer; h: [B, T, 2H], resid: [B, T, H] -> [B, T, H] residual output
        (pre-norm)."""
        cos, sin = self.rope.gather(positions, h)                                 # [B, 1, T, D]
        x = resid + self.attn(self.attn_norm(h), cos, sin, mask, cache, s_used)
        return x + self.mlp(self.mlp_norm(x))

    def feature_inputs(self, feature: torch.Tensor,
                       tok_emb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """EAGLE: a drafted position's inputs from its parent's layer output (in place of fused
        taps)."""
        return torch.cat([self.norm_emb(tok_emb), self.norm_tap(feature)], dim=-1), feature

    def logits(self, hidden: torch.Tensor, target_head: torch.Tensor | None) -> torch.Tensor:
        """[.., H] -> [.., Vd] (tied: the target's head rows, restricted to d2t if reduced)."""
        if self.cfg.tie_head:
            return hidden @ target_head.t()
        return self.head(hidden)

    # ---- persistence ---------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        save_drafter(self, self.cfg, path, "dart_config.json")

    @classmethod
    def load(cls, path: str | Path, dtype: torch.dtype = torch.float32, device="cpu") -> DartModel:
        return load_drafter(cls, DartConfig, path, "dart_config.json", FORMAT_VERSION,
                            "DART drafter", dtype, device)
