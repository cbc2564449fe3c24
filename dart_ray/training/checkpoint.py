"""Training state on disk: the learning-rate plan, atomic checkpoints, and where a run starts from.

A checkpoint (``<run>/checkpoint/state.pt``) holds everything a continued run needs to be the
uninterrupted run: model weights, AdamW moments, the global step, the LR plan, the data position
(batches consumed from the seeded stream) with a fingerprint of the data it indexes, the torch RNG
state, the loss/eval history, the run key (the settings that fixed the plan) and the dtype the run
trained in (``train-drafter --dtype``, resolved). It is written to a temp file, fsynced and renamed
over the old one: a crash leaves the previous checkpoint or the new one, never half of either.

Where a run starts (``trainer._start_sources``):

* ``<out>/checkpoint`` exists: the same run restarts from it. Its run key must equal the current
  settings' (anything that changes the plan or the data order); a mismatch is an error, never a
  silent re-plan.
* ``resume=PATH`` (a run dir, its ``checkpoint/`` dir, or a drafter dir such as the shipped
  ``dart_ray/artifacts/<model>/drafter``) with an explicit ``lr_schedule``:

  - ``continue``: the source's LR plan goes on where it stopped, with its optimizer moments and
    data position (a checkpoint source only; a drafter dir has no optimizer state). Resuming a run
    stopped by a time budget this way gives the uninterrupted run.
  - ``fresh``: weights only; a new AdamW, a new warmup + cosine plan of this run's length at
    ``lr``; the data position continues if the data is the same, else starts at 0.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

STATE_FILE = "state.pt"


@dataclass(frozen=True)
class LRPlan:
    """Linear warmup, then cosine decay to 0, over global steps ``start .. start + steps``."""

    lr: float
    warmup: int
    start: int
    """Global step at which this plan begins (0, or the step a ``fresh`` resume started from)."""
    steps: int
    """Length of the plan; the LR reaches 0 at ``start + steps``."""

    @property
    def end(self) -> int:
        return self.start + self.steps

    def lr_at(self, step: int) -> float:
        """LR of the update that takes the global step from ``step`` to ``step + 1``."""
        s = step - self.start
        warm = min(1.0, (s + 1) / max(self.warmup, 1))
        return self.lr * warm * 0.5 * (1 + math.cos(math.pi * min(s, self.steps) / self.steps))

    def to_dict(self) -> dict:
        return asdict(self)


def data_fingerprint(seqs: list, seqs_per_step: int, max_len: int, seed: int) -> str:
    """Identifies the batch stream: the training sequences and how they are batched."""
    h = hashlib.sha256(f"{len(seqs)}:{seqs_per_step}:{max_len}:{seed}".encode())
    for s in seqs:
        h.update(np.asarray(s[0], dtype=np.int32).tobytes())
        h.update(b"|")
    return h.hexdigest()[:16]


def _write_synced(path: Path, write, mode: str = "wb") -> None:
    """``write(file)`` into ``path``, then flushed to disk (fsync)."""
    with open(path, mode) as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def save_state(state: dict, ckpt_dir: Path) -> Path:
    """Write ``state`` to ``ckpt_dir/state.pt`` atomically (temp file, fsync, rename)."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    dst, tmp = ckpt_dir / STATE_FILE, ckpt_dir / f".{STATE_FILE}.tmp"
    _write_synced(tmp, lambda f: torch.save(state, f))
    os.replace(tmp, dst)
    return dst


PENDING_FILE = f".{STATE_FILE}.pending"
JOINT_COMMIT_FILE = "joint-commit.json"
"""In the first student's checkpoint directory while a joint checkpoint is being renamed into
place: the checkpoint directories whose pending states belong to it."""


def save_states_together(states: list[tuple[dict, Path]], commit_dir: Path) -> None:
    """Write the checkpoints of jointly trained students as one (``states``: (state, checkpoint
    directory) each). Every state goes to its pending file first; then a commit record (atomic) in
    ``commit_dir`` names them; then each is renamed into place and the record removed. A crash
    before the record leaves every old checkpoint as it was (:func:`finish_joint_commit` drops the
    pending files); after it, :func:`finish_joint_commit` completes the renames. So a restart never
    finds students at different steps."""
    if len(states) == 1:
        save_state(*states[0])
        return
    for state, ckpt_dir in states:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        _write_synced(ckpt_dir / PENDING_FILE, lambda f, state=state: torch.save(state, f))
    commit_dir.mkdir(parents=True, exist_ok=True)
    record, tmp = commit_dir / JOINT_COMMIT_FILE, commit_dir / f".{JOINT_COMMIT_FILE}.tmp"
    _write_synced(tmp, lambda f: json.dump([str(d) for _, d in states], f), "w")
    os.replace(tmp, record)
    finish_joint_commit(commit_dir, [d for _, d in states])


def finish_joint_commit(commit_dir: Path, ckpt_dirs: list[Path]) -> None:
    """Complete a joint checkpoint a crash interrupted during its renames (its commit record is
    there), or drop the pending states of one interrupted before its record was written."""
    record = commit_dir / JOINT_COMMIT_FILE
    if record.is_file():
        for d in json.loads(record.read_text()):
            pending = Path(d) / PENDING_FILE
            if pending.is_file():
                os.replace(pending, Path(d) / STATE_FILE)
        record.unlink()
    for d in ckpt_dirs:
        (d / PENDING_FILE).unlink(missing_ok=True)


def load_state(path: Path) -> dict:
    return torch.load(path, weights_only=False, map_location="cpu")


def save_dir_atomic(write, dst: Path) -> None:
    """``write(tmp_dir)`` then swap ``tmp_dir`` in for ``dst`` (a reader sees the old or the new
    directory; a crash between the two renames leaves ``dst.old`` beside a complete ``dst`` or in
    its place)."""
    import shutil

    tmp, old = dst.with_name(f".{dst.name}.tmp"), dst.with_name(f".{dst.name}.old")
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp)
    shutil.rmtree(old, ignore_errors=True)
    if dst.exists():
        os.replace(dst, old)
    os.replace(tmp, dst)
    shutil.rmtree(old, ignore_errors=True)


@dataclass
class Source:
    """What a run starts from."""

    kind: str
    """``new``, ``restart`` (this run's own checkpoint), ``checkpoint`` or ``drafter`` (a resume
    source)."""
    path: Path | None = None
    state: dict | None = None
    """The checkpoint dict (``restart``/``checkpoint``), or
    ``{"model": state_dict, "config": its JSON config}`` (``drafter``)."""

    def mismatch(self, want: dict) -> dict:
        """Fields of ``want`` (arch, depth, draft_vocab, ...) that the source's recorded config
        contradicts: name -> (source's, wanted). Shapes alone would not catch every one (a DART
        drafter's weights fit any depth)."""
        have = (self.state or {}).get("config") or {}
        return {k: (have[k], v) for k, v in want.items() if k in have and have[k] != v}

    @property
    def step(self) -> int:
        return int(self.state.get("step", 0)) if self.state else 0


def find_resume(path: str | Path, config_files: tuple[str, ...]) -> Source:
    """A resume source: a run dir (``checkpoint/state.pt`` inside), a checkpoint dir
    (``state.pt``), or a drafter dir (one of ``config_files`` + ``model.safetensors``)."""
    p = Path(path)
    for f in (p / "checkpoint" / STATE_FILE, p / STATE_FILE, p if p.name == STATE_FILE else None):
        if f is not None and f.is_file():
            return Source("checkpoint", f, load_state(f))
    found = [c for c in config_files if (p / c).is_file()]
    if (p / "model.safetensors").is_file() and found:
        import json

        from safetensors.torch import load_file

        weights = {k: v.float() for k, v in load_file(str(p / "model.safetensors")).items()}
        return Source("drafter", p,
                      {"model": weights, "config": json.loads((p / found[0]).read_text())})
    raise FileNotFoundError(f"--resume {p}: no checkpoint/{STATE_FILE}, {STATE_FILE} or drafter "
                            f"({'/'.join(config_files)} + model.safetensors) there")


def plan_for(source: Source, lr_schedule: str | None, lr: float, warmup: int, steps: int) -> LRPlan:
    """The LR plan of a run starting from ``source`` (``steps``: this run's length for a new
    plan)."""
    if source.kind == "new":
        return LRPlan(lr, warmup, 0, steps)
    if source.kind == "restart":
        return LRPlan(**source.state["plan"])
    if lr_schedule == "fresh":
        return LRPlan(lr, warmup, source.step, steps)
    if lr_schedule != "continue":
        raise ValueError("lr_schedule must be 'continue' or 'fresh' when resuming, got "
                         f"{lr_schedule!r}")
    if source.kind == "drafter" or "plan" not in source.state:
        why = ("a drafter directory" if source.kind == "drafter"
               else "written before plans were recorded")
        raise ValueError("--lr-schedule continue needs a checkpoint with its optimizer state and "
                         f"LR plan; {source.path} has none ({why}): use --lr-schedule fresh")
    plan = LRPlan(**source.state["plan"])
    if source.step >= plan.end:
        raise ValueError(f"{source.path}: its LR plan ended at step {plan.end} (LR 0); nothing to "
                         "continue: use --lr-schedule fresh")
    return plan
