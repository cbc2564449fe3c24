"""Token-id N-gram model (counts with backoff) used to prune DART draft trees.

``NGramModel`` holds the counts as sorted numpy arrays (saved as ``.npy`` + ``meta.json``,
memory-mapped on load); ``build_ngram`` / ``iter_texts`` build one from a text corpus
(``python -m dart_ray.ngram.build --help``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dart_ray.ngram.model import NGramModel

if TYPE_CHECKING:
    from dart_ray.ngram.build import build_ngram, build_ngram_cli, iter_texts

__all__ = ["NGramModel", "build_ngram", "build_ngram_cli", "iter_texts"]

_BUILD_NAMES = ("build_ngram", "build_ngram_cli", "iter_texts")


def __getattr__(name: str) -> Any:
    # Lazy so that ``python -m dart_ray.ngram.build`` does not import the module twice.
    if name in _BUILD_NAMES:
        from dart_ray.ngram import build

        return getattr(build, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
