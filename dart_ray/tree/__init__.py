"""Token trees: the data structure and the N-gram-pruned beam search that builds them."""

from dart_ray.tree.search import NGramScorer, build_trees, build_trees_with_scores
from dart_ray.tree.tree import (
    TokenTree,
    Trie,
    ancestor_mask,
    chain_tree,
    empty_tree,
    merge_paths,
    merge_tries,
    pack_trees,
    pack_tries,
    trie_from_paths,
)

__all__ = [
    "NGramScorer",
    "TokenTree",
    "Trie",
    "ancestor_mask",
    "build_trees",
    "build_trees_with_scores",
    "chain_tree",
    "empty_tree",
    "merge_paths",
    "merge_tries",
    "pack_tries",
    "pack_trees",
    "trie_from_paths",
]
