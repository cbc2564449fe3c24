"""Finding and loading targets (dart_ray.models.loading / args): config parsing per family, clear
errors for unsupported or broken checkpoints, GGUF handling, and the cached embedded default."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from conftest import FAMILIES, tiny_hf_config

from dart_ray.models import (
    ModelArgs,
    ModelLoadError,
    UnsupportedModelError,
    load_target,
    resolve_model_dir,
    torch_dtype,
)
from dart_ray.models.loading import (
    DEFAULT_MODEL_ID,
    MODEL_ID_FILE,
    gguf_model_id,
    model_id_for,
    read_model_args,
)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def hf_dict(family: str, **overrides) -> dict:
    """The config.json transformers would write for a tiny model of ``family``."""
    return tiny_hf_config(family, **overrides).to_dict()


def copy_dir(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ----------------------------------------------------------------------------------------------
# ModelArgs from HF configs
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_args_from_saved_checkpoint(family, tiny_dirs):
    a = read_model_args(tiny_dirs[family])
    assert a.model_type == family
    assert (a.vocab_size, a.hidden_size, a.intermediate_size) == (49152, 64, 128)
    assert (a.num_layers, a.num_heads, a.num_kv_heads) == (4, 4, 2)
    assert a.head_dim == (16 if family == "qwen3" else 64 // 4)
    assert a.rms_norm_eps == pytest.approx(1e-6)
    assert a.rope_scaling is None
    assert not a.tie_word_embeddings
    assert a.qkv_bias == (family == "qwen2")
    assert not a.o_bias
    assert a.qk_norm == (family == "qwen3")
    assert a.sliding_window is None
    assert a.eos_token_ids == (2,) and a.bos_token_id == 1
    assert a.default_taps == (2, 2, 1)  # {2, L//2, L-3} for L=4


def test_args_variants():
    a = ModelArgs.from_hf_config(hf_dict("llama", tie_word_embeddings=True, attention_bias=True))
    assert a.tie_word_embeddings and a.qkv_bias and a.o_bias
    # Qwen3 with attention_bias: q/k/v and o all carry a bias in transformers
    q3 = ModelArgs.from_hf_config(hf_dict("qwen3", attention_bias=True))
    assert q3.qkv_bias and q3.o_bias and q3.qk_norm
    # Qwen2: q/k/v bias always, never on o
    q2 = ModelArgs.from_hf_config(hf_dict("qwen2"))
    assert q2.qkv_bias and not q2.o_bias and not q2.qk_norm
    # head_dim not a divisor of hidden/heads (Qwen3 style)
    q3 = hf_dict("qwen3")
    q3["head_dim"] = 32
    assert ModelArgs.from_hf_config(q3).head_dim == 32
    # eos as a list
    assert ModelArgs.from_hf_config(hf_dict("llama", eos_token_id=[2, 5])).eos_token_ids == (2, 5)
    # GQA default: no num_key_value_heads -> MHA
    cfg = hf_dict("llama")
    cfg["num_key_value_heads"] = None
    assert ModelArgs.from_hf_config(cfg).num_kv_heads == 4


def test_args_rope_parsing():
    l3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64, "rope_theta": 500000.0}
    a = ModelArgs.from_hf_config(hf_dict("llama", rope_parameters=l3))
    assert a.rope_theta == 500000.0
    assert a.rope_scaling["rope_type"] == "llama3" and a.rope_scaling["factor"] == 8.0
    assert "rope_theta" not in a.rope_scaling
    # transformers-4 style config.json: rope_theta at top level, rope_scaling with "type"
    legacy = {k: v for k, v in hf_dict("llama").items() if k != "rope_parameters"}
    legacy.update(rope_theta=123.0, rope_scaling={"type": "linear", "factor": 2.0})
    b = ModelArgs.from_hf_config(legacy)
    assert b.rope_theta == 123.0 and b.rope_scaling == {"type": "linear", "factor": 2.0,
                                                        "rope_type": "linear"}
    legacy["rope_scaling"] = None
    c = ModelArgs.from_hf_config(legacy)
    assert c.rope_theta == 123.0 and c.rope_scaling is None
    with pytest.raises(UnsupportedModelError, match="yarn"):
        ModelArgs.from_hf_config(hf_dict("llama",
                                         rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                                    "rope_theta": 1e4}))


def test_args_sliding_window():
    m = hf_dict("llama")
    m.update(model_type="mistral", sliding_window=4096)
    assert ModelArgs.from_hf_config(m).sliding_window == 4096
    q = hf_dict("qwen2")
    q.update(sliding_window=4096, use_sliding_window=False)
    assert ModelArgs.from_hf_config(q).sliding_window is None
    q["use_sliding_window"] = True
    assert ModelArgs.from_hf_config(q).sliding_window == 4096


@pytest.mark.parametrize("change, word", [
    ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "gpt2"),
    ({"hidden_act": "gelu"}, "gelu"),
    ({"mlp_bias": True}, "mlp_bias"),
])
def test_unsupported_configs(change, word):
    cfg = hf_dict("llama")
    cfg.update(change)
    with pytest.raises(UnsupportedModelError, match=word):
        ModelArgs.from_hf_config(cfg)


def test_args_validation():
    with pytest.raises(ValueError, match="divisible"):
        ModelArgs.from_hf_config(hf_dict("llama", num_key_value_heads=3))


# ----------------------------------------------------------------------------------------------
# load errors
# ----------------------------------------------------------------------------------------------


def test_gpt2_directory_is_unsupported(tmp_path):
    d = tmp_path / "gpt2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2",
                                               "architectures": ["GPT2LMHeadModel"], "n_embd": 768,
                                               "n_layer": 12, "vocab_size": 50257}))
    with pytest.raises(UnsupportedModelError) as ei:
        load_target(str(d), "fp32")
    msg = str(ei.value)
    assert "gpt2" in msg and "GPT2LMHeadModel" in msg
    assert "llama" in msg and "qwen3" in msg          # says what *is* supported
    assert str(d / "config.json") in msg              # and which file
    assert isinstance(ei.value, ValueError)


def test_missing_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ModelLoadError, match="does not exist") as ei:
        load_target(str(missing))
    assert str(missing) in str(ei.value)
    assert issubclass(ModelLoadError, RuntimeError)


def test_directory_without_config(tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="config.json"):
        resolve_model_dir(d)


def test_plain_file_is_not_a_model(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError, match="gguf"):
        resolve_model_dir(f)


def test_corrupt_config(tmp_path, tiny_dirs):
    d = copy_dir(tiny_dirs["llama"], tmp_path / "m")
    (d / "config.json").write_text('{"model_type": "llama", "hidden_size": ')
    with pytest.raises(ModelLoadError) as ei:
        load_target(str(d), "fp32")
    assert str(d / "config.json") in str(ei.value)


def test_config_missing_field(tmp_path, tiny_dirs):
    d = copy_dir(tiny_dirs["llama"], tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    del cfg["num_hidden_layers"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="num_hidden_layers"):
        load_target(str(d), "fp32")


def test_corrupt_safetensors(tmp_path, tiny_dirs):
    d = copy_dir(tiny_dirs["qwen2"], tmp_path / "m")
    (d / "model.safetensors").write_bytes(b"\x13\x37garbage, not a safetensors header" * 50)
    with pytest.raises(ModelLoadError) as ei:
        load_target(str(d), "fp32")
    assert str(d / "model.safetensors") in str(ei.value)


def test_truncated_safetensors(tmp_path, tiny_dirs):
    d = copy_dir(tiny_dirs["llama"], tmp_path / "m")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_target(str(d), "fp32")


def test_no_weights(tmp_path, tiny_dirs):
    d = copy_dir(tiny_dirs["llama"], tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_target(str(d), "fp32")


def test_missing_tensor(tmp_path, tiny_dirs):
    from safetensors.torch import load_file, save_file

    d = copy_dir(tiny_dirs["llama"], tmp_path / "m")
    state = load_file(str(d / "model.safetensors"))
    name = next(k for k in state if k.endswith("layers.1.self_attn.k_proj.weight"))
    del state[name]
    save_file(state, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="k_proj"):
        load_target(str(d), "fp32")


def test_bad_gguf_magic(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("DART_RAY_CACHE", str(cache))
    g = tmp_path / "model.Q4_0.gguf"
    g.write_bytes(b"GGML" + bytes(range(256)) * 4)
    with pytest.raises(ModelLoadError, match="magic") as ei:
        load_target(str(g))
    assert str(g) in str(ei.value)
    # a directory holding just that GGUF resolves to it, and fails the same way
    with pytest.raises(ModelLoadError, match="magic"):
        resolve_model_dir(tmp_path)
    assert not any(p.name.endswith(".complete") for p in cache.rglob("*"))


def test_corrupt_gguf_body_leaves_no_cache(tmp_path, monkeypatch):
    """Right magic, garbage after it: a ModelLoadError naming the file, and no half-written
    cache."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("DART_RAY_CACHE", str(cache))
    g = tmp_path / "broken.gguf"
    g.write_bytes(b"GGUF" + torch.randint(0, 256, (2048,),
                                          generator=torch.Generator().manual_seed(0))
                  .to(torch.uint8).numpy().tobytes())
    with pytest.raises(ModelLoadError) as ei:
        resolve_model_dir(g)
    assert str(g) in str(ei.value)
    leftovers = [p for p in (cache / "gguf").iterdir() if not p.name.endswith(".lock")]
    assert leftovers == []


def test_torch_dtype():
    assert torch_dtype("bf16") is torch.bfloat16
    assert torch_dtype("float16") is torch.float16
    assert torch_dtype(torch.float32) is torch.float32
    with pytest.raises(ValueError, match="fp32"):
        torch_dtype("int8")


def test_gguf_model_id():
    assert gguf_model_id(Path("SmolLM2-135M-Instruct.Q4_1.gguf")) == "SmolLM2-135M-Instruct"
    assert gguf_model_id(Path("Llama-3.2-1B-Instruct-Q8_0.gguf")) == "Llama-3.2-1B-Instruct"
    assert gguf_model_id(Path("qwen2.5-0.5b-instruct-fp16.gguf")) == "qwen2.5-0.5b-instruct"
    assert gguf_model_id(Path("plain.gguf")) == "plain"


# ----------------------------------------------------------------------------------------------
# successful loads
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype, want", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_load_tiny(tiny_dirs, dtype, want):
    tgt = load_target(str(tiny_dirs["qwen3"]), dtype, max_seq_len=64)
    assert tgt.model_id == "qwen3"                    # directory name when nothing is recorded
    assert tgt.model_dir == tiny_dirs["qwen3"]
    assert tgt.args.qk_norm
    params = list(tgt.model.parameters())
    assert all(p.dtype == want and p.device.type == "cpu" and not p.requires_grad for p in params)
    assert not tgt.model.training
    assert tgt.model.layers[0].attn.q_norm is not None


def test_load_tied(tmp_path, smollm_dir):
    from conftest import make_tiny_checkpoint

    d = make_tiny_checkpoint(tmp_path / "tied", "llama", smollm_dir, seed=3,
                             tie_word_embeddings=True)
    tgt = load_target(str(d), "fp32", max_seq_len=64)
    assert tgt.args.tie_word_embeddings
    assert tgt.model.lm_head.weight is tgt.model.embed.weight


def test_default_model_is_cached(smollm_dir, smollm_fp32):
    d = resolve_model_dir(None)
    assert d == smollm_dir == resolve_model_dir("default")
    assert (d / ".complete").is_file() and (d / "config.json").is_file()
    assert (d / MODEL_ID_FILE).read_text().strip() == DEFAULT_MODEL_ID == "SmolLM2-135M-Instruct"
    assert model_id_for(d) == DEFAULT_MODEL_ID
    assert smollm_fp32.model_id == DEFAULT_MODEL_ID
    a = smollm_fp32.args
    shape = (a.model_type, a.num_layers, a.hidden_size, a.num_heads, a.num_kv_heads)
    assert shape == ("llama", 30, 576, 9, 3)
    assert a.tie_word_embeddings
    t0 = time.perf_counter()
    again = load_target(None, "fp32")
    dt = time.perf_counter() - t0
    assert dt < 5.0, f"second load of the cached default took {dt:.1f}s"
    assert again.model_id == DEFAULT_MODEL_ID
    assert torch.equal(again.model.layers[3].mlp.down.weight,
                       smollm_fp32.model.layers[3].mlp.down.weight)


def test_default_tokenizer_chat_template(smollm_fp32):
    tok = smollm_fp32.tokenizer
    assert tok.chat_template
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi!"}], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    text = tok.decode(ids)
    assert "<|im_start|>user" in text and text.rstrip().endswith("<|im_start|>assistant")
    assert smollm_fp32.args.vocab_size >= len(tok) - 1
