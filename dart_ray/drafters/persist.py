"""Saving and loading a drafter network: ``model.safetensors`` + a JSON config beside it.

One implementation for every drafter model (DART/EAGLE, Medusa, SpS): a missing file, an unknown
``format_version`` or unreadable weights raise an error naming the file.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch

WEIGHTS_FILE = "model.safetensors"


def save_drafter(model: torch.nn.Module, cfg, path: str | Path, config_file: str) -> None:
    """Write ``model``'s state dict and its config dataclass ``cfg`` under ``path``."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()},
              str(path / WEIGHTS_FILE))
    (path / config_file).write_text(json.dumps(asdict(cfg), indent=2))


def load_drafter(model_cls, cfg_cls, path: str | Path, config_file: str, format_version: int,
                 what: str, dtype: torch.dtype = torch.float32, device="cpu"):
    """Build ``model_cls(cfg_cls(**config))`` from ``path`` -> frozen, eval-mode, on
    ``device``/``dtype``."""
    from safetensors.torch import load_file

    path = Path(path)
    cfg_file, w_file = path / config_file, path / WEIGHTS_FILE
    for f in (cfg_file, w_file):
        if not f.is_file():
            raise FileNotFoundError(f"{what} file missing: {f}")
    raw = json.loads(cfg_file.read_text())
    if raw.get("format_version") != format_version:
        raise ValueError(f"{cfg_file}: unsupported {what} format_version "
                         f"{raw.get('format_version')}")
    model = model_cls(cfg_cls(**raw))
    try:
        state = load_file(str(w_file))
    except Exception as e:
        raise ValueError(f"corrupt {what} weights {w_file}: {e}") from e
    model.load_state_dict(state, strict=True)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)
