"""Drafters behind one interface (see :mod:`dart_ray.drafters.base`) and the factory that builds them."""

from __future__ import annotations

from pathlib import Path

from dart_ray.drafters.base import BatchView, Drafter, NoDrafter

__all__ = ["BatchView", "Drafter", "NoDrafter", "make_drafter", "default_artifact_dir"]

ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"


def default_artifact_dir(model_id: str) -> Path:
    """Where the shipped drafter/N-gram model for a target live (``dart_ray/artifacts/<id>``)."""
    return ARTIFACTS / model_id


def _load_ngram(config, target):
    from dart_ray.ngram import NGramModel

    if config.ngram == "none":
        return None
    path = Path(config.ngram) if config.ngram else default_artifact_dir(target.model_id) / "ngram"
    if config.ngram is None and not path.is_dir():
        return None  # nothing shipped for this target: tree search runs without the N-gram term
    return NGramModel.load(path)


def make_drafter(config, target) -> Drafter:
    """Build the drafter that ``config.method`` names for ``target`` (a LoadedTarget)."""
    import torch

    from dart_ray.models.loading import torch_dtype

    if config.method == "none":
        return NoDrafter()
    ngram = _load_ngram(config, target)
    if config.method == "ngram":
        from dart_ray.drafters.ngram import NGramDrafter
        return NGramDrafter(ngram)
    if config.method == "dart":
        from dart_ray.drafters.dart import DartDrafter
        from dart_ray.drafters.dart_model import DartConfig, DartModel

        dtype = torch_dtype(config.dtype)
        if config.drafter == "random":
            model = DartModel(DartConfig.for_target(target.args, target.model_id)).init_random(config.seed)
            model = model.to(device=config.device, dtype=dtype).eval().requires_grad_(False)
        else:
            path = Path(config.drafter) if config.drafter else default_artifact_dir(target.model_id) / "drafter"
            if not (path / "dart_config.json").is_file():
                raise FileNotFoundError(
                    f"no DART drafter at {path}; train one with `dart-ray train-drafter`, pass "
                    "drafter=PATH, or drafter='random' for an untrained drafter")
            model = DartModel.load(path, dtype=dtype, device=config.device)
        model.cfg.check_target(target.args, target.model_id)
        return DartDrafter(model, target.model.embed, target.model.lm_head.weight, ngram)
    raise ValueError(f"unknown method {config.method!r}")
