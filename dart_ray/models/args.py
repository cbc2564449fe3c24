"""Model shape for the supported Llama family, read from a HF ``config.json``."""

from __future__ import annotations

from dataclasses import dataclass, field

from dart_ray.model_ref import ModelLoadError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class UnsupportedModelError(ModelLoadError, ValueError):
    """The checkpoint's architecture is not one this engine implements (a ModelLoadError, so every
    command reports it as one; a ValueError, as before)."""


@dataclass(frozen=True)
class ModelArgs:
    """Everything the forward needs to know about a Llama-family checkpoint."""

    model_type: str
    """One of SUPPORTED_MODEL_TYPES."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    """None/"default", ``{"rope_type": "llama3", ...}`` or
    ``{"rope_type": "linear", "factor": f}``."""
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    """Bias on q/k/v projections (Qwen2; Llama's ``attention_bias``)."""
    o_bias: bool = False
    """Bias on the output projection (Llama ``attention_bias`` only)."""
    qk_norm: bool = False
    """RMSNorm over head_dim on q and k before RoPE (Qwen3)."""
    sliding_window: int | None = None
    """Mistral/Qwen sliding window; the engine caps sequences at this length instead of masking."""
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} not divisible by num_kv_heads "
                             f"{self.num_kv_heads}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")

    @property
    def default_taps(self) -> tuple[int, int, int]:
        """DART's tapped layers {2, L//2, L-3} (clamped for tiny test models)."""
        L = self.num_layers
        return (min(2, L - 1), L // 2, max(L - 3, 0))

    @classmethod
    def from_hf_config(cls, cfg: dict) -> ModelArgs:
        """Build from a parsed ``config.json``; unknown architectures raise
        UnsupportedModelError."""
        mt = cfg.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            archs = cfg.get("architectures")
            raise UnsupportedModelError(
                f"unsupported model_type {mt!r} (architectures={archs}); dart-ray supports "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}")
        if cfg.get("hidden_act", "silu") not in ("silu", "swish"):    # one function, two names
            raise UnsupportedModelError(f"unsupported hidden_act {cfg.get('hidden_act')!r}; "
                                        "expected 'silu'")
        if cfg.get("mlp_bias"):
            raise UnsupportedModelError("mlp_bias=True is not supported")
        quant = cfg.get("quantization_config")
        if quant:
            method = quant.get("quant_method") if isinstance(quant, dict) else quant
            raise UnsupportedModelError(
                f"quantised checkpoint (quant_method {method!r}) is not supported: its weights "
                "would load without their scales; pass the unquantised checkpoint, or a GGUF "
                "(dequantised on conversion)")
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        # rope_scaling first, as transformers reads it (a rope_scaling added to a v5 config wins)
        params = cfg.get("rope_parameters") or {}
        rope = cfg.get("rope_scaling") or params
        theta = rope.get("rope_theta", params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = None
        rtype = rope.get("rope_type", rope.get("type", "default"))
        if rtype not in (None, "default"):
            if rtype not in ("llama3", "linear"):
                raise UnsupportedModelError(f"unsupported rope scaling type {rtype!r} (supported: "
                                            "llama3, linear)")
            scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
            scaling["rope_type"] = rtype
            if rtype == "llama3":         # absent: the model's context, as transformers reads it
                scaling.setdefault("original_max_position_embeddings",
                                   cfg.get("max_position_embeddings", 8192))
        attention_bias = bool(cfg.get("attention_bias", False))
        sliding = _sliding_window(mt, cfg)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            model_type=mt,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=(mt == "qwen2") or (attention_bias and mt in ("llama", "qwen3")),
            o_bias=attention_bias and mt in ("llama", "qwen3"),
            qk_norm=(mt == "qwen3"),
            sliding_window=int(sliding) if sliding else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def _sliding_window(model_type: str, cfg: dict) -> int | None:
    """The window some layer of this checkpoint slides over, read as transformers reads it (None:
    every layer attends to the whole sequence). Llama has none (a ``sliding_window`` key is
    ignored); Mistral's defaults to 4096 when the key is absent; Qwen2/3 slide only with
    ``use_sliding_window``, and then only layers from ``max_window_layers`` on (or those
    ``layer_types`` names)."""
    if model_type == "mistral":
        return cfg.get("sliding_window", 4096)
    if model_type in ("qwen2", "qwen3"):
        window = cfg.get("sliding_window", 4096)
        if not cfg.get("use_sliding_window", False) or window is None:
            return None
        types = cfg.get("layer_types")
        if types is not None:
            slides = "sliding_attention" in types
        else:
            slides = cfg.get("max_window_layers", 28) < cfg["num_hidden_layers"]
        return window if slides else None
    return None
