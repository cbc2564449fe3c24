"""The frozen teacher's outputs per training sequence, kept so that epochs after the first (and,
with a directory, later runs on the same sequences) skip the target forward.

On a 2-core CPU the teacher pass is about half of a training step (SmolLM2-135M, 8 x 320 tokens,
bf16: 3.2 s of 6.7 s on the Zen 4 EPYC), and it is the same every time: the target is frozen and a
sequence is always truncated the same way. :class:`TeacherCache` stores, per sequence (keyed by its
content, :func:`seq_key`), exactly what :func:`~dart_ray.training.objectives.teacher_pass` returned
for its real (unpadded) positions:

```
taps     [n, nT*H]   in the teacher's dtype (the taps were computed in it: storing them is lossless)
top_id   [n, K]      int32
top_lp   [n, K]      float32
```

and rebuilds a right-padded batch from them. Padded positions come back as zeros: every consumer
masks them by ``lens`` (the loss weighs them 0, and right padding is never attended by a real
position), so their content does not matter.

With a directory (``train-drafter --teacher-cache DIR``) the entries are also written there, in
parts appended at every checkpoint (``<dir>/<teacher key>/part-*.pt``, the key a digest of
:func:`teacher_fields`: the target's weights, dtype, taps, top-K, device type and this format, so
other teachers never mix), and the run's own sequences are read back at start: a run restarted from
its checkpoint, a later sitting, or another experiment on overlapping data starts with them.

What it costs in exactness: a sequence's outputs are those of the batch it was first computed in.
Without a directory, a run that stops past an epoch boundary and continues recomputes them in other
batches (other GEMM shapes), so it matches the uninterrupted run to floating-point rounding rather
than bit for bit; with one, the continued run reads the very entries the uninterrupted run used.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import uuid
from pathlib import Path

import torch
from torch.nn.utils.rnn import pad_sequence

log = logging.getLogger(__name__)

Entry = tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]


def seq_key(ids: list[int]) -> str:
    """Content key of one (truncated) training sequence."""
    return hashlib.blake2b(torch.tensor(ids, dtype=torch.int64).numpy().tobytes(),
                           digest_size=16).hexdigest()


FORMAT_VERSION = 1
"""Bumped when what :func:`~dart_ray.training.objectives.teacher_pass` returns changes (older
directories are then ignored, not misread)."""


def teacher_fields(tgt, dtype: str, taps: tuple[int, ...], topk: int, device: torch.device) -> dict:
    """What fixes a teacher's outputs: the target's weights (its directory and the sizes and
    modification times of its weight files), dtype, taps, top-K, device type, format."""
    files = sorted(Path(tgt.model_dir).glob("*.safetensors"))
    weights = [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    return {"format": FORMAT_VERSION, "target": tgt.model_id,
            "model_dir": str(Path(tgt.model_dir).resolve()), "weights": weights, "dtype": dtype,
            "taps": list(taps), "topk": topk, "device": torch.device(device).type}


def teacher_key(fields: dict) -> str:
    """Directory name for a teacher's outputs: a digest of :func:`teacher_fields`."""
    return hashlib.blake2b(json.dumps(fields, sort_keys=True).encode(), digest_size=8).hexdigest()


class TeacherCache:
    """Per-sequence teacher outputs up to ``max_bytes`` in memory (first come, first kept),
    optionally persisted under ``directory`` (of which only the ``wanted`` sequences are read).

    A batch is served only when every one of its sequences is cached, so the budget should hold
    the whole training split (past it, a later epoch's batches mostly miss; a warning says so)."""

    def __init__(self, max_bytes: int, taps_dtype: torch.dtype,
                 directory: str | os.PathLike | None = None, key: dict | None = None,
                 wanted: set | None = None) -> None:
        self.max_bytes = max_bytes
        self.taps_dtype = taps_dtype
        self.bytes = 0
        self.hits = 0
        """Batches served from the cache (no teacher pass)."""
        self.misses = 0
        """Batches that needed a teacher pass."""
        self.loaded = 0
        """Entries read from ``directory`` at start."""
        self._rows: dict[object, Entry] = {}
        self._unsaved: list[object] = []
        self._full = False
        self.dir: Path | None = None
        if directory is not None:
            if key is None:
                raise ValueError("a persisted teacher cache needs the teacher's key")
            self.dir = Path(directory) / teacher_key(key)
            self.dir.mkdir(parents=True, exist_ok=True)
            meta = self.dir / "teacher.json"
            if not meta.is_file():
                meta.write_text(json.dumps(key, indent=1, sort_keys=True))
            self._load(wanted)

    def __len__(self) -> int:
        return len(self._rows)

    # ---- batches ---------------------------------------------------------------------------------
    def lookup(self, keys: list, lens: list[int], device: torch.device):
        """The batch of sequences ``keys`` (lengths ``lens``) as ``teacher_pass`` returns it --
        taps [B, L, nT*H] float32 (or None), top_id [B, L, K] long, top_lp [B, L, K] float32, L =
        max(lens) -- or None (and a miss counted) unless every one of them is cached."""
        rows = [self._rows.get(k) for k in keys]
        if any(r is None for r in rows):
            self.misses += 1
            return None
        self.hits += 1
        for k, (_, ids, _), n in zip(keys, rows, lens, strict=True):
            if ids.shape[0] != n:
                raise ValueError(f"sequence {k!r} was cached with {ids.shape[0]} positions, "
                                 f"asked for {n}")
        taps, top_id, top_lp = zip(*rows, strict=True)

        def pad(xs, dtype):                           # [B, max(lens), ...], zeros past each length
            return pad_sequence(xs, batch_first=True).to(device, dtype)

        return (None if taps[0] is None else pad(taps, torch.float32), pad(top_id, torch.long),
                pad(top_lp, torch.float32))

    def store(self, keys: list, lens: list[int], taps: torch.Tensor | None,
              top_id: torch.Tensor, top_lp: torch.Tensor) -> None:
        """Keep the real positions of each sequence of a computed batch (on the CPU) while the
        budget lasts."""
        for b, (k, n) in enumerate(zip(keys, lens, strict=True)):
            if k in self._rows:
                continue
            t = None if taps is None else taps[b, :n].to("cpu", self.taps_dtype).clone()
            entry = (t, top_id[b, :n].to("cpu", torch.int32).clone(),
                     top_lp[b, :n].to("cpu", torch.float32).clone())
            if not self._keep(k, entry):
                return
            self._unsaved.append(k)

    def _keep(self, k, entry: Entry) -> bool:
        size = sum(x.numel() * x.element_size() for x in entry if x is not None)
        if self.bytes + size > self.max_bytes:
            if not self._full and self.max_bytes > 0:       # 0: the cache is off, not full
                self._full = True
                log.warning("teacher cache full at %.2f GiB (%d sequences): later epochs will "
                            "mostly recompute; raise --teacher-cache-gb to hold the training split",
                            self.bytes / 2**30, len(self._rows))
            return False
        self._rows[k] = entry
        self.bytes += size
        return True

    # ---- the directory ---------------------------------------------------------------------------
    def save(self) -> None:
        """Append the entries computed since the last save as one new part (atomically; part names
        are unique, so runs sharing the directory never collide)."""
        if self.dir is None or not self._unsaved:
            return
        name = f"part-{time.time_ns():020d}-{os.getpid()}-{uuid.uuid4().hex[:8]}.pt"
        tmp = self.dir / f".{name}.tmp"
        torch.save({k: self._rows[k] for k in self._unsaved}, tmp)
        os.replace(tmp, self.dir / name)
        self._unsaved = []

    def _load(self, wanted: set | None) -> None:
        for part in sorted(self.dir.glob("part-*.pt")):
            for k, entry in torch.load(part, weights_only=True, mmap=True).items():
                if k in self._rows or (wanted is not None and k not in wanted):
                    continue
                if not self._keep(k, entry):
                    return
                self.loaded += 1
