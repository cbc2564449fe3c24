"""Drafters behind one interface (see :mod:`dart_ray.drafters.base`) and the factory that builds
them.

Which drafter a method name means, which network it loads and where that is shipped come from the
method registry (:mod:`dart_ray.methods`); this factory has no per-method branches.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from dart_ray.drafters.base import BatchView, Drafter, NoDrafter
from dart_ray.methods import MethodSpec, get_method

__all__ = ["BatchView", "Drafter", "NoDrafter", "make_drafter", "default_artifact_dir",
           "drafter_dir"]

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
    model = NGramModel.load(path)
    check_ngram_target(model, target, path)
    return model


def check_ngram_target(model, target, path) -> None:
    """An N-gram model counts token ids of one tokenizer: one over a larger vocabulary than the
    target's proposes ids the target cannot embed (every step then failed with an IndexError):
    refused. One built for another target (``meta.target``) is allowed -- fine-tunes share their
    tokenizer -- with a warning."""
    V = int(target.args.vocab_size)
    if model.vocab_size > V:
        raise ValueError(f"N-gram model {path} counts a vocabulary of {model.vocab_size} tokens; "
                         f"the target {target.model_id} has {V}: it was built for another "
                         "tokenizer (dart-ray build-ngram makes one for this target)")
    built_for = model.meta.get("target")
    if built_for and built_for != target.model_id:
        warnings.warn(f"N-gram model {path} was built for {built_for}, the target is "
                      f"{target.model_id}: its counts help only if they share the tokenizer",
                      stacklevel=2)


def drafter_dir(spec: MethodSpec, drafter: str | None, model_id: str) -> Path:
    """The directory of ``spec``'s network: ``drafter`` if given, else the one shipped for
    ``model_id``."""
    path = Path(drafter) if drafter else default_artifact_dir(model_id) / spec.artifact_dir
    if not (path / spec.config_file).is_file():
        raise FileNotFoundError(
            f"no {spec.name} drafter at {path}; train one with `dart-ray train-drafter --arch "
            f"{spec.objective or spec.name}`, pass drafter=PATH"
            + (", or drafter='random' for an untrained drafter" if spec.random_model else ""))
    return path


def _load_model(spec: MethodSpec, config, target):
    """``spec``'s network for ``target``: loaded (or untrained for ``drafter="random"``),
    checked."""
    from dart_ray.models.loading import torch_dtype

    dtype = torch_dtype(config.dtype)
    if config.drafter == "random" and spec.random_model is not None:
        model = spec.random_model(config, target)
        model = model.to(device=config.device, dtype=dtype).eval().requires_grad_(False)
    else:
        model = spec.model_class().load(drafter_dir(spec, config.drafter, target.model_id),
                                        dtype=dtype, device=config.device)
    model.cfg.check_target(target.args, target.model_id)
    arch = getattr(model.cfg, "arch", spec.name)
    if arch != spec.name:
        raise ValueError(f"drafter {config.drafter} is a {arch!r} drafter, not {spec.name!r}")
    return model


def make_drafter(config, target) -> Drafter:
    """Build the drafter that ``config.method`` names for ``target`` (a LoadedTarget)."""
    spec = get_method(config.method)
    model = _load_model(spec, config, target) if spec.model else None
    ngram = _load_ngram(config, target) if spec.uses_ngram else None
    return spec.build(model, target, ngram)
