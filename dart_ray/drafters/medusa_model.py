"""Medusa heads (Cai et al., 2024): K residual heads on the target's last hidden state.

Head k (1..K) reads the final residual ``h_j`` of the last committed position j (the target's own
head turns it into the root x_{j+1}) and predicts x_{j+1+k}::

    logits_k = W_out( RMSNorm(h_j) + SiLU(W_k RMSNorm(h_j)) )

The output projection ``W_out`` (a reduced draft vocabulary, initialised from the target's head
rows) is shared by the heads to stay under the 25 MB artifact limit; the norm starts as the
target's final norm. The heads never see the root token, so the level distributions are
independent of it -- exactly the ``[B, d, V]`` level logits the DART tree search consumes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dart_ray.drafters.persist import load_drafter, save_drafter
from dart_ray.models.args import ModelArgs
from dart_ray.models.llama import RMSNorm

FORMAT_VERSION = 1
CONFIG_FILE = "medusa_config.json"


@dataclass(frozen=True)
class MedusaConfig:
    """Shape of a set of Medusa heads and the target they belong to."""

    target_id: str
    """Name of the target model the heads were trained for (checked at load)."""
    target_hidden: int
    target_vocab: int
    target_layers: int
    depth: int = 4
    """Number of heads K = trained depth (the drafter's ``max_draft_depth``)."""
    draft_vocab: int = 8192
    """Size of the shared reduced output vocabulary (id map ``d2t`` stored)."""
    rms_norm_eps: float = 1e-5
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        if not 1 <= self.depth <= 16:
            raise ValueError(f"depth must be in [1, 16], got {self.depth}")
        if not 1 <= self.draft_vocab <= self.target_vocab:
            raise ValueError(f"draft_vocab must be in [1, {self.target_vocab}], got "
                             f"{self.draft_vocab}")

    @property
    def tap_layers(self) -> tuple[int, ...]:
        """The final residual (tap index L)."""
        return (self.target_layers,)

    @classmethod
    def for_target(cls, args: ModelArgs, target_id: str, **kw) -> MedusaConfig:
        return cls(target_id=target_id, target_hidden=args.hidden_size,
                   target_vocab=args.vocab_size, target_layers=args.num_layers,
                   rms_norm_eps=args.rms_norm_eps, **kw)

    def check_target(self, args: ModelArgs, target_id: str) -> None:
        got = (self.target_hidden, self.target_vocab, self.target_layers, self.target_id)
        want = (args.hidden_size, args.vocab_size, args.num_layers, target_id)
        if got != want:
            raise ValueError("Medusa heads do not match the target: trained for (hidden, vocab, "
                             f"layers, id) {got}, target is {want}")


class MedusaModel(nn.Module):
    def __init__(self, cfg: MedusaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        H = cfg.target_hidden
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.blocks = nn.ModuleList(nn.Linear(H, H) for _ in range(cfg.depth))
        self.head = nn.Linear(H, cfg.draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab, dtype=torch.long))

    def init_from_target(self, target, d2t: torch.Tensor) -> MedusaModel:
        """Norm = the target's final norm, head = the target's head rows ``d2t``, blocks start at
        zero (so every head starts as the target's own next-token prediction)."""
        with torch.no_grad():
            self.d2t.copy_(d2t)
            self.norm.weight.copy_(target.norm.weight.float())
            self.head.weight.copy_(target.lm_head.weight[d2t].float())
            for blk in self.blocks:
                blk.weight.zero_()
                blk.bias.zero_()
        return self

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] (target final residual) -> [..., K, Vd] level logits."""
        x = self.norm(hidden)
        outs = [x + F.silu(blk(x)) for blk in self.blocks]                  # K x [..., H]
        return self.head(torch.stack(outs, dim=-2))                         # [..., K, Vd]

    # ---- persistence ---------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        save_drafter(self, self.cfg, path, CONFIG_FILE)

    @classmethod
    def load(cls, path: str | Path, dtype: torch.dtype = torch.float32,
             device="cpu") -> MedusaModel:
        return load_drafter(cls, MedusaConfig, path, CONFIG_FILE, FORMAT_VERSION, "Medusa heads",
                            dtype, device)
