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
    check_model,
    gguf_model_id,
    gguf_rope_scaling,
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


def _transformers_window(family: str, cfg: dict) -> int | None:
    """The window transformers' own config, read back from ``cfg``, slides some layer over."""
    import transformers as tf

    c = {"llama": tf.LlamaConfig, "mistral": tf.MistralConfig, "qwen2": tf.Qwen2Config,
         "qwen3": tf.Qwen3Config}[family](**{k: v for k, v in cfg.items() if k != "model_type"})
    if family == "mistral":
        return c.sliding_window
    types = getattr(c, "layer_types", None) or []
    return c.sliding_window if "sliding_attention" in types else None


@pytest.mark.parametrize("family, change", [
    ("mistral", {"sliding_window": 100}), ("mistral", {"sliding_window": None}),
    ("mistral", "drop"),                                   # key absent: Mistral's default, 4096
    ("llama", {"sliding_window": 100}),                    # Llama has none: the key is ignored
    ("qwen2", {"sliding_window": 100, "use_sliding_window": False}),
    ("qwen2", {"sliding_window": 100, "use_sliding_window": True, "max_window_layers": 2}),
    ("qwen2", {"sliding_window": 100, "use_sliding_window": True, "max_window_layers": 4}),
    ("qwen3", {"sliding_window": 100, "use_sliding_window": True, "max_window_layers": 0}),
    ("qwen3", {"sliding_window": 100, "use_sliding_window": True}),    # default 28 layers >= 4
])
def test_args_sliding_window_is_the_one_transformers_slides_over(family, change):
    """The engine caps a request at a window only where transformers slides some layer over it
    (checked against transformers' own config of the same config.json)."""
    if change == "drop":
        cfg = {k: v for k, v in hf_dict(family).items() if k not in ("sliding_window",
                                                                       "layer_types")}
    else:
        cfg = {k: v for k, v in hf_dict(family).items() if k != "layer_types"}
        cfg.update(change)
    want = _transformers_window(family, cfg)
    assert ModelArgs.from_hf_config(cfg).sliding_window == want
    if family == "mistral" and change == "drop":
        assert want == 4096
    # a config.json written by transformers names its layers' types: read as transformers reads it
    saved = {**hf_dict(family, **({} if change == "drop" else change)), "model_type": family}
    assert ModelArgs.from_hf_config(saved).sliding_window == _transformers_window(family, saved)


def test_args_refuse_quantised_checkpoints_and_read_rope_scaling_first():
    """A quantised checkpoint would load its int/fp8 weights without their scales: refused. With
    both rope_scaling and rope_parameters, rope_scaling decides, as in transformers."""
    for qc in ({"quant_method": "fp8", "weight_block_size": [128, 128]},
               {"quant_method": "compressed-tensors"}, {"quant_method": "bitsandbytes"}):
        with pytest.raises(UnsupportedModelError, match=qc["quant_method"]):
            ModelArgs.from_hf_config(hf_dict("llama") | {"quantization_config": qc})
    both = hf_dict("llama") | {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    assert both["rope_parameters"]["rope_type"] == "default"
    a = ModelArgs.from_hf_config(both)
    assert a.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert a.rope_theta == both["rope_parameters"]["rope_theta"]
    with pytest.raises(UnsupportedModelError, match="yarn"):
        ModelArgs.from_hf_config(both | {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    # llama3 scaling without original_max_position_embeddings: the model's context, as
    # transformers reads it (it was 8192 whatever the context)
    l3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    for ctx in (2048, 131072):
        a = ModelArgs.from_hf_config(hf_dict("llama") | {"rope_scaling": l3,
                                                          "max_position_embeddings": ctx})
        assert a.rope_scaling["original_max_position_embeddings"] == ctx
    # "swish" is transformers' other name for SiLU
    assert ModelArgs.from_hf_config(hf_dict("llama") | {"hidden_act": "swish"})


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


def _q_proj(state: dict) -> str:
    return next(k for k in state if k.endswith("layers.0.self_attn.q_proj.weight"))


@pytest.mark.parametrize("change, words", [
    (lambda st: st.update({_q_proj(st): st[_q_proj(st)][:32]}), "shape .* do not match"),
    (lambda st: st.update({_q_proj(st) + "_scale": torch.ones(1)}), "quantisation tensors"),
    (lambda st: st.update({_q_proj(st): st[_q_proj(st)].to(torch.int8)}), "quantised or packed"),
])
def test_weights_that_do_not_fit_the_config_are_refused(tmp_path, tiny_dirs, change, words):
    """A tensor of another shape than config.json implies, a quantised checkpoint's scale
    tensors, integer weights: a ModelLoadError naming the tensor, never a torch traceback or
    weights loaded without their scales."""
    from safetensors.torch import load_file, save_file

    d = copy_dir(tiny_dirs["llama"], tmp_path / "m")
    state = load_file(str(d / "model.safetensors"))
    change(state)
    save_file(state, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=words):
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


def write_tiny_gguf(path: Path, tokenizer_fields: dict, arch: str = "llama",
                    rope_kv: dict | None = None, extra_tensors: dict | None = None,
                    drop: tuple[str, ...] = ()) -> Path:
    """A 1-layer random GGUF of ``arch`` with SmolLM2's tokenizer metadata (fp32 tensors);
    ``rope_kv``: further GGUFWriter calls (name -> value), ``drop``: tensors left out."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(0)
    hidden, ffn, heads, kv, vocab = 32, 64, 4, 2, 49152
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(hidden // heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    for name, value in (rope_kv or {}).items():         # a tuple: the call's arguments
        getattr(w, name)(*value) if isinstance(value, tuple) else getattr(w, name)(value)
    for name, value in tokenizer_fields.items():
        getattr(w, name)(value)
    hd = hidden // heads
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,),
              "output.weight": (vocab, hidden), "blk.0.attn_norm.weight": (hidden,),
              "blk.0.ffn_norm.weight": (hidden,), "blk.0.attn_q.weight": (heads * hd, hidden),
              "blk.0.attn_k.weight": (kv * hd, hidden), "blk.0.attn_v.weight": (kv * hd, hidden),
              "blk.0.attn_output.weight": (hidden, heads * hd),
              "blk.0.ffn_gate.weight": (ffn, hidden), "blk.0.ffn_up.weight": (ffn, hidden),
              "blk.0.ffn_down.weight": (hidden, ffn)}
    for name, shape in shapes.items():
        if name not in drop:
            w.add_tensor(name, rng.normal(0, 0.3, shape).astype(np.float32))
    for name, value in (extra_tensors or {}).items():
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def smollm_tokenizer_fields() -> dict:
    """GGUFWriter calls that copy the embedded GGUF's tokenizer (what a GGUF conversion needs)."""
    import gguf

    from dart_ray.models import default_gguf_path

    setters = {"tokens": "add_token_list", "token_type": "add_token_types",
               "merges": "add_token_merges", "model": "add_tokenizer_model",
               "pre": "add_tokenizer_pre", "bos_token_id": "add_bos_token_id",
               "eos_token_id": "add_eos_token_id", "padding_token_id": "add_pad_token_id"}
    fields = gguf.GGUFReader(str(default_gguf_path())).fields
    return {setter: fields[f"tokenizer.ggml.{key}"].contents() for key, setter in setters.items()
            if f"tokenizer.ggml.{key}" in fields}


def test_gguf_rope_scaling_kept_and_what_cannot_run_refused_before_converting(
        tmp_path, monkeypatch, smollm_tokenizer_fields):
    """transformers' GGUF conversion drops a linear RoPE scaling: it is written back, and the
    converted model is transformers' model with that scaling. An architecture this engine does not
    run, RoPE frequency factors (Llama 3.1+) or a scaling it does not convert are refused from the
    header, before an fp32 copy of the model lands in the cache."""
    import numpy as np
    from gguf import RopeScalingType
    from transformers import AutoModelForCausalLM

    cache = tmp_path / "cache"
    monkeypatch.setenv("DART_RAY_CACHE", str(cache))
    fields = smollm_tokenizer_fields
    lin = write_tiny_gguf(tmp_path / "lin.gguf", fields,
                          rope_kv={"add_rope_scaling_type": RopeScalingType.LINEAR,
                                   "add_rope_scaling_factor": 4.0})
    t = load_target(str(lin), "fp32", max_seq_len=64)
    assert t.args.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    hf = AutoModelForCausalLM.from_pretrained(str(t.model_dir), dtype=torch.float32).eval()
    ids = torch.arange(100, 140)[None]
    with torch.no_grad():
        want = hf(ids).logits[0]
        plain = write_tiny_gguf(tmp_path / "plain.gguf", fields)
        unscaled = AutoModelForCausalLM.from_pretrained(str(resolve_model_dir(plain)),
                                                        dtype=torch.float32)(ids).logits[0]
    from dart_ray.masks import attention_mask, causal_ancestors

    n = ids.shape[1]
    got = t.model(ids, torch.arange(n)[None], attention_mask([0], causal_ancestors(n), n,
                                                             torch.float32),
                  t.model.new_cache(1, 64)).logits[0]
    assert torch.allclose(got, want, atol=1e-4)
    assert (unscaled - want).abs().max() > 1e-2              # the scaling matters here

    # header-only checks need no tokenizer (reading SmolLM2's 49k tokens costs ~3 s a file)
    header = {}
    # as llama.cpp reads the header: the type defaults to linear, the factor may sit under the
    # old key (the 2023 converter's); a linear type without a factor (or 1) is no scaling
    for name, kv, want in (
            ("notype", {"add_rope_scaling_factor": 4.0}, {"rope_type": "linear", "factor": 4.0}),
            ("oldkey", {"add_float32": ("llama.rope.scale_linear", 4.0)},
             {"rope_type": "linear", "factor": 4.0}),
            ("nofactor", {"add_rope_scaling_type": RopeScalingType.LINEAR}, None)):
        g = write_tiny_gguf(tmp_path / f"{name}.gguf", header, rope_kv=kv)
        assert gguf_rope_scaling(g) == want, name

    before = set(p.name for p in (cache / "gguf").iterdir() if not p.name.endswith(".lock"))
    refused = {
        "gemma2": write_tiny_gguf(tmp_path / "g.gguf", header, arch="gemma2"),
        # transformers' conversion cannot run these (it failed after Ray had started)
        "'mistral'": write_tiny_gguf(tmp_path / "m.gguf", header, arch="mistral"),
        "head dim 32": write_tiny_gguf(tmp_path / "q3.gguf", header, arch="qwen3", rope_kv={
            "add_key_length": 32, "add_value_length": 32}),
        # converted, these loaded silently with random MLPs / without their biases
        "mixture-of-experts": write_tiny_gguf(tmp_path / "moe.gguf", header, rope_kv={
            "add_expert_count": 2, "add_expert_used_count": 1}),
        "attn_q.bias": write_tiny_gguf(tmp_path / "b.gguf", header, extra_tensors={
            "blk.0.attn_q.bias": np.zeros(32, np.float32)}),
        "rope_freqs": write_tiny_gguf(tmp_path / "f.gguf", header, extra_tensors={
            "rope_freqs.weight": np.ones(4, np.float32)}),
        "'yarn'": write_tiny_gguf(tmp_path / "y.gguf", header, rope_kv={
            "add_rope_scaling_type": RopeScalingType.YARN, "add_rope_scaling_factor": 4.0}),
    }
    for word, g in refused.items():
        with pytest.raises(UnsupportedModelError, match=word) as ei:
            load_target(str(g), "fp32")
        assert str(g) in str(ei.value)
    # an incomplete file (transformers initialised the missing weights randomly, and cached them)
    for name in ("blk.0.ffn_down.weight", "blk.0.attn_k.weight"):
        g = write_tiny_gguf(tmp_path / f"no-{name}.gguf", header, drop=(name,))
        with pytest.raises(ModelLoadError, match=f"missing tensors.*{name}"):
            check_model(str(g))
    after = set(p.name for p in (cache / "gguf").iterdir() if not p.name.endswith(".lock"))
    assert after == before


def test_weights_the_gguf_conversion_did_not_read_are_refused_not_cached(
        tmp_path, monkeypatch, smollm_tokenizer_fields):
    """Behind the header's tensor check: weights transformers' conversion reports missing (it
    initialises them randomly and only logs it) fail the load, and nothing is cached."""
    import dart_ray.models.loading as loading

    cache = tmp_path / "cache"
    monkeypatch.setenv("DART_RAY_CACHE", str(cache))
    monkeypatch.setattr(loading, "_check_gguf_tensors", lambda *a: None)
    g = write_tiny_gguf(tmp_path / "hole.gguf", smollm_tokenizer_fields,
                        drop=("blk.0.ffn_down.weight",))
    with pytest.raises(ModelLoadError, match="did not read 1 weights.*down_proj"):
        load_target(str(g), "fp32")
    assert not [p for p in (cache / "gguf").iterdir() if not p.name.startswith(".")]


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


def test_an_untied_config_without_its_head_is_refused(tmp_path, smollm_dir):
    """tie_word_embeddings false and no lm_head.weight (a base model saved without its head): it
    ran with the embedding as its head, silently (vLLM refuses it; transformers initialises a
    random head)."""
    from conftest import make_tiny_checkpoint
    from safetensors.torch import load_file, save_file

    d = make_tiny_checkpoint(tmp_path / "headless", "llama", smollm_dir, seed=4)
    for f in d.glob("*.safetensors"):
        state = load_file(str(f))
        state.pop("lm_head.weight", None)
        save_file(state, str(f))
    with pytest.raises(ModelLoadError, match="no lm_head.weight"):
        load_target(str(d), "fp32", max_seq_len=64)


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
