"""Shared fixtures: tiny random Llama-family checkpoints (saved by transformers, so they double as
oracles) and the real SmolLM2 default (converted once into a session cache)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

# Keep test caches inside the repo-independent tmp dir unless the user set one.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

TINY_VOCAB = 49152  # SmolLM2's tokenizer is reused for the tiny models

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def tiny_hf_config(family: str, **overrides):
    import transformers as tf

    common = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=2, bos_token_id=1,
                  pad_token_id=2)
    common.update(overrides)
    if family == "llama":
        cfg = tf.LlamaConfig(**common)
    elif family == "mistral":
        cfg = tf.MistralConfig(**{"sliding_window": None, **common})
    elif family == "qwen2":
        cfg = tf.Qwen2Config(**common)
    elif family == "qwen3":
        cfg = tf.Qwen3Config(head_dim=16, **common)
    else:
        raise ValueError(family)
    return cfg


def spread_weights(model: torch.nn.Module, std: float, bias_std: float) -> None:
    """Random weights with more spread than an init, so logits are not all near-ties: matrices
    N(0, std), biases N(0, bias_std), norm scales U(0.8, 1.2)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)
            elif "bias" in name:
                p.normal_(0.0, bias_std)
            else:
                p.uniform_(0.8, 1.2)


def make_tiny_checkpoint(out: Path, family: str, tokenizer_dir: Path | None, seed: int = 0,
                         **overrides) -> Path:
    """Save a random HF model of ``family`` (and SmolLM2's tokenizer) into ``out``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_hf_config(family, **overrides)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    spread_weights(model, 0.08, 0.05)
    model.save_pretrained(str(out), safe_serialization=True)
    if tokenizer_dir is not None:
        for f in tokenizer_dir.iterdir():
            if (f.name.startswith("tokenizer")
                    or f.name in ("special_tokens_map.json", "chat_template.jinja")):
                shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="session")
def smollm_dir() -> Path:
    """The embedded default, converted to safetensors once (cached across sessions)."""
    from dart_ray.models import resolve_model_dir

    return resolve_model_dir(None)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory, smollm_dir) -> dict[str, Path]:
    """family -> directory of a tiny random checkpoint with SmolLM2's tokenizer."""
    root = tmp_path_factory.mktemp("tiny")
    return {fam: make_tiny_checkpoint(root / fam, fam, smollm_dir, seed=i)
            for i, fam in enumerate(FAMILIES)}


@pytest.fixture(scope="session")
def smollm_fp32(smollm_dir):
    from dart_ray.models import load_target

    return load_target(str(smollm_dir), "fp32", max_seq_len=1024)


def save_random_baselines(target, root: Path, seed: int = 0,
                          draft_vocab: int = 4096) -> dict[str, Path]:
    """Random-weight EAGLE / Medusa / SpS drafters for ``target`` (a LoadedTarget), saved under
    ``root``: method -> directory. Used by the exactness tests (any drafter must be lossless)."""
    import torch

    from dart_ray.drafters.dart_model import DartConfig, DartModel
    from dart_ray.drafters.medusa_model import MedusaConfig, MedusaModel
    from dart_ray.drafters.sps_model import SpsConfig, SpsModel

    g = torch.Generator().manual_seed(seed)
    args, mid = target.args, target.model_id
    d2t = torch.randperm(args.vocab_size, generator=g)[:draft_vocab].sort().values
    eagle = DartModel(DartConfig.for_target(args, mid, depth=4, arch="eagle",
                                            draft_vocab=draft_vocab,
                                            tie_head=False)).init_random(seed)
    eagle.d2t.copy_(d2t)
    medusa = MedusaModel(MedusaConfig.for_target(args, mid, depth=4, draft_vocab=draft_vocab))
    medusa.init_from_target(target.model, d2t)
    sps_cfg = SpsConfig.for_target(args, mid, num_layers=1, init_layers=(0,),
                                   draft_vocab=draft_vocab, max_depth=5)
    sps = SpsModel(sps_cfg).init_from_target(target.model, d2t)
    with torch.no_grad():
        for blk in medusa.blocks:
            blk.weight.normal_(0, 0.05, generator=g)
    out = {}
    for name, model in (("eagle", eagle), ("medusa", medusa), ("sps", sps)):
        model.save(root / name)
        out[name] = root / name
    return out


@pytest.fixture(scope="session")
def tiny_baselines(tiny_dirs, tmp_path_factory) -> dict[str, Path]:
    """Random EAGLE / Medusa / SpS drafters for the tiny llama target."""
    from dart_ray.models import load_target

    target = load_target(str(tiny_dirs["llama"]), "fp32", max_seq_len=512)
    return save_random_baselines(target, tmp_path_factory.mktemp("baselines"))


COST_GRID_B, COST_GRID_T = [1, 2, 4, 8, 16], [1, 2, 3, 5, 9, 17, 33, 65]
"""Batch sizes and tokens per row of the synthetic cost models the controller tests use."""


def flat_cost(seconds: float = 0.02):
    """A cost model whose every verify forward takes ``seconds`` (controller tests)."""
    from dart_ray.engine.cost import CostModel

    return CostModel.from_function(lambda b, t: seconds, COST_GRID_B, COST_GRID_T)


MIXED_PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef add(a, b):",
    "The quick brown fox jumps over the lazy dog. The quick brown",
    "Hello",
    "1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3",
]
"""Engine tests' prompts: a copy, prose, a one-word prompt and a repeating sequence."""


@contextlib.contextmanager
def local_ray(prefix: str):
    """A 2-CPU in-process Ray for one test module; reuses a Ray already started in this process."""
    import ray

    if ray.is_initialized():
        yield
        return
    tmp = tempfile.mkdtemp(prefix=prefix, dir="/tmp")           # short: Ray's socket paths must fit
    from dart_ray import init_ray

    init_ray(num_cpus=2, include_dashboard=False, _temp_dir=tmp, logging_level="WARNING")
    try:
        yield
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a server a test starts)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
