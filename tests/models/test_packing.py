"""CPU weight packing (oneDNN prepacked linears): same function, same model, inference only."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dart_ray.models.packing import PackedLinear, pack_linears, packing_supported

needs_packing = pytest.mark.skipif(not packing_supported("cpu", torch.bfloat16),
                                   reason="this CPU/torch build has no oneDNN bf16 support")


def test_supported_for_cpu_bf16_and_fp32_where_measured(monkeypatch):
    from dart_ray.models import packing

    assert not packing_supported("cpu", torch.float16)
    assert not packing_supported("meta", torch.bfloat16)
    assert not packing_supported("meta", torch.float32)
    # fp32: only where this machine measures packed faster (AVX2 EPYC yes, AMX Xeon no)
    monkeypatch.setattr(packing, "fp32_packing_helps", lambda: False)
    assert not packing_supported("cpu", torch.float32)
    monkeypatch.setattr(packing, "fp32_packing_helps", lambda: True)
    assert packing_supported("cpu", torch.float32) == torch.backends.mkldnn.is_available()


def test_fp32_packing_decision_is_measured_and_cached(tmp_path, monkeypatch):
    from dart_ray.models import packing

    monkeypatch.setenv("DART_RAY_CACHE", str(tmp_path))
    calls = []

    def fake():
        calls.append(1)
        return {"dense_1": 1.0, "dense_9": 3.0, "packed_1": 1.1, "packed_9": 1.5}

    monkeypatch.setattr(packing, "measure_fp32_packing", fake)
    assert packing.fp32_packing_helps() and packing.fp32_packing_helps()
    assert len(calls) == 1                                            # cached per fingerprint


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")
@pytest.mark.parametrize("rows", [1, 2, 9, 64])
def test_packed_fp32_linear_matches_dense(rows):
    torch.manual_seed(rows)
    lin = nn.Linear(96, 200, bias=True)
    x = torch.randn(2, rows, 96)
    with torch.inference_mode():
        torch.testing.assert_close(PackedLinear.from_linear(lin)(x), lin(x), rtol=1e-5, atol=1e-5)


@needs_packing
@pytest.mark.parametrize("rows", [1, 7, 64, 130])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_dense(rows, bias):
    torch.manual_seed(rows)
    lin = nn.Linear(96, 200, bias=bias).to(torch.bfloat16)
    x = torch.randn(2, rows, 96, dtype=torch.bfloat16)              # [B, T, in]
    want = F.linear(x.float(), lin.weight.float(), None if lin.bias is None else lin.bias.float())
    packed = PackedLinear.from_linear(lin)
    with torch.inference_mode():
        got = packed(x)
    assert got.shape == (2, rows, 200) and got.dtype == torch.bfloat16
    # bf16 output rounding only (inputs are exact bf16; accumulation is fp32 in both)
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=2e-2)
    torch.testing.assert_close(packed.weight, lin.weight, rtol=0, atol=0)


@needs_packing
def test_packed_linear_refuses_autograd():
    packed = PackedLinear.from_linear(nn.Linear(8, 8).to(torch.bfloat16))
    x = torch.randn(1, 8, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(RuntimeError, match="inference-only"):
        packed(x)


@needs_packing
def test_pack_model_same_logits_tied_head_kept(tiny_dirs):
    from dart_ray.models import load_target

    tgt = load_target(tiny_dirs["llama"], "bf16", "cpu", 256)
    ref = load_target(tiny_dirs["llama"], "bf16", "cpu", 256).model
    model = tgt.model
    n_linear = sum(type(m) is nn.Linear for m in model.modules())
    assert pack_linears(model) == n_linear and n_linear > 0
    assert pack_linears(model) == 0                                   # idempotent
    assert not any(type(m) is nn.Linear for m in model.modules())
    tokens = torch.randint(0, 1000, (2, 9))
    pos = torch.arange(9).expand(2, 9)
    outs = []
    for m in (ref, model):
        cache = m.new_cache(2, 64)
        outs.append(m(tokens, pos, None, cache, starts=[0, 0]).logits.float())
    torch.testing.assert_close(outs[1], outs[0], rtol=0.05, atol=0.05)
    assert (outs[1].argmax(-1) == outs[0].argmax(-1)).float().mean() > 0.9

    tied = load_target(tiny_dirs["llama"], "bf16", "cpu", 256)
    tied.model.lm_head.weight = tied.model.embed.weight
    pack_linears(tied.model)
    assert tied.model.lm_head.weight is tied.model.embed.weight       # tied: no copy is made


@needs_packing
def test_engine_packs_bf16_and_refuses_fp16(tiny_dirs):
    from dart_ray import Engine, EngineConfig, SamplingParams

    eng = Engine.from_config(EngineConfig(model=str(tiny_dirs["llama"]), method="none",
                                          dtype="bf16", max_batch_size=2, max_seq_len=128))
    assert isinstance(eng.model.layers[0].attn.qkv, PackedLinear)
    out = eng.generate(["Hello there", "def f(x):"],
                       SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert [len(c.token_ids) for c in out] == [6, 6]
    dart = Engine.from_config(EngineConfig(model=str(tiny_dirs["llama"]), method="dart",
                                           drafter="random", ngram="none", dtype="bf16",
                                           max_batch_size=2, max_seq_len=128))
    assert isinstance(dart.drafter.model.fc, PackedLinear)       # the drafter's own linears too
    out = dart.generate(["Hello there", "def f(x):"],
                        SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert [len(c.token_ids) for c in out] == [6, 6]
    off = Engine.from_config(EngineConfig(model=str(tiny_dirs["llama"]), method="none",
                                          dtype="bf16", max_batch_size=1, max_seq_len=128,
                                          pack_weights=False))
    assert type(off.model.layers[0].attn.qkv) is nn.Linear
    with pytest.raises(ValueError, match="pack_weights"):
        Engine.from_config(EngineConfig(model=str(tiny_dirs["llama"]), method="none", dtype="fp16",
                                        max_batch_size=1, max_seq_len=128, pack_weights=True))


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")
def test_warm_packed_calls_one_linear_per_shape_at_every_row_count(monkeypatch):
    """oneDNN builds a kernel per (weight shape, rows) on first use: one module per distinct shape
    is run at each row count (layers of equal shape share kernels), nothing else is touched."""
    from dart_ray.models.packing import warm_packed

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 48, bias=False), nn.Linear(32, 48, bias=False),
                        nn.Linear(48, 32, bias=True))
    other = nn.Sequential(nn.Linear(32, 48, bias=False), nn.Linear(16, 8, bias=False))
    pack_linears(net)
    pack_linears(other)
    seen: list[tuple[int, int, int]] = []
    forward = PackedLinear.forward

    def spy(self, x):
        seen.append((id(self), *x.shape))
        return forward(self, x)

    monkeypatch.setattr(PackedLinear, "forward", spy)
    assert warm_packed([net, other], range(1, 4)) == 9              # 3 shapes x 3 row counts
    assert {s[0] for s in seen} == {id(net[0]), id(net[2]), id(other[1])}
    assert sorted(s[1] for s in seen if s[0] == id(net[2])) == [1, 2, 3]
    assert all(s[2] == m.in_features for s in seen
               for m in (net[0], net[2], other[1]) if s[0] == id(m))
    assert warm_packed([nn.Linear(4, 4)]) == 0                       # nothing packed: no calls
