"""Drafters behind one interface (see :mod:`dart_ray.drafters.base`) and the factory that builds them."""

from __future__ import annotations

from pathlib import Path

from dart_ray.drafters.base import BatchView, Drafter, NoDrafter

__all__ = ["ARTIFACT_NAMES", "BatchView", "Drafter", "NoDrafter", "make_drafter", "default_artifact_dir"]

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


ARTIFACT_NAMES = {"dart": "drafter", "eagle": "eagle", "medusa": "medusa", "sps": "sps"}
"""Subdirectory of ``dart_ray/artifacts/<model_id>/`` holding each method's shipped weights."""

_CONFIG_FILES = {"dart": "dart_config.json", "eagle": "dart_config.json", "medusa": "medusa_config.json",
                 "sps": "sps_config.json"}


def _drafter_dir(config, target) -> Path:
    path = Path(config.drafter) if config.drafter else \
        default_artifact_dir(target.model_id) / ARTIFACT_NAMES[config.method]
    if not (path / _CONFIG_FILES[config.method]).is_file():
        raise FileNotFoundError(
            f"no {config.method} drafter at {path}; train one with `dart-ray train-drafter --arch "
            f"{config.method}`, pass drafter=PATH" + (", or drafter='random' for an untrained drafter"
                                                      if config.method in ("dart", "eagle") else ""))
    return path


def make_drafter(config, target) -> Drafter:
    """Build the drafter that ``config.method`` names for ``target`` (a LoadedTarget)."""
    from dart_ray.models.loading import torch_dtype

    if config.method == "none":
        return NoDrafter()
    dtype = torch_dtype(config.dtype)
    head = target.model.lm_head.weight
    if config.method == "ngram":
        from dart_ray.drafters.ngram import NGramDrafter
        return NGramDrafter(_load_ngram(config, target))
    if config.method in ("dart", "eagle"):
        from dart_ray.drafters.dart import DartDrafter
        from dart_ray.drafters.dart_model import DartConfig, DartModel
        from dart_ray.drafters.eagle import EagleDrafter

        if config.drafter == "random":
            cfg = DartConfig.for_target(target.args, target.model_id, arch=config.method)
            model = DartModel(cfg).init_random(config.seed)
            model = model.to(device=config.device, dtype=dtype).eval().requires_grad_(False)
        else:
            model = DartModel.load(_drafter_dir(config, target), dtype=dtype, device=config.device)
        model.cfg.check_target(target.args, target.model_id)
        if model.cfg.arch != config.method:
            raise ValueError(f"drafter {config.drafter} is a {model.cfg.arch!r} drafter, not {config.method!r}")
        if config.method == "eagle":
            return EagleDrafter(model, target.model.embed, head)
        return DartDrafter(model, target.model.embed, head, _load_ngram(config, target))
    if config.method == "medusa":
        from dart_ray.drafters.medusa import MedusaDrafter
        from dart_ray.drafters.medusa_model import MedusaModel

        model = MedusaModel.load(_drafter_dir(config, target), dtype=dtype, device=config.device)
        model.cfg.check_target(target.args, target.model_id)
        return MedusaDrafter(model, _load_ngram(config, target))
    if config.method == "sps":
        from dart_ray.drafters.sps import SpsDrafter
        from dart_ray.drafters.sps_model import SpsModel

        model = SpsModel.load(_drafter_dir(config, target), dtype=dtype, device=config.device)
        model.cfg.check_target(target.args, target.model_id)
        return SpsDrafter(model, target.model.embed, head)
    raise ValueError(f"unknown method {config.method!r}")
