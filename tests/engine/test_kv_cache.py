"""Tests of dart_ray.kv_cache.KVCache on hand-made values: writes at per-row starts, committing an
accepted tree path (and nothing else), per-row lengths, row management and bounds errors."""

from __future__ import annotations

import pytest
import torch

from dart_ray.kv_cache import KVCache

L, B_MAX, H, S, D = 2, 3, 2, 12, 1


def cache(max_seq_len: int = S) -> KVCache:
    return KVCache(num_layers=L, max_batch=B_MAX, num_kv_heads=H, max_seq_len=max_seq_len,
                   head_dim=D, dtype=torch.float32)


def new_kv(B: int, T: int, base: float = 0.0) -> torch.Tensor:
    """[B, H, T, D]: value = base + 100*b + 10*h + t + 1, so every slot says where it came from
    (and no written value is 0, the value of a slot never written)."""
    b = torch.arange(B).view(B, 1, 1, 1)
    h = torch.arange(H).view(1, H, 1, 1)
    t = torch.arange(1, T + 1).view(1, 1, T, 1)
    return (base + 100 * b + 10 * h + t).float()


def write_all_layers(c: KVCache, rows: slice, T: int, starts=None) -> int:
    """One forward's writes: layer l gets new_kv(base=1000*l) for keys, its negative for values."""
    s_used = c.begin_write(rows, T, starts)
    for layer in range(L):
        kv = new_kv(rows.stop - rows.start, T, 1000 * layer)
        c.write(layer, kv, -kv, s_used)
    return s_used


def slots(c: KVCache, row: int, layer: int = 0, head: int = 0, kind: str = "k") -> list[float]:
    t = c.k if kind == "k" else c.v
    return t[layer, row, head, :, 0].tolist()


def test_a_new_cache_is_zero_with_no_committed_tokens():
    c = cache()
    assert c.k.shape == c.v.shape == (L, B_MAX, H, S, D)
    assert c.lengths == [0, 0, 0] and c.max_batch == B_MAX and c.max_seq_len == S
    assert not c.k.any() and not c.v.any()
    assert c.device == torch.device("cpu")


def test_write_at_equal_starts_fills_the_block_and_returns_the_used_prefix():
    c = cache()
    c.lengths = [3, 3, 0]
    s_used = c.begin_write(slice(0, 2), 4)                 # starts default to the lengths
    assert s_used == 7
    keys, values = c.write(0, new_kv(2, 4), -new_kv(2, 4), s_used)
    assert keys.shape == values.shape == (2, H, 7, D)      # [B, H_kv, S_used, D]
    assert slots(c, 0)[:8] == [0, 0, 0, 1, 2, 3, 4, 0]
    assert slots(c, 1, head=1)[:8] == [0, 0, 0, 111, 112, 113, 114, 0]
    assert slots(c, 1, kind="v")[3:7] == [-101, -102, -103, -104]
    assert keys[1, 1, :, 0].tolist() == [0, 0, 0, 111, 112, 113, 114]
    assert not c.k[:, 2].any()                             # rows outside the write untouched
    assert c.lengths == [3, 3, 0]                          # writing commits nothing


def test_write_at_different_starts_puts_each_row_after_its_own_context():
    c = cache()
    c.lengths = [1, 4, 2]
    s_used = write_all_layers(c, slice(0, 3), 3)
    assert s_used == 4 + 3
    assert slots(c, 0)[:5] == [0, 1, 2, 3, 0]
    assert slots(c, 1)[:8] == [0, 0, 0, 0, 101, 102, 103, 0]
    assert slots(c, 2, layer=1, head=1)[:6] == [0, 0, 1211, 1212, 1213, 0]
    assert slots(c, 2, layer=1, kind="v")[2:5] == [-1201, -1202, -1203]


def test_explicit_starts_override_the_lengths():
    c = cache()
    c.lengths = [5, 5, 5]
    s_used = c.begin_write(slice(1, 3), 2, starts=[0, 3])
    assert s_used == 5
    c.write(0, new_kv(2, 2), new_kv(2, 2), s_used)
    assert slots(c, 1)[:3] == [1, 2, 0] and slots(c, 2)[:6] == [0, 0, 0, 101, 102, 0]
    assert not c.k[:, 0].any()


def test_commit_keeps_only_the_accepted_path_slots_in_order():
    c = cache()
    c.lengths = [2, 0, 3]
    write_all_layers(c, slice(0, 3), 5)                     # a root + 4 draft nodes per row
    # row 0 accepts nodes 0, 2, 3 (a path through a branch), row 1 nothing, row 2 nodes 0, 1
    path = torch.tensor([[0, 2, 3, 9], [0, 0, 0, 0], [0, 1, 7, 7]])   # padding ignored
    c.commit(slice(0, 3), path, [3, 0, 2])
    assert c.lengths == [5, 0, 5]
    assert slots(c, 0)[2:5] == [1, 3, 4]                   # slot 2+i <- slot 2+path[i]
    assert slots(c, 0, layer=1, head=1)[2:5] == [1011, 1013, 1014]
    assert slots(c, 0, kind="v")[2:5] == [-1, -3, -4]
    assert slots(c, 2, layer=1)[3:5] == [1201, 1202]       # a contiguous prefix stays in place


def test_rejected_slots_are_overwritten_by_the_next_write_not_rolled_back():
    c = cache()
    write_all_layers(c, slice(0, 1), 4)                     # slots 0..3 hold 1, 2, 3, 4
    c.commit(slice(0, 1), torch.tensor([[0, 3]]), [2])     # keep slots 0 and 3
    assert c.lengths[0] == 2 and slots(c, 0)[:4] == [1, 4, 3, 4]   # stale slots 2, 3 remain
    s_used = c.begin_write(slice(0, 1), 2)
    assert s_used == 4
    c.write(0, new_kv(1, 2, base=50), new_kv(1, 2, base=50), s_used)
    assert slots(c, 0)[:4] == [1, 4, 51, 52]


def test_commit_of_overlapping_offsets_reads_before_it_writes():
    c = cache()
    write_all_layers(c, slice(0, 1), 4)
    c.commit(slice(0, 1), torch.tensor([[1, 2, 3]]), [3])  # every kept slot moves down by one
    assert slots(c, 0)[:3] == [2, 3, 4] and c.lengths[0] == 3


def test_commit_on_a_row_slice_touches_only_those_rows():
    c = cache()
    c.lengths = [4, 1, 1]
    write_all_layers(c, slice(1, 3), 3)
    before = c.k[:, 0].clone()
    c.commit(slice(1, 3), torch.tensor([[0, 2], [0, 1]]), [2, 1])
    assert c.lengths == [4, 3, 2]
    assert torch.equal(c.k[:, 0], before)
    assert slots(c, 1)[1:3] == [1, 3]


def test_commit_all_and_row_management():
    c = cache()
    write_all_layers(c, slice(0, 3), 3)
    c.commit_all(slice(0, 3), [3, 1, 2])
    c.commit_all(slice(1, 2), [1])
    assert c.lengths == [3, 2, 2]
    c.move_row(2, 0)                                       # compaction: row 2's content to row 0
    assert c.lengths == [2, 2, 0]
    assert slots(c, 0)[:2] == [201, 202] and slots(c, 0, layer=1, kind="v")[:2] == [-1201, -1202]
    assert slots(c, 0)[2] == 3                             # beyond the length: stale, not copied
    c.move_row(2, 1)                                       # an empty row moves as an empty row
    assert c.lengths == [2, 0, 0]
    c.reset_row(0)
    assert c.lengths == [0, 0, 0]


def test_bounds_and_shape_errors():
    c = cache(max_seq_len=6)
    c.lengths = [4, 0, 0]
    with pytest.raises(ValueError, match="KV cache overflow: need 7 slots, max_seq_len is 6"):
        c.begin_write(slice(0, 2), 3)
    assert c.begin_write(slice(0, 2), 2) == 6              # exactly full is fine
    with pytest.raises(ValueError, match="starts has 1 entries for 2 rows"):
        c.begin_write(slice(0, 2), 1, starts=[0])
    with pytest.raises(ValueError, match="path/num do not match the rows"):
        c.commit(slice(0, 2), torch.zeros(2, 2, dtype=torch.long), [1])
    with pytest.raises(ValueError, match="path/num do not match the rows"):
        c.commit(slice(0, 2), torch.zeros(1, 2, dtype=torch.long), [1, 1])
    with pytest.raises(ValueError, match=r"path offsets \[1, 0\] must satisfy path\[i\] >= i"):
        c.commit(slice(1, 2), torch.tensor([[1, 0]]), [2])
    assert c.lengths == [4, 0, 0]
    with pytest.raises(ValueError, match="commit past max_seq_len"):
        c.commit(slice(0, 1), torch.tensor([[0, 1, 2]]), [3])
