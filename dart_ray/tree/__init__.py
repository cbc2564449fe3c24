"""Token trees: the data structure and the N-gram-pruned beam search that builds them."""

from dart_ray.tree.tree import TokenTree, ancestor_mask, chain_tree, empty_tree, pack_trees

__all__ = ["TokenTree", "ancestor_mask", "chain_tree", "empty_tree", "pack_trees"]
