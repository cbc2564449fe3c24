"""The registry of drafting methods: one :class:`MethodSpec` per method, everything else derived.

``EngineConfig.method`` validation, the CLI ``--method`` choices, the drafter factory
(:func:`dart_ray.drafters.make_drafter`), shipped artifact locations, ``dart-ray ship`` and the
trainer's ``--arch`` list all read this registry; none restates the list of methods.

Adding a method is one new module (the :class:`~dart_ray.drafters.base.Drafter`, plus its network
if it has one) and one :func:`register` call below (docs/DESIGN.md, "Adding a method").

Importing this module imports nothing else from the project and builds nothing: a spec holds an
import path for its network class and a factory that imports its drafter when called.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["MethodSpec", "get_method", "method_names", "method_specs", "register", "unregister"]


@dataclass(frozen=True)
class MethodSpec:
    """Everything the project needs to know about one drafting method."""

    name: str
    """What ``EngineConfig.method``, ``--method`` and a request's ``speculative.method`` say."""

    build: Callable[[Any, Any, Any], Any]
    """``build(model, target, ngram) -> Drafter``: ``model`` is the loaded network (None without
    one), ``target`` the :class:`~dart_ray.models.loading.LoadedTarget`, ``ngram`` the corpus
    :class:`~dart_ray.ngram.NGramModel` or None. Imports its drafter module when called."""

    model: str | None = None
    """``"module:Class"`` of the trained network (None: the method has none). The class has
    ``load(path, dtype=, device=)`` and its ``cfg`` has ``check_target(args, model_id)``."""

    config_file: str | None = None
    """Name of the JSON config beside ``model.safetensors`` in a drafter directory."""

    artifact_dir: str | None = None
    """Subdirectory of ``dart_ray/artifacts/<model_id>/`` holding the shipped network."""

    objective: str | None = None
    """The ``dart-ray train-drafter --arch`` objective whose run produces the network
    (``TrainConfig.arch``); None: nothing to train."""

    uses_ngram: bool = False
    """The drafter takes the corpus N-gram model (``EngineConfig.ngram``; shipped one by
    default)."""

    random_model: Callable[[Any, Any], Any] | None = None
    """``random_model(config, target) -> network`` (float32, untrained) for ``drafter="random"``
    (tests and time splits); None: the method needs trained weights."""

    card_title: str = ""
    """Title of the model card ``dart-ray ship`` writes for a trained network."""

    def __post_init__(self) -> None:
        if not self.name or not self.name.isidentifier():
            raise ValueError(f"method name must be a non-empty identifier, got {self.name!r}")
        if self.model is not None and not (self.config_file and self.artifact_dir):
            raise ValueError(f"method {self.name!r}: a network needs config_file and artifact_dir")
        if (self.objective or self.random_model) and self.model is None:
            raise ValueError(f"method {self.name!r}: objective/random_model need a network "
                             "(model=)")

    def model_class(self) -> type:
        """The network class named by :attr:`model` (imported now)."""
        if self.model is None:
            raise ValueError(f"method {self.name!r} has no network")
        module, _, attr = self.model.partition(":")
        return getattr(importlib.import_module(module), attr)


_REGISTRY: dict[str, MethodSpec] = {}


def register(spec: MethodSpec) -> MethodSpec:
    """Add ``spec`` to the registry (a name can be registered once)."""
    if spec.name in _REGISTRY:
        raise ValueError(f"method {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    """Remove a method (tests and plugins that registered one)."""
    _REGISTRY.pop(name, None)


def get_method(name: str) -> MethodSpec:
    """The spec of ``name``; ValueError naming the registered methods if there is none."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; one of {method_names()}") from None


def method_names() -> tuple[str, ...]:
    """Registered method names, in registration order."""
    return tuple(_REGISTRY)


def method_specs() -> tuple[MethodSpec, ...]:
    """Registered specs, in registration order."""
    return tuple(_REGISTRY.values())


# ---------------------------------------------------------------------------------------------
# the built-in methods: factories import their drafter only when called
# ---------------------------------------------------------------------------------------------


def _build_dart(model, target, ngram):
    from dart_ray.drafters.dart import DartDrafter

    return DartDrafter(model, target.model.embed, target.model.lm_head.weight, ngram)


def _build_eagle(model, target, ngram):
    from dart_ray.drafters.eagle import EagleDrafter

    return EagleDrafter(model, target.model.embed, target.model.lm_head.weight)


def _build_medusa(model, target, ngram):
    from dart_ray.drafters.medusa import MedusaDrafter

    return MedusaDrafter(model, ngram)


def _build_sps(model, target, ngram):
    from dart_ray.drafters.sps import SpsDrafter

    return SpsDrafter(model, target.model.embed, target.model.lm_head.weight)


def _build_ngram(model, target, ngram):
    from dart_ray.drafters.ngram import NGramDrafter

    return NGramDrafter(ngram)


def _build_none(model, target, ngram):
    from dart_ray.drafters.base import NoDrafter

    return NoDrafter()


def _random_dart_model(config, target):
    """An untrained DART/EAGLE layer for ``target`` (``config.method`` picks the arch)."""
    from dart_ray.drafters.dart_model import DartConfig, DartModel

    cfg = DartConfig.for_target(target.args, target.model_id, arch=config.method)
    return DartModel(cfg).init_random(config.seed)


register(MethodSpec(
    "dart", _build_dart, model="dart_ray.drafters.dart_model:DartModel",
    config_file="dart_config.json", artifact_dir="drafter", objective="dart", uses_ngram=True,
    random_model=_random_dart_model, card_title="DART drafter and N-gram model"))
register(MethodSpec(
    "eagle", _build_eagle, model="dart_ray.drafters.dart_model:DartModel",
    config_file="dart_config.json", artifact_dir="eagle", objective="eagle",
    random_model=_random_dart_model, card_title="EAGLE-style drafter (baseline)"))
register(MethodSpec(
    "medusa", _build_medusa, model="dart_ray.drafters.medusa_model:MedusaModel",
    config_file="medusa_config.json", artifact_dir="medusa", objective="medusa", uses_ngram=True,
    card_title="Medusa heads (baseline)"))
register(MethodSpec(
    "sps", _build_sps, model="dart_ray.drafters.sps_model:SpsModel", config_file="sps_config.json",
    artifact_dir="sps", objective="sps", card_title="SpS draft model (baseline)"))
register(MethodSpec("ngram", _build_ngram, uses_ngram=True))
register(MethodSpec("none", _build_none))
