"""Additive tree-attention masks and the KV-cache commit on hand-made inputs."""

import torch

from dart_ray.kv_cache import KVCache
from dart_ray.masks import attention_mask, causal_ancestors
from dart_ray.tree import TokenTree, ancestor_mask, chain_tree, pack_trees


def test_ancestor_mask_by_hand():
    # root(0) -> 1 -> 3 ; root -> 2 ; 1 -> 4
    parents = torch.tensor([[-1, 0, 0, 1, 1]])
    depths = torch.tensor([[0, 1, 1, 2, 2]])
    anc = ancestor_mask(parents, depths)[0].int().tolist()
    assert anc == [[1, 0, 0, 0, 0],
                   [1, 1, 0, 0, 0],
                   [1, 0, 1, 0, 0],
                   [1, 1, 0, 1, 0],
                   [1, 1, 0, 0, 1]]


def test_attention_mask_rows_with_different_starts():
    anc = causal_ancestors(2)
    m = attention_mask([3, 1], anc, 5, torch.float32)   # [2, 1, 2, 5]
    vis = (m == 0)[:, 0].int().tolist()
    # row 0: committed slots 0..2, new tokens at 3, 4
    assert vis[0] == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    # row 1: committed slot 0, new at 1, 2; slots 3, 4 are beyond its block
    assert vis[1] == [[1, 1, 0, 0, 0], [1, 1, 1, 0, 0]]
    assert torch.isinf(m[m != 0]).all()


def test_pack_trees_and_chain_validate():
    t = pack_trees(torch.tensor([7, 8]), [([1, 2, 3], [0, 1, 1]), ([4], [0])])
    t.validate()
    assert t.depths.tolist() == [[0, 1, 2, 2], [0, 1, 1, 1]]
    assert t.valid.tolist() == [[True] * 4, [True, True, False, False]]
    c = chain_tree(torch.tensor([1]), torch.tensor([[5, 6, 7]]))
    c.validate()
    bad = TokenTree(c.tokens, torch.tensor([[-1, 0, 2, 1]]), c.depths, c.valid)
    try:
        bad.validate()
    except ValueError:
        pass
    else:
        raise AssertionError("a child before its parent must be rejected")


def test_cache_commit_moves_path_slots():
    c = KVCache(num_layers=2, max_batch=2, num_kv_heads=1, max_seq_len=16, head_dim=1,
                dtype=torch.float32)
    c.lengths = [2, 4]
    s_used = c.begin_write(slice(0, 2), 5)
    assert s_used == 9
    vals = torch.arange(10, dtype=torch.float32).view(2, 1, 5, 1)          # [B, H, T, D]
    for layer in range(2):
        c.write(layer, vals + 100 * layer, vals, s_used)
    c.commit(slice(0, 2), torch.tensor([[0, 2, 4], [0, 1, 3]]), [3, 2])
    assert c.lengths == [5, 6]
    assert c.k[1, 0, 0, 2:5, 0].tolist() == [100, 102, 104]
    assert c.v[0, 1, 0, 4:6, 0].tolist() == [5, 6]
    c.move_row(1, 0)
    assert c.lengths == [6, 0] and c.v[0, 0, 0, 4:6, 0].tolist() == [5, 6]
