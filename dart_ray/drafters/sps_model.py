"""A shallow draft model for standard speculative sampling (Leviathan et al., 2023).

A causal LM with the target's tokenizer: ``num_layers`` Llama blocks of the target's own shape,
initialised from target layers ``init_layers`` and distilled from the target (``dart-ray
train-drafter --arch sps``). The token embedding is the target's (shared, frozen, not shipped) and
the head is the target's head restricted to a reduced draft vocabulary ``d2t`` (also taken from the
target at load, so only the blocks, the final norm and the id map are shipped). Tokens outside the
draft vocabulary get probability 0 under q, which keeps rejection sampling exact.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dart_ray.drafters.persist import load_drafter, save_drafter
from dart_ray.kv_cache import KVCache
from dart_ray.models.args import ModelArgs
from dart_ray.models.llama import Block, RMSNorm
from dart_ray.models.rope import RopeCache

FORMAT_VERSION = 1
CONFIG_FILE = "sps_config.json"


@dataclass(frozen=True)
class SpsConfig:
    """Shape of a draft model and the target it belongs to."""

    target_id: str
    """Name of the target model (checked at load)."""
    target_args: dict
    """The target's ModelArgs (the blocks copy its shape)."""
    num_layers: int = 2
    init_layers: tuple[int, ...] = (0, 1)
    """Target layers the blocks were initialised from (recorded for the card)."""
    draft_vocab: int = 8192
    max_depth: int = 8
    """Trained depth: the longest chain the drafter proposes (its ``max_draft_depth``)."""
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        object.__setattr__(self, "init_layers", tuple(self.init_layers))
        if self.num_layers < 1 or len(self.init_layers) != self.num_layers:
            raise ValueError("need num_layers >= 1 and one init layer each, got "
                             f"{self.num_layers}, {self.init_layers}")
        if not 1 <= self.max_depth <= 16:
            raise ValueError(f"max_depth must be in [1, 16], got {self.max_depth}")
        if not 1 <= self.draft_vocab <= self.target_args["vocab_size"]:
            raise ValueError(f"draft_vocab must be in [1, {self.target_args['vocab_size']}]")

    @classmethod
    def for_target(cls, args: ModelArgs, target_id: str, **kw) -> SpsConfig:
        d = dataclasses.asdict(args)
        d["eos_token_ids"] = list(d["eos_token_ids"])
        return cls(target_id=target_id, target_args=d, **kw)

    def layer_args(self) -> ModelArgs:
        d = dict(self.target_args, num_layers=self.num_layers)
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        return ModelArgs(**d)

    def check_target(self, args: ModelArgs, target_id: str) -> None:
        mine = self.layer_args()
        got = (mine.hidden_size, mine.vocab_size, self.target_id)
        want = (args.hidden_size, args.vocab_size, target_id)
        if got != want:
            raise ValueError(f"draft model does not match the target: (hidden, vocab, id) {got} vs "
                             f"{want}")


class SpsModel(nn.Module):
    def __init__(self, cfg: SpsConfig) -> None:
        super().__init__()
        self.cfg = cfg
        la = cfg.layer_args()
        self.args = la
        self.layers = nn.ModuleList(Block(la, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(la.hidden_size, la.rms_norm_eps)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab, dtype=torch.long))
        self.rope = RopeCache(la)  # rope(needed, like) -> cos, sin tables (built on first use)

    def init_from_target(self, target, d2t: torch.Tensor) -> SpsModel:
        with torch.no_grad():
            self.d2t.copy_(d2t)
            for mine, src in zip(self.layers, self.cfg.init_layers, strict=True):
                mine.load_state_dict({k: v.float()
                                      for k, v in target.layers[src].state_dict().items()})
            self.norm.weight.copy_(target.norm.weight.float())
        return self

    def new_cache(self, max_batch: int, max_seq_len: int) -> KVCache:
        a, w = self.args, self.norm.weight
        return KVCache(a.num_layers, max_batch, a.num_kv_heads, max_seq_len, a.head_dim, w.dtype,
                       w.device)

    def hidden(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
               cache: KVCache | None, s_used: int) -> torch.Tensor:
        """x [B, T, H] token embeddings -> [B, T, H] final-normed hidden (cache None: training)."""
        cos, sin = self.rope.gather(positions, x)                                  # [B, 1, T, D]
        for layer in self.layers:
            x = layer(x, cos, sin, mask, cache, s_used)
        return self.norm(x)

    # ---- persistence ---------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        save_drafter(self, self.cfg, path, CONFIG_FILE)

    @classmethod
    def load(cls, path: str | Path, dtype: torch.dtype = torch.float32, device="cpu") -> SpsModel:
        return load_drafter(cls, SpsConfig, path, CONFIG_FILE, FORMAT_VERSION, "draft model", dtype,
                            device)
