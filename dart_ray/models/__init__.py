"""Target models: loading (HF dir / GGUF / embedded default) and the own Llama-family forward."""

from dart_ray.model_ref import ModelLoadError, default_gguf_path
from dart_ray.models.args import SUPPORTED_MODEL_TYPES, ModelArgs, UnsupportedModelError
from dart_ray.models.llama import ForwardOutput, Transformer
from dart_ray.models.loading import (
    LoadedTarget,
    cache_root,
    load_target,
    load_tokenizer,
    resolve_model_dir,
    torch_dtype,
)

__all__ = [
    "SUPPORTED_MODEL_TYPES", "ModelArgs", "UnsupportedModelError", "ForwardOutput", "Transformer",
    "LoadedTarget", "ModelLoadError", "cache_root", "default_gguf_path", "load_target",
    "load_tokenizer", "resolve_model_dir", "torch_dtype",
]
