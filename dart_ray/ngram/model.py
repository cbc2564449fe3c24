"""Token-id N-gram model used to prune DART draft trees (and by the N-gram-only drafter).

Storage
-------
Tokens are packed into int64 keys with ``TOKEN_BITS`` (20) bits per token, oldest token in the
most significant position, so an n-gram ``(t_1, ..., t_n)`` has key
``t_1 << 20*(n-1) | ... | t_n`` and the keys of one context ``(t_1..t_{n-1})`` are contiguous in
sorted order.  Orders 1..3 fit in 60 bits; higher orders raise ``ValueError``.

For every n in ``1..order`` the model holds

* ``ngram{n}_keys``   int64  [E_n]  sorted packed n-gram keys (context..., next token)
* ``ngram{n}_counts`` uint32 [E_n]  counts, parallel to the keys
* ``ngram{n}_rank``   uint32 [E_n]  permutation of ``0..E_n-1`` that orders entries by
  (context asc, count desc, token asc): the entries of one context occupy the same index range
  in the key order and the rank order, so the top-k continuations of a context are a slice.

and for every context length c in ``1..order-1``

* ``ctx{c}_keys``   int64  [C_c]  sorted packed context keys
* ``ctx{c}_totals`` uint64 [C_c]  total count of n-grams (n = c+1) starting with that context.

The unigram "context" total is ``unigram_total`` (the number of training tokens).

Probabilities
-------------
``P(t | ctx) = count(ctx, t) / total(ctx)`` for the longest suffix of ``ctx`` in which ``t`` was
seen with ``count >= min_count`` (backoff order-1 -> ... -> 1 -> unigram), else 0 (unseen).
``total(ctx)`` is always the *raw* total, computed before any pruning, so pruning at build time
with ``min_count=m`` and pruning at lookup time with ``min_count=m`` give identical results.
Context entries < 0 (or >= 2**20) mean "no token": a suffix containing one is skipped.

On disk (``save`` / ``load``): one ``.npy`` per array (``np.save``; loaded with
``mmap_mode='r'``, never pickle) plus ``meta.json``.
"""

from __future__ import annotations

import json
import mmap
import os
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

TOKEN_BITS: int = 20
TOKEN_LIMIT: int = 1 << TOKEN_BITS
TOKEN_MASK: int = TOKEN_LIMIT - 1
MAX_ORDER: int = 63 // TOKEN_BITS  # 3: packed keys must fit in a non-negative int64

FORMAT_NAME: str = "dart_ray.ngram"
FORMAT_VERSION: int = 1
META_FILE: str = "meta.json"

_U32_MAX: int = (1 << 32) - 1
_DEFAULT_CHUNK_TOKENS: int = 1 << 21


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------


def _check_order(order: int) -> None:
    if not isinstance(order, (int, np.integer)) or isinstance(order, bool):
        raise TypeError(f"order must be an int, got {type(order).__name__}")
    if order < 1:
        raise ValueError(f"order must be >= 1, got {order}")
    if order > MAX_ORDER:
        raise ValueError(
            f"order {order} not supported: packed keys use {TOKEN_BITS} bits per token and must "
            f"fit in int64, so order <= {MAX_ORDER}"
        )


def _check_min_count(min_count: int) -> None:
    if not isinstance(min_count, (int, np.integer)) or isinstance(min_count, bool):
        raise TypeError(f"min_count must be an int, got {type(min_count).__name__}")
    if min_count < 1:
        raise ValueError(f"min_count must be >= 1, got {min_count}")


def _check_vocab_size(vocab_size: int) -> None:
    if not 1 <= vocab_size <= TOKEN_LIMIT:
        raise ValueError(f"vocab_size must be in [1, {TOKEN_LIMIT}], got {vocab_size}")


def _read_meta(meta_path: Path) -> dict[str, Any]:
    """Validate ``meta.json`` of a saved model -> its settings (order, vocab_size, min_count,
    unigram_total, num_tokens_trained as ints; info as a dict). Errors name the file."""
    if not meta_path.is_file():
        raise FileNotFoundError(f"n-gram model metadata not found: {meta_path}")
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"corrupt n-gram metadata {meta_path}: {e}") from e
    if not isinstance(meta, dict):
        raise ValueError(  # noqa: TRY004 - corrupt file, not a bad argument
            f"corrupt n-gram metadata {meta_path}: not a JSON object"
        )
    if meta.get("format") != FORMAT_NAME:
        raise ValueError(f"{meta_path}: not an n-gram model (format={meta.get('format')!r})")
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{meta_path}: unsupported format_version {meta.get('format_version')!r} "
            f"(expected {FORMAT_VERSION})"
        )
    if meta.get("token_bits", TOKEN_BITS) != TOKEN_BITS:
        raise ValueError(f"{meta_path}: token_bits {meta.get('token_bits')} != {TOKEN_BITS}")
    try:
        out: dict[str, Any] = {
            k: int(meta[k])
            for k in ("order", "vocab_size", "min_count", "unigram_total", "num_tokens_trained")
        }
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"corrupt n-gram metadata {meta_path}: bad or missing {e}") from e
    try:
        _check_order(out["order"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"{meta_path}: {e}") from e
    out["info"] = meta.get("info") or {}
    if not isinstance(out["info"], dict):
        raise ValueError(  # noqa: TRY004 - corrupt file, not a bad argument
            f"corrupt n-gram metadata {meta_path}: 'info' is not an object"
        )
    return out


def _layout(order: int) -> dict[str, np.dtype[Any]]:
    """On-disk stem -> dtype of every array of an ``order`` model (see the module docstring)."""
    out: dict[str, np.dtype[Any]] = {}
    for n in range(1, order + 1):
        out[f"ngram{n}_keys"] = np.dtype(np.int64)
        out[f"ngram{n}_counts"] = np.dtype(np.uint32)
        out[f"ngram{n}_rank"] = np.dtype(np.uint32)
    for c in range(1, order):
        out[f"ctx{c}_keys"] = np.dtype(np.int64)
        out[f"ctx{c}_totals"] = np.dtype(np.uint64)
    return out


def _read_array(f: Path, dtype: np.dtype[Any], mmap_mode: str | None) -> np.ndarray:
    """One saved 1-D array of ``dtype`` (memory-mapped read-only with ``mmap_mode="r"``)."""
    if not f.is_file():
        raise FileNotFoundError(f"n-gram array file missing: {f}")
    try:
        arr = np.load(f, mmap_mode=mmap_mode, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise ValueError(f"corrupt n-gram array file {f}: {e}") from e
    if arr.dtype != dtype or arr.ndim != 1:
        raise ValueError(
            f"corrupt n-gram array file {f}: expected 1-D {dtype}, got {arr.ndim}-D {arr.dtype}"
        )
    return np.asarray(arr)  # plain ndarray view of the memmap (no copy)


def _pack(cols: np.ndarray) -> np.ndarray:
    """Pack token columns (oldest first) into int64 keys. cols: [M, c] int64 -> [M] int64."""
    m, c = cols.shape
    key = np.zeros(m, dtype=np.int64)  # [M]
    for j in range(c):
        key = (key << TOKEN_BITS) | cols[:, j]
    return key


def _merge_counts(
    a_keys: np.ndarray, a_counts: np.ndarray, b_keys: np.ndarray, b_counts: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Merge two (sorted unique keys, counts) tables, summing counts of equal keys."""
    keys = np.concatenate([a_keys, b_keys])  # [A+B] int64
    counts = np.concatenate([a_counts, b_counts])  # [A+B] int64
    # Two sorted runs: the stable sort (timsort) merges them in linear time.
    order = np.argsort(keys, kind="stable")
    keys = keys[order]
    counts = counts[order]
    if keys.size == 0:
        return keys, counts
    starts = np.flatnonzero(np.concatenate([[True], keys[1:] != keys[:-1]]))  # [U]
    return keys[starts], np.add.reduceat(counts, starts)


class _CountAccumulator:
    """Log-structured accumulation of (sorted unique key, count) tables.

    Each chunk's table is pushed on a stack; the top two are merged while the lower one is not
    more than twice the size of the upper one, so total merge work is O(N log N) overall.
    """

    def __init__(self) -> None:
        self._stack: list[tuple[np.ndarray, np.ndarray]] = []

    def add_keys(self, keys: np.ndarray) -> None:
        """Add raw (unsorted, repeated) keys. keys: [K] int64."""
        if keys.size == 0:
            return
        uniq, counts = np.unique(keys, return_counts=True)
        self._stack.append((uniq, counts.astype(np.int64)))
        while len(self._stack) >= 2 and self._stack[-2][0].size <= 2 * self._stack[-1][0].size:
            b = self._stack.pop()
            a = self._stack.pop()
            self._stack.append(_merge_counts(a[0], a[1], b[0], b[1]))

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        """Sorted unique keys [U] int64 and their counts [U] int64."""
        keys = np.zeros(0, dtype=np.int64)
        counts = np.zeros(0, dtype=np.int64)
        while self._stack:
            b_keys, b_counts = self._stack.pop()
            keys, counts = _merge_counts(b_keys, b_counts, keys, counts)
        return keys, counts


def _rank_by_count(keys: np.ndarray, counts: np.ndarray, ctx_len: int) -> np.ndarray:
    """Permutation ordering entries by (context asc, count desc, token asc). -> [E] uint32."""
    if keys.size > _U32_MAX:
        raise ValueError(f"too many n-gram entries for uint32 rank: {keys.size}")
    inv_count = np.uint64(_U32_MAX) - counts.astype(np.uint64)  # [E] smaller = more frequent
    if ctx_len > 0 and keys.size:
        ctx = keys >> TOKEN_BITS  # [E]
        # Dense context index (keys are sorted, so contexts are contiguous and ascending).
        dense = np.cumsum(np.concatenate([[0], ctx[1:] != ctx[:-1]]), dtype=np.uint64)  # [E]
        if int(dense[-1]) >= 1 << 31:
            raise ValueError(f"too many contexts for rank encoding: {int(dense[-1]) + 1}")
        composite = (dense << np.uint64(32)) | inv_count  # [E]
    else:
        composite = inv_count  # [E]
    # Keys are sorted by (context, token), so a stable sort on (context, -count) breaks count
    # ties by ascending token id.
    rank = np.argsort(composite, kind="stable")
    return rank.astype(np.uint32)


def _find_mmap(arr: np.ndarray) -> bool:
    """True if arr's memory ultimately comes from an mmap."""
    base: Any = arr
    while base is not None:
        if isinstance(base, mmap.mmap):
            return True
        base = getattr(base, "base", None) if isinstance(base, np.ndarray) else None
    return False


# ----------------------------------------------------------------------------------------------
# model
# ----------------------------------------------------------------------------------------------


class NGramModel:
    """Token-id N-gram counts with backoff; see the module docstring for layout and semantics.

    Build with :meth:`from_sequences` (or :func:`dart_ray.ngram.build_ngram`), persist with
    :meth:`save` / :meth:`load`.  Query with :meth:`prob`, :meth:`log_prob`, :meth:`lookup` and
    :meth:`top_next`; all take contexts as ``[M, order-1]`` int64 arrays (oldest token first).
    """

    def __init__(
        self,
        *,
        order: int,
        vocab_size: int,
        ngram_keys: list[np.ndarray],
        ngram_counts: list[np.ndarray],
        ngram_rank: list[np.ndarray],
        ctx_keys: list[np.ndarray],
        ctx_totals: list[np.ndarray],
        unigram_total: int,
        min_count: int = 1,
        num_tokens_trained: int | None = None,
        meta: dict[str, Any] | None = None,
    ) -> None:
        """Low-level constructor from already-built arrays (index n-1 holds order n, index c-1
        holds context length c). Prefer :meth:`from_sequences` / :meth:`load`."""
        _check_order(order)
        _check_min_count(min_count)
        _check_vocab_size(vocab_size)
        self.order: int = int(order)
        self.vocab_size: int = int(vocab_size)
        self.min_count: int = int(min_count)
        self.unigram_total: int = int(unigram_total)
        self.num_tokens_trained: int = (
            int(num_tokens_trained) if num_tokens_trained is not None else int(unigram_total)
        )
        self.meta: dict[str, Any] = dict(meta or {})
        self._keys: list[np.ndarray] = list(ngram_keys)  # [E_n] int64 each
        self._counts: list[np.ndarray] = list(ngram_counts)  # [E_n] uint32 each
        self._rank: list[np.ndarray] = list(ngram_rank)  # [E_n] uint32 each
        self._ctx_keys: list[np.ndarray] = list(ctx_keys)  # [C_c] int64 each
        self._ctx_totals: list[np.ndarray] = list(ctx_totals)  # [C_c] uint64 each
        self._check_tables()

    def _check_tables(self) -> None:
        """The count tables fit ``order``: one 1-D keys/counts/rank triple per n, one keys/totals
        pair per context length, equal lengths within each."""
        order = self.order
        for name, lst, want in (
            ("ngram_keys", self._keys, order),
            ("ngram_counts", self._counts, order),
            ("ngram_rank", self._rank, order),
            ("ctx_keys", self._ctx_keys, order - 1),
            ("ctx_totals", self._ctx_totals, order - 1),
        ):
            if len(lst) != want:
                raise ValueError(
                    f"{name}: expected {want} arrays for order {order}, got {len(lst)}"
                )
        for n, (k, c, r) in enumerate(zip(self._keys, self._counts, self._rank, strict=True), 1):
            if not (k.ndim == c.ndim == r.ndim == 1 and k.shape == c.shape == r.shape):
                raise ValueError(
                    f"order {n}: keys/counts/rank lengths differ: {k.shape} {c.shape} {r.shape}"
                )
        for c, (k, t) in enumerate(zip(self._ctx_keys, self._ctx_totals, strict=True), 1):
            if not (k.ndim == t.ndim == 1 and k.shape == t.shape):
                raise ValueError(
                    f"context length {c}: keys/totals lengths differ: {k.shape} {t.shape}"
                )

    # ------------------------------------------------------------------ properties / info

    @property
    def context_len(self) -> int:
        """Number of context tokens used (order - 1)."""
        return self.order - 1

    @property
    def num_entries(self) -> list[int]:
        """Stored n-gram entries per order, index n-1 for order n."""
        return [int(k.size) for k in self._keys]

    @property
    def is_mmap(self) -> bool:
        """True if the (non-empty) arrays are memory-mapped from disk."""
        arrays = [a for a in self._arrays().values() if a.size > 0]
        return bool(arrays) and all(_find_mmap(a) for a in arrays)

    def _arrays(self) -> dict[str, np.ndarray]:
        """All arrays by their on-disk stem."""
        out: dict[str, np.ndarray] = {}
        for n in range(1, self.order + 1):
            out[f"ngram{n}_keys"] = self._keys[n - 1]
            out[f"ngram{n}_counts"] = self._counts[n - 1]
            out[f"ngram{n}_rank"] = self._rank[n - 1]
        for c in range(1, self.order):
            out[f"ctx{c}_keys"] = self._ctx_keys[c - 1]
            out[f"ctx{c}_totals"] = self._ctx_totals[c - 1]
        return out

    def size_bytes(self) -> int:
        """Bytes held by the count arrays (on disk or in memory)."""
        return int(sum(a.nbytes for a in self._arrays().values()))

    def __repr__(self) -> str:
        return (
            f"NGramModel(order={self.order}, vocab_size={self.vocab_size}, "
            f"entries={self.num_entries}, min_count={self.min_count}, "
            f"tokens={self.num_tokens_trained}, size={self.size_bytes() / 2**20:.2f} MB"
            f"{', mmap' if self.is_mmap else ''})"
        )

    # ------------------------------------------------------------------ building

    @classmethod
    def from_sequences(
        cls,
        seqs: Iterable[Sequence[int] | np.ndarray],
        order: int = 3,
        min_count: int = 1,
        *,
        vocab_size: int,
        progress: bool = False,
        meta: dict[str, Any] | None = None,
        chunk_tokens: int = _DEFAULT_CHUNK_TOKENS,
    ) -> NGramModel:
        """Count n-grams (n = 1..order) inside each sequence; n-grams never cross sequences.

        Sequences are concatenated into chunks of about ``chunk_tokens`` tokens; each chunk's
        packed keys are reduced with ``np.unique`` and merged into running tables. Entries with
        count < ``min_count`` are dropped after counting (context totals keep the raw counts).
        ``meta`` (e.g. ``{"tokenizer": ..., "target": ...}``) is stored in ``meta.json``.
        """
        _check_order(order)
        _check_min_count(min_count)
        _check_vocab_size(vocab_size)
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")

        accs = [_CountAccumulator() for _ in range(order)]
        pending: list[np.ndarray] = []
        pending_tokens = 0
        num_seqs = 0

        it: Iterable[Sequence[int] | np.ndarray] = seqs
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(seqs, desc="n-gram counting", unit="seq")
            it = bar

        def flush() -> None:
            nonlocal pending, pending_tokens
            if pending:
                cls._count_chunk(pending, order, vocab_size, accs)
            pending = []
            pending_tokens = 0

        try:
            for seq in it:
                arr = np.asarray(seq, dtype=np.int64)  # [L]
                if arr.ndim != 1:
                    raise ValueError(f"sequence {num_seqs} must be 1-D, got shape {arr.shape}")
                num_seqs += 1
                if arr.size == 0:
                    continue
                pending.append(arr)
                pending_tokens += arr.size
                if pending_tokens >= chunk_tokens:
                    flush()
            flush()
        finally:
            if bar is not None:
                bar.close()

        keys_per_n: list[np.ndarray] = []
        counts_per_n: list[np.ndarray] = []
        rank_per_n: list[np.ndarray] = []
        ctx_keys: list[np.ndarray] = []
        ctx_totals: list[np.ndarray] = []
        unigram_total = 0
        for n in range(1, order + 1):
            keys, counts = accs[n - 1].result()  # [U] int64, [U] int64
            if counts.size and int(counts.max()) > _U32_MAX:
                raise ValueError(f"order-{n} count {int(counts.max())} overflows uint32")
            if n == 1:
                unigram_total = int(counts.sum())
            else:
                # Raw context totals (before pruning); contexts are contiguous in sorted keys.
                ctx = keys >> TOKEN_BITS  # [U]
                if ctx.size:
                    starts = np.flatnonzero(np.concatenate([[True], ctx[1:] != ctx[:-1]]))
                    c_keys = ctx[starts]  # [C]
                    c_totals = np.add.reduceat(counts, starts)  # [C]
                    c_max = np.maximum.reduceat(counts, starts)  # [C]
                    keep_ctx = c_max >= min_count
                    c_keys, c_totals = c_keys[keep_ctx], c_totals[keep_ctx]
                else:
                    c_keys = np.zeros(0, dtype=np.int64)
                    c_totals = np.zeros(0, dtype=np.int64)
                ctx_keys.append(np.ascontiguousarray(c_keys, dtype=np.int64))
                ctx_totals.append(np.ascontiguousarray(c_totals, dtype=np.uint64))
            keep = counts >= min_count
            keys, counts = keys[keep], counts[keep]
            keys_per_n.append(np.ascontiguousarray(keys, dtype=np.int64))
            counts_per_n.append(np.ascontiguousarray(counts, dtype=np.uint32))
            rank_per_n.append(_rank_by_count(keys, counts, n - 1))

        full_meta = dict(meta or {})
        full_meta.setdefault("num_sequences", num_seqs)
        return cls(
            order=order,
            vocab_size=vocab_size,
            ngram_keys=keys_per_n,
            ngram_counts=counts_per_n,
            ngram_rank=rank_per_n,
            ctx_keys=ctx_keys,
            ctx_totals=ctx_totals,
            unigram_total=unigram_total,
            min_count=min_count,
            num_tokens_trained=unigram_total,
            meta=full_meta,
        )

    @staticmethod
    def _count_chunk(
        arrays: list[np.ndarray], order: int, vocab_size: int, accs: list[_CountAccumulator]
    ) -> None:
        """Count all n-grams of one chunk of sequences into the accumulators."""
        lengths = np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays))  # [S]
        buf = np.concatenate(arrays)  # [T] int64
        lo, hi = int(buf.min()), int(buf.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(
                f"token ids must be in [0, vocab_size={vocab_size}), got range [{lo}, {hi}]"
            )
        total = buf.size
        ends = np.cumsum(lengths)  # [S]
        # Tokens remaining after each position within its own sequence.
        remaining = np.repeat(ends, lengths) - np.arange(1, total + 1)  # [T]
        for n in range(1, order + 1):
            num = total - n + 1
            if num <= 0:
                continue
            key = buf[:num].copy()  # [num]
            for j in range(1, n):
                key = (key << TOKEN_BITS) | buf[j : j + num]
            if n > 1:
                key = key[remaining[:num] >= n - 1]  # drop n-grams crossing a sequence boundary
            accs[n - 1].add_keys(key)

    # ------------------------------------------------------------------ querying

    def _prep_ctx(self, ctx: np.ndarray | Sequence[Sequence[int]], m: int | None) -> np.ndarray:
        """Normalise ctx to [M, order-1] int64 with invalid entries set to -1.

        Wider contexts use their last order-1 columns; narrower ones are left-padded with -1.
        """
        arr = np.asarray(ctx, dtype=np.int64)
        if arr.ndim != 2:
            raise ValueError(f"ctx must be 2-D [M, {self.context_len}], got shape {arr.shape}")
        if m is not None and arr.shape[0] != m:
            raise ValueError(f"ctx has {arr.shape[0]} rows but tokens has {m}")
        c = self.context_len
        if arr.shape[1] > c:
            arr = arr[:, arr.shape[1] - c :]
        elif arr.shape[1] < c:
            pad = np.full((arr.shape[0], c - arr.shape[1]), -1, dtype=np.int64)
            arr = np.concatenate([pad, arr], axis=1)
        bad = (arr < 0) | (arr >= TOKEN_LIMIT)
        if bad.any():
            arr = np.where(bad, -1, arr)
        return arr  # [M, order-1]

    def _backoff(
        self,
        cx: np.ndarray,
        todo: np.ndarray,
        probe: Callable[[int, np.ndarray, np.ndarray], np.ndarray],
    ) -> tuple[np.ndarray, np.ndarray]:
        """The backoff shared by every query: try the longest context first, then shorter ones.

        For n = order .. 1, the rows still in ``todo`` (updated in place) whose last n-1 context
        tokens are all present are offered to ``probe(n, idx [R], ctx_key [R]) -> hit [R] bool``
        (``ctx_key``: their packed length-(n-1) contexts, zeros for n = 1); a hit row is resolved
        at order n and leaves ``todo``. Returns level [M] (the order used, 0 = unresolved) and
        total [M] (the raw total of the resolving context, 0 = unresolved) as int64.
        """
        m = cx.shape[0]
        level = np.zeros(m, dtype=np.int64)  # [M]
        total = np.zeros(m, dtype=np.int64)  # [M]
        for n in range(self.order, 0, -1):
            c = n - 1
            if self._keys[n - 1].size == 0:
                continue
            rows = todo.copy()
            if c > 0:
                rows &= (cx[:, self.context_len - c :] >= 0).all(axis=1)
            idx = np.flatnonzero(rows)  # [R]
            if idx.size == 0:
                continue
            if c > 0:
                ctx_key = _pack(cx[idx, self.context_len - c :])  # [R]
            else:
                ctx_key = np.zeros(idx.size, dtype=np.int64)  # [R]
            hit = probe(n, idx, ctx_key)  # [R]
            if not hit.any():
                continue
            hidx = idx[hit]  # [H]
            level[hidx] = n
            total[hidx] = self._context_totals(c, ctx_key[hit])
            todo[hidx] = False
        return level, total

    def _context_totals(self, c: int, ctx_key: np.ndarray) -> np.ndarray:
        """Raw totals [H] int64 of stored length-``c`` contexts (c = 0: the unigram total)."""
        if c == 0:
            return np.full(ctx_key.size, self.unigram_total, dtype=np.int64)
        ck = self._ctx_keys[c - 1]
        cpos = np.searchsorted(ck, ctx_key)  # [H]
        # Every stored entry has its context stored; fail loudly on a corrupt model.
        cpos_c = np.minimum(cpos, max(ck.size - 1, 0))
        if ck.size == 0 or not np.array_equal(ck[cpos_c], ctx_key):
            raise ValueError(f"corrupt n-gram model: order-{c + 1} context missing")
        return self._ctx_totals[c - 1][cpos_c].astype(np.int64)

    def lookup(
        self,
        ctx: np.ndarray,
        tokens: np.ndarray,
        min_count: int = 1,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Backoff lookup of ``tokens`` after ``ctx``.

        Args:
            ctx: [M, order-1] int64, oldest first; entries < 0 mean "no token".
            tokens: [M] int64 next tokens.
            min_count: entries with count < min_count are treated as unseen.

        Returns:
            counts [M] int64 (0 if unseen), totals [M] int64 (0 if unseen), and
            level [M] int64 = the n-gram order used (context length + 1), 0 if unseen.
        """
        _check_min_count(min_count)
        tok = np.asarray(tokens, dtype=np.int64)  # [M]
        if tok.ndim != 1:
            raise ValueError(f"tokens must be 1-D [M], got shape {tok.shape}")
        m = tok.size
        cx = self._prep_ctx(ctx, m)  # [M, order-1]
        out_count = np.zeros(m, dtype=np.int64)  # [M]

        def probe(n: int, idx: np.ndarray, ctx_key: np.ndarray) -> np.ndarray:
            """Rows whose (context, token) n-gram is stored with count >= min_count."""
            keys = self._keys[n - 1]
            q = (ctx_key << TOKEN_BITS) | tok[idx] if n > 1 else tok[idx]  # [R]
            pos = np.minimum(np.searchsorted(keys, q), keys.size - 1)  # [R]
            cnt = self._counts[n - 1][pos].astype(np.int64)  # [R]
            hit = (keys[pos] == q) & (cnt >= min_count)  # [R]
            out_count[idx[hit]] = cnt[hit]
            return hit

        todo = (tok >= 0) & (tok < TOKEN_LIMIT)  # [M] rows still unresolved
        out_level, out_total = self._backoff(cx, todo, probe)
        return out_count, out_total, out_level

    def prob(self, ctx: np.ndarray, tokens: np.ndarray, min_count: int = 1) -> np.ndarray:
        """P(token | ctx) with backoff; 0.0 if never seen. ctx [M, order-1], tokens [M] ->
        [M] float32."""
        count, total, _ = self.lookup(ctx, tokens, min_count)
        p = np.zeros(count.shape, dtype=np.float64)  # [M]
        seen = total > 0
        p[seen] = count[seen] / total[seen]
        return p.astype(np.float32)

    def log_prob(self, ctx: np.ndarray, tokens: np.ndarray, min_count: int = 1) -> np.ndarray:
        """Natural log of :meth:`prob`; -inf if never seen. ctx [M, order-1], tokens [M] ->
        [M] float32."""
        count, total, _ = self.lookup(ctx, tokens, min_count)
        lp = np.full(count.shape, -np.inf, dtype=np.float64)  # [M]
        seen = total > 0
        lp[seen] = np.log(count[seen]) - np.log(total[seen])
        return lp.astype(np.float32)

    def top_next(
        self, ctx: np.ndarray, k: int, min_count: int = 1
    ) -> tuple[np.ndarray, np.ndarray]:
        """The k most likely next tokens after each context.

        Uses the longest suffix of the context that has at least one continuation with
        count >= min_count (down to unigram); ties are broken by smaller token id. Rows with fewer
        than k such continuations are padded with token -1 / prob 0.0. Probabilities equal
        :meth:`prob` for the returned tokens.

        Args:
            ctx: [M, order-1] int64, oldest first; entries < 0 mean "no token".
            k: number of tokens per row (>= 1).

        Returns:
            tokens [M, k] int64 and probs [M, k] float32.
        """
        _check_min_count(min_count)
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        cx = self._prep_ctx(ctx, None)  # [M, order-1]
        m = cx.shape[0]
        lo = np.zeros(m, dtype=np.int64)  # [M] start of the chosen context's entry range
        hi = np.zeros(m, dtype=np.int64)  # [M] end (exclusive)

        def probe(n: int, idx: np.ndarray, ctx_key: np.ndarray) -> np.ndarray:
            """Rows whose context has a continuation with count >= min_count (its entry range)."""
            keys = self._keys[n - 1]
            if n > 1:
                r_lo = np.searchsorted(keys, ctx_key << TOKEN_BITS)  # [R]
                r_hi = np.searchsorted(keys, (ctx_key + 1) << TOKEN_BITS)  # [R]
            else:
                r_lo = np.zeros(idx.size, dtype=np.int64)
                r_hi = np.full(idx.size, keys.size, dtype=np.int64)
            nonempty = r_hi > r_lo
            best = np.zeros(idx.size, dtype=np.int64)  # [R] largest count in the context
            best[nonempty] = self._counts[n - 1][self._rank[n - 1][r_lo[nonempty]]]
            ok = nonempty & (best >= min_count)  # [R]
            lo[idx[ok]], hi[idx[ok]] = r_lo[ok], r_hi[ok]
            return ok

        level, total = self._backoff(cx, np.ones(m, dtype=bool), probe)

        out_tok = np.full((m, k), -1, dtype=np.int64)  # [M, k]
        out_p = np.zeros((m, k), dtype=np.float32)  # [M, k]
        for n in range(1, self.order + 1):
            sel = np.flatnonzero(level == n)  # [S]
            if sel.size == 0:
                continue
            keys, counts, rank = self._keys[n - 1], self._counts[n - 1], self._rank[n - 1]
            j = lo[sel, None] + np.arange(k, dtype=np.int64)[None, :]  # [S, k]
            valid = j < hi[sel, None]  # [S, k]
            pos = rank[np.where(valid, j, lo[sel, None])].astype(np.int64)  # [S, k]
            cnt = counts[pos].astype(np.int64)  # [S, k]
            valid &= cnt >= min_count
            tk = keys[pos] & TOKEN_MASK  # [S, k]
            out_tok[sel] = np.where(valid, tk, -1)
            out_p[sel] = np.where(valid, cnt / total[sel, None], 0.0).astype(np.float32)
        return out_tok, out_p

    # ------------------------------------------------------------------ persistence

    def save(self, path_dir: str | os.PathLike[str]) -> Path:
        """Write the model to directory ``path_dir`` (created if needed); returns the path.

        ``meta.json`` is written last, so a directory without it is an incomplete save.
        """
        path = Path(path_dir)
        path.mkdir(parents=True, exist_ok=True)
        meta_path = path / META_FILE
        if meta_path.exists():
            meta_path.unlink()
        arrays = self._arrays()
        for stem, arr in arrays.items():
            np.save(path / f"{stem}.npy", np.ascontiguousarray(arr), allow_pickle=False)
        meta = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "order": self.order,
            "vocab_size": self.vocab_size,
            "min_count": self.min_count,
            "num_tokens_trained": self.num_tokens_trained,
            "unigram_total": self.unigram_total,
            "token_bits": TOKEN_BITS,
            "tokenizer": self.meta.get("tokenizer"),
            "target": self.meta.get("target"),
            "entries": self.num_entries,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "info": self.meta,
        }
        tmp = path / (META_FILE + ".tmp")
        tmp.write_text(json.dumps(meta, indent=2, sort_keys=True, default=str) + "\n")
        tmp.replace(meta_path)
        return path

    @classmethod
    def load(cls, path_dir: str | os.PathLike[str], mmap: bool = True) -> NGramModel:
        """Load a model written by :meth:`save` (arrays memory-mapped read-only if ``mmap``).

        Raises FileNotFoundError for a missing directory / file and ValueError (naming the file)
        for a corrupt or inconsistent one.
        """
        path = Path(path_dir)
        if not path.is_dir():
            raise FileNotFoundError(f"n-gram model directory not found: {path}")
        meta = _read_meta(path / META_FILE)
        order, mode = meta["order"], "r" if mmap else None
        a = {s: _read_array(path / f"{s}.npy", dt, mode) for s, dt in _layout(order).items()}
        orders, ctx_lens = range(1, order + 1), range(1, order)
        try:
            return cls(
                order=order,
                vocab_size=meta["vocab_size"],
                ngram_keys=[a[f"ngram{n}_keys"] for n in orders],
                ngram_counts=[a[f"ngram{n}_counts"] for n in orders],
                ngram_rank=[a[f"ngram{n}_rank"] for n in orders],
                ctx_keys=[a[f"ctx{c}_keys"] for c in ctx_lens],
                ctx_totals=[a[f"ctx{c}_totals"] for c in ctx_lens],
                unigram_total=meta["unigram_total"],
                min_count=meta["min_count"],
                num_tokens_trained=meta["num_tokens_trained"],
                meta=meta["info"],
            )
        except (TypeError, ValueError) as e:
            raise ValueError(f"corrupt n-gram model {path}: {e}") from e

    # ------------------------------------------------------------------ comparison

    def equals(self, other: NGramModel) -> bool:
        """True if both models hold identical counts and settings (meta is not compared)."""
        if (
            self.order != other.order
            or self.vocab_size != other.vocab_size
            or self.min_count != other.min_count
            or self.unigram_total != other.unigram_total
            or self.num_tokens_trained != other.num_tokens_trained
        ):
            return False
        a, b = self._arrays(), other._arrays()
        return a.keys() == b.keys() and all(
            a[s].dtype == b[s].dtype and np.array_equal(a[s], b[s]) for s in a
        )


__all__ = ["FORMAT_VERSION", "MAX_ORDER", "TOKEN_BITS", "NGramModel"]

