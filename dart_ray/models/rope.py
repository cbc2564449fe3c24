"""Rotary position embeddings (rotate-half convention), incl. llama3 and linear scaling."""

from __future__ import annotations

import math

import torch

from dart_ray.models.args import ModelArgs


def inv_frequencies(args: ModelArgs) -> torch.Tensor:
    """[head_dim // 2] float64 inverse frequencies after any scaling."""
    D = args.head_dim
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    sc = args.rope_scaling
    if not sc:
        return inv
    if sc["rope_type"] == "linear":
        return inv / float(sc["factor"])
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate in between
    factor = float(sc["factor"])
    low = float(sc.get("low_freq_factor", 1.0))
    high = float(sc.get("high_freq_factor", 4.0))
    old_ctx = float(sc.get("original_max_position_embeddings", 8192))
    low_wavelen = old_ctx / low
    high_wavelen = old_ctx / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_mid, mid, scaled)


def rope_tables(args: ModelArgs, max_len: int, dtype: torch.dtype,
                device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables: [max_len, head_dim] each (frequencies duplicated for rotate-half)."""
    inv = inv_frequencies(args)                                  # [D/2]
    t = torch.arange(max_len, dtype=torch.float64)
    freqs = torch.outer(t, inv)                                  # [max_len, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)                      # [max_len, D]
    return emb.cos().to(dtype=dtype, device=device), emb.sin().to(dtype=dtype, device=device)


class RopeCache:
    """The cos/sin tables of one model, built lazily (nothing at construction) on the dtype and
    device of the activations that ask, and rebuilt only for a longer position, another dtype or
    another device. Calling it returns the tables; :meth:`gather` the rows at given positions."""

    def __init__(self, args: ModelArgs, min_len: int = 4096) -> None:
        self.args = args
        self.length = min_len
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, needed: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [>= needed, head_dim] each, in ``like``'s dtype and device."""
        t = self._tables
        if (t is None or t[0].shape[0] < needed or t[0].dtype != like.dtype
                or t[0].device != like.device):
            self.length = max(self.length, needed)
            self._tables = t = rope_tables(self.args, self.length, like.dtype, like.device)
        return t

    def gather(self, positions: torch.Tensor,
               like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> cos, sin [B, 1, T, D] (ready for :func:`apply_rope`)."""
        cos_t, sin_t = self(int(positions.max()) + 1, like)
        return cos_t[positions].unsqueeze(1), sin_t[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, T, D]; cos/sin: [B, 1, T, D] (already gathered at the tokens' positions)."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin
