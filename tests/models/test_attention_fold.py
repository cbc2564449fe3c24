"""The CPU attention path folds each KV group's query heads into the query axis: it must equal
the plain grouped-query attention (every query head h reading KV head h // rep) under any mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dart_ray.kv_cache import KVCache
from dart_ray.masks import attention_mask
from dart_ray.models.args import ModelArgs
from dart_ray.models.llama import Attention, fold_mask
from dart_ray.models.rope import RopeCache


def _args(heads: int, kv: int) -> ModelArgs:
    return ModelArgs(model_type="llama", vocab_size=64, hidden_size=heads * 8, intermediate_size=32,
                     num_layers=1, num_heads=heads, num_kv_heads=kv, head_dim=8,
                     rms_norm_eps=1e-6, rope_theta=10000.0)


def test_fold_mask_rows_follow_the_folded_queries():
    m = torch.randn(2, 1, 3, 7)
    f = fold_mask(m, 4, 3)                                            # [2, 1, 12, 7]
    assert f.shape == (2, 1, 12, 7)
    for r in range(4):
        assert torch.equal(f[:, :, r * 3:(r + 1) * 3], m)
    assert fold_mask(f, 4, 3) is f                                    # folded once, passes through
    assert fold_mask(None, 4, 3) is None and fold_mask(m, 1, 3) is m
    one = torch.randn(2, 1, 1, 7)
    assert fold_mask(one, 4, 1) is one                                # one query broadcasts
    row = torch.randn(2, 1, 1, 7)
    assert fold_mask(row, 4, 3) is row                                # broadcasts over queries
    with pytest.raises(ValueError, match="one mask for every head"):
        fold_mask(torch.randn(2, 1, 5, 7), 4, 3)
    with pytest.raises(ValueError, match="one mask for every head"):
        fold_mask(torch.randn(2, 4, 3, 7), 4, 3)                      # per-head masks


@pytest.mark.parametrize("heads,kv", [(6, 2), (4, 1), (4, 4)])
@pytest.mark.parametrize("T", [1, 5])
def test_folded_attention_equals_grouped_query_attention(heads, kv, T):
    torch.manual_seed(0)
    args = _args(heads, kv)
    attn = Attention(args, 0).float()
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.3)
    B, past = 2, [4, 9]
    cache = KVCache(1, B, kv, 32, 8, torch.float32)
    cache.k.normal_()
    cache.v.normal_()
    cache.lengths[:] = past
    # a tree over the T new tokens per row: node j's parent is a random earlier node
    anc = torch.zeros(B, T, T, dtype=torch.bool)
    for b in range(B):
        for j in range(T):
            anc[b, j, j] = True
            if j:
                p = int(torch.randint(0, j, (1,)))
                anc[b, j] |= anc[b, p]
    s_used = cache.begin_write(slice(0, B), T, past)
    mask = attention_mask(past, anc, s_used, torch.float32)
    x = torch.randn(B, T, args.hidden_size)
    positions = torch.tensor(past)[:, None] + anc.sum(-1) - 1           # [B, T] depths
    cos, sin = RopeCache(args).gather(positions, x)
    out = attn(x, cos, sin, mask, cache, s_used)                      # the fold path (CPU)

    # reference: the same projections, K/V repeated per query head, plain SDPA
    q, k, v = attn.qkv(x).split(attn.split, dim=-1)
    from dart_ray.models.rope import apply_rope

    q = apply_rope(q.view(B, T, heads, 8).transpose(1, 2), cos, sin)
    keys, values = cache.k[0, :B, :, :s_used], cache.v[0, :B, :, :s_used]   # written by the call
    rep = heads // kv
    ref = F.scaled_dot_product_attention(q, keys.repeat_interleave(rep, 1),
                                         values.repeat_interleave(rep, 1), attn_mask=mask)
    ref = attn.o(ref.transpose(1, 2).reshape(B, T, -1))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
