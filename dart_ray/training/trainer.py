"""The ``dart-ray train-drafter`` loop: drafters trained against one frozen target
(self-distillation).

One run trains ``cfg.arch`` and every arch in ``cfg.joint`` (``--arch dart:8,eagle:6,...``) on the
very same batches and teacher pass, so joint students see equal data and steps by construction.
Every step:

```
batch       the next batch of the seeded stream (a fresh permutation each epoch; truncated to
            max_len)
teacher     one target forward over the right-padded batch: the taps every student reads and the
            target's top-K next-token distributions (shared; its time is split evenly); read
            from the teacher cache instead once computed (teacher_cache.py: later epochs, or a
            --teacher-cache directory from earlier runs)
update      per student, through its Objective (objectives.py): level targets from the teacher's
            top-K, level logits [B, L-1, d, Vd] (bf16 autocast when the run's dtype is bf16), the
            gamma-weighted forward KL, clipped gradients, one AdamW step at the LR plan's rate
evaluate    every eval_every steps and at the end: held-out per-level top-1/top-5 and chain_tau per
            domain (metrics.py; one teacher pass per held-out batch serves every student),
            appended to metrics.jsonl
checkpoint  every ckpt_every steps, at the plan's end, at the time budget and on SIGINT/SIGTERM:
            everything a continued run needs to equal the uninterrupted one (checkpoint.py)
```

When the plan completes, the time budget runs out or a signal asks to stop, every student writes its
drafter (bf16) at once, then, after a final evaluation where the last step had none,
``train_summary.json`` and ``training.png``; after an early stop, rerunning the same command
continues as if it had not stopped.
What each architecture builds, taps, predicts and is scored on is an
:class:`~dart_ray.training.objectives.Objective`, looked up by the method registry's ``objective``
name; the loop has no per-architecture branches. Where a run starts (its own checkpoint, ``resume``,
new) and its LR plan are :mod:`dart_ray.training.checkpoint`; the metrics are
:mod:`dart_ray.training.metrics`.

dtype: the teacher runs in the run's resolved dtype (``dtype="auto"``: bf16 only where the machine
runs it natively and measured fast, :func:`dart_ray.hardware.resolve_dtype`; an AVX2-only CPU
emulates bf16 several times slower than fp32); the students keep float32 weights and optimizer
state, with bf16 autocast on their forward when the resolved dtype is bf16.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dart_ray.hardware import DTypeChoice, resolve_dtype, synchronize
from dart_ray.methods import method_specs
from dart_ray.models.packing import pack_linears, packing_supported
from dart_ray.training.checkpoint import (
    LRPlan,
    Source,
    data_fingerprint,
    plan_for,
    save_dir_atomic,
)
from dart_ray.training.metrics import MetricsLog, evaluate_domains, plot_metrics
from dart_ray.training.objectives import (
    get_objective,
    grow_mlp,
    objective_names,
    pad_batch,
    select_taps,
    student_autocast,
    teacher_pass,
)
from dart_ray.training.teacher_cache import TeacherCache, seq_key, teacher_fields
from dart_ray.training.vocab import choose_draft_vocab, coverage, revocab_head, target_to_draft

if TYPE_CHECKING:          # typing.Self is Python 3.11+; requires-python is 3.10
    from typing import Self

ARCHS = objective_names()
"""Training objectives (``--arch``), from the method registry (:mod:`dart_ray.methods`); each is
implemented by an :class:`~dart_ray.training.objectives.Objective`."""
DTYPES = ("auto", "fp32", "bf16")
"""``TrainConfig.dtype`` choices (``auto``: :func:`dart_ray.hardware.resolve_dtype`)."""


@dataclass(frozen=True)
class TrainConfig:
    """Knobs of ``dart-ray train-drafter``."""

    data: str
    """Directory of self-distillation shards (``dart-ray gen-data``), or a comma list of them."""
    out: str
    """Output directory: checkpoints, final drafter, card, plots."""
    model: str | None = None
    """Target (default: embedded SmolLM2)."""
    arch: str = "dart"
    """What to train: ``dart`` (masked slots), ``eagle`` (the same layer unrolled autoregressively
    with its own features fed back, trained with the unroll), ``medusa`` (K heads on the last hidden
    state) or ``sps`` (a shallow causal draft model distilled from the target)."""
    depth: int = 8
    """Trained draft depth d (levels; EAGLE: unrolled steps; Medusa: heads; SpS: always 1 level)."""
    joint: tuple[str, ...] = ()
    """Further archs trained in the same run on the same batches and teacher pass (``out/<arch>/``);
    each ``"arch"`` or ``"arch:depth"`` (default: ``depth``)."""
    sps_layers: tuple[int, ...] = (0, 1)
    """SpS: target layers the draft model's blocks are initialised from (one block each)."""
    gamma: float = 0.6
    """Level weight base: level t weighted gamma^(t-1)."""
    prompt_weight: float = 1.0
    """Loss weight of the prefixes that end inside a row's prompt (j < prompt length - 1: chat
    template, the request, a code prompt's docstring), where no drafting happens when serving;
    the answer's prefixes weigh 1. 1 = every prefix alike (every run before it), 0 = answers
    only (teacher-only text has no prompt: all of it weighs 1)."""
    lr: float = 1e-3
    """Peak LR of a new plan (a new run, or ``lr_schedule="fresh"``)."""
    weight_decay: float = 0.01
    warmup_steps: int = 30
    """Linear warmup steps of a new plan; then cosine decay to 0 at the plan's end."""
    epochs: float = 1.0
    """Passes over the training split (fractional allowed) in this run's plan; with
    ``lr_schedule="fresh"`` counted from the resumed step."""
    max_steps: int | None = None
    """Cap on this plan's optimizer steps (overrides epochs when smaller)."""
    seqs_per_step: int = 4
    max_len: int = 320
    """Sequences are truncated to this many tokens."""
    teacher_topk: int = 32
    teacher_cache_gb: float = 4.0
    """Memory for the teacher's outputs per training sequence (taps, top-K), so that later epochs
    skip the target forward (:mod:`dart_ray.training.teacher_cache`; ~3.7 KB per token for
    SmolLM2-135M in bf16). 0 = recompute every step. Without ``teacher_cache``, a run continued
    past an epoch boundary equals the uninterrupted one to rounding, not bit for bit."""
    teacher_cache: str | None = None
    """Directory that keeps those outputs across runs (appended at every checkpoint, read at start;
    a subdirectory per teacher): restarts, later sittings and other experiments on the same
    sequences skip their teacher passes, and continuation is bit-identical again."""
    draft_vocab: int | None = None
    """Size of the reduced draft vocabulary (most frequent tokens of the data's answers); 0 = full
    tied head. None (the default) = the size of the drafter the run starts from (its own
    checkpoint on a restart, ``resume``'s drafter) when that has one and ``revocab`` is off, else
    :data:`DEFAULT_DRAFT_VOCAB`."""
    grad_clip: float = 0.5
    eval_every: int = 100
    ckpt_every: int = 100
    eval_seqs: int = 48
    """Held-out sequences evaluated per domain (chat, code, text)."""
    eval_data: str | None = None
    """Further data directories (comma list) whose ``val`` rows join the held-out set, e.g. a
    ``gen-data --only-split val`` set (their training rows are not trained on)."""
    seed: int = 0
    threads: int | None = None
    device: str = "cpu"
    """torch device of the teacher and the students (``cpu``, ``cuda``, ``cuda:1``); checkpoints
    and shipped drafters are device-free, so a run may restart on another device."""
    dtype: str = "auto"
    """Teacher dtype, and bf16 autocast of the students' forward when ``bf16``: ``auto`` = bf16
    where this machine runs it natively and measured fast (:func:`dart_ray.hardware.resolve_dtype`),
    else fp32."""
    time_budget_s: float | None = None
    """Stop cleanly after this many seconds of training: checkpoint, final evaluation, drafter.
    Rerunning the same command continues the run as if it had not stopped."""
    resume: str | None = None
    """Start from another run (its dir or ``checkpoint/``) or a drafter dir (e.g. the shipped one);
    needs ``lr_schedule``. (A run restarts from its own ``out/checkpoint`` without this.)"""
    lr_schedule: str | None = None
    """With ``resume``: ``continue`` (the source's LR plan, optimizer moments and data position go
    on) or ``fresh`` (weights only: new optimizer, warmup + cosine at ``lr`` over this run)."""
    init_from_target: bool = False
    """dart/eagle, new runs: start the drafter layer from target layer ``init_layer`` (attention on
    the tap half of the input, MLP, norms; ``fc`` passes that layer's tap through) instead of
    random. The head always starts as the target's head rows of the draft vocabulary."""
    init_layer: int | None = None
    """Target layer for ``init_from_target`` (default: the last tapped layer)."""
    mlp_width: int | None = None
    """dart/eagle: units of the drafter layer's MLP (intermediate size); None = the target's. With
    ``resume`` (``lr_schedule="fresh"``) from a narrower drafter, it is grown to this width with its
    function kept (new units' down-projection starts at zero: :func:`~dart_ray.training.objectives.
    grow_mlp`)."""
    revocab: str | None = None
    """With ``resume`` and ``lr_schedule="fresh"`` (an objective that ``revocabs``: dart, eagle),
    a new draft vocabulary of ``draft_vocab`` tokens instead of the source's: ``replace`` = this
    data's most frequent answer tokens; ``extend`` = every token of the source's plus this data's
    most frequent answer tokens outside it (``draft_vocab`` >= the source's). The head rows of the
    tokens both share carry over, new ones start from the target's head rows
    (:func:`dart_ray.training.vocab.revocab_head`)."""

    def __post_init__(self) -> None:
        objective = get_objective(self.arch)
        if objective.needs_draft_vocab and self.draft_vocab == 0:
            raise ValueError(f"arch {self.arch!r} needs a reduced draft vocabulary (draft_vocab > "
                             "0)")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"device must be a torch device string (cpu, cuda, cuda:1), got "
                             f"{self.device!r}") from e
        object.__setattr__(self, "sps_layers", tuple(self.sps_layers))
        object.__setattr__(self, "joint", tuple(self.joint))
        archs = objective_names()
        for spec in self.joint:
            arch, _, d = spec.partition(":")
            if arch not in archs or (d and not (d.isdigit() and 1 <= int(d) <= 16)):
                raise ValueError("joint entries must be 'arch' or 'arch:depth' with arch in "
                                 f"{archs}, got {spec!r}")
        if not 1 <= self.depth <= 16:
            raise ValueError("depth must be in [1, 16]")
        if not 0 < self.gamma <= 1:
            raise ValueError("gamma must be in (0, 1]")
        if not 0 <= self.prompt_weight <= 1:
            raise ValueError(f"prompt_weight must be in [0, 1], got {self.prompt_weight}")
        if self.seqs_per_step < 1 or self.max_len < 8:
            raise ValueError("seqs_per_step >= 1 and max_len >= 8 required")
        for name in ("eval_every", "ckpt_every", "eval_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if not self.lr >= 0:              # 0: steps that leave the weights as they are
            raise ValueError(f"lr must be >= 0, got {self.lr}")
        if not self.epochs > 0:
            raise ValueError(f"epochs must be > 0, got {self.epochs}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1 (or None: the epochs decide), got "
                             f"{self.max_steps}")
        if self.time_budget_s is not None and not self.time_budget_s > 0:
            raise ValueError(f"time_budget_s must be > 0 (or None: no budget), got "
                             f"{self.time_budget_s}")
        if self.mlp_width is not None and self.init_from_target:
            raise ValueError("init_from_target copies a target layer, MLP width included; "
                             "mlp_width applies to a resumed drafter (grown) or a random one")
        if self.teacher_cache is not None and not self.teacher_cache_gb:
            raise ValueError("teacher_cache (a directory) needs teacher_cache_gb > 0")
        if not self.teacher_cache_gb >= 0:
            raise ValueError("teacher_cache_gb must be >= 0 (0 = off), got "
                             f"{self.teacher_cache_gb}")
        if self.resume is not None and self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"resuming from {self.resume} needs an explicit LR schedule choice: "
                             "lr_schedule 'continue' (the source's plan goes on) or 'fresh' (new "
                             "warmup + cosine at lr)")
        if self.resume is None and self.lr_schedule is not None:
            raise ValueError("lr_schedule applies only with resume")
        if self.resume is not None and self.joint:
            raise ValueError("resume trains one arch; resume each from its own run")
        if self.init_from_target and (not objective.inits_from_target_layer or self.joint):
            able = [a for a in objective_names() if get_objective(a).inits_from_target_layer]
            raise ValueError(f"init_from_target applies to a run of one of {able} alone (the "
                             "others always start from the target)")
        if self.init_from_target and self.resume is not None:
            raise ValueError("init_from_target initialises a new drafter; a resumed one has its "
                             "weights")
        if self.mlp_width is not None and (self.mlp_width < 1 or not objective.sizes_mlp
                                           or self.joint):
            able = [a for a in objective_names() if get_objective(a).sizes_mlp]
            raise ValueError(f"mlp_width sizes the MLP of one drafter of {able} (>= 1 units, no "
                             f"joint students), got {self.mlp_width} for {self.arch!r}")
        if self.revocab not in (None, *REVOCAB_MODES):
            raise ValueError(f"revocab must be one of {REVOCAB_MODES} or None, got "
                             f"{self.revocab!r}")
        if self.revocab and (self.resume is None or self.lr_schedule != "fresh" or self.joint
                             or not objective.revocabs or self.draft_vocab == 0):
            able = [a for a in objective_names() if get_objective(a).revocabs]
            raise ValueError(f"revocab re-chooses the draft vocabulary of one resumed drafter of "
                             f"{able}: it needs resume, lr_schedule 'fresh' (the optimizer "
                             "moments of the old head rows do not carry over), draft_vocab > 0 and "
                             "no joint students")


DEFAULT_DRAFT_VOCAB = 8192
"""Draft vocabulary of a new drafter (or a re-chosen one) when ``draft_vocab`` is not given."""
LR_SCHEDULES = ("continue", "fresh")
REVOCAB_MODES = ("replace", "extend")
RESTART_FREE = ("out", "time_budget_s", "eval_every", "ckpt_every", "eval_seqs", "eval_data",
                "threads", "data", "dtype", "device", "teacher_cache_gb", "teacher_cache")
"""TrainConfig fields a restarted run may change (they fix neither the plan nor the data order;
the data is identified by its fingerprint, not its path; a run moved to a machine where ``auto``
resolves otherwise continues, in the other dtype)."""


def config_defaults() -> dict:
    """TrainConfig's defaults as :func:`run_key` and the summary write values (tuples as lists):
    what a checkpoint or summary written before a field existed ran with."""
    return {f.name: list(f.default) if isinstance(f.default, tuple) else f.default
            for f in dataclasses.fields(TrainConfig) if f.default is not dataclasses.MISSING}


def run_key(cfg: TrainConfig, data_key: str) -> dict:
    """The settings that fix a run's plan and batch order (compared when a run restarts)."""
    d = {k: v for k, v in asdict(cfg).items() if k not in RESTART_FREE}
    d["resume"] = str(Path(cfg.resume).resolve()) if cfg.resume else None
    d["joint"] = list(d["joint"])
    d["sps_layers"] = list(d["sps_layers"])
    return {**d, "data_key": data_key}


# ---------------------------------------------------------------------------------------------
# the loop
# ---------------------------------------------------------------------------------------------
def _batches(n_seqs: int, n: int, rng: torch.Generator):
    order = torch.randperm(n_seqs, generator=rng).tolist()
    for i in range(0, len(order) - n + 1, n):
        yield order[i:i + n]


def _batch_stream(n_seqs: int, n: int, seed: int, skip: int = 0):
    """Batches of sequence indices epoch after epoch (a fresh seeded permutation of
    ``range(n_seqs)`` each), after the first ``skip``: a run resumed at step s sees exactly the
    batches an uninterrupted run sees from step s on."""
    rng = torch.Generator().manual_seed(seed)
    while True:
        for batch in _batches(n_seqs, n, rng):
            if skip > 0:
                skip -= 1
                continue
            yield batch


class _Student:
    """One drafter being trained: model, optimiser, LR plan, history, output directory."""

    def __init__(self, cfg: TrainConfig, tgt, d2t, out: Path, source: Source, plan: LRPlan,
                 key: dict, dtype: DTypeChoice) -> None:
        self.cfg, self.out, self.plan, self.key, self.dtype = cfg, out, plan, key, dtype
        out.mkdir(parents=True, exist_ok=True)
        self.objective = get_objective(cfg.arch)
        self.device = tgt.model.embed.weight.device
        self.model = self.objective.build(cfg, tgt, d2t, new=source.kind == "new").train()
        if source.kind != "new":
            mm = source.mismatch(_comparable_config(self.model.cfg))
            if mm:
                raise ValueError(f"{source.path} does not fit this run's {cfg.arch} drafter: {mm} "
                                 "(source's, this run's)")
            try:
                self.model.load_state_dict(source.state["model"])
            except RuntimeError as e:
                raise ValueError(f"{source.path} does not fit a {cfg.arch} drafter of depth "
                                 f"{cfg.depth}, draft vocab {cfg.draft_vocab}, MLP width "
                                 f"{cfg.mlp_width or 'of the target'} for this target: {e}") from e
        self.model.to(self.device)
        self.taps = self.objective.taps(self.model)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=plan.lr_at(source.step), betas=(0.9, 0.95),
                                     weight_decay=cfg.weight_decay)
        carried = source.kind == "restart" or (source.kind == "checkpoint" and cfg.lr_schedule
                                               == "continue")
        if carried:
            self.opt.load_state_dict(source.state["opt"])
        self.step = source.step
        st = source.state if source.kind in ("restart", "checkpoint") else {}
        self.history = st.get("history", {"loss": [], "eval": []})
        self.wall_s = st.get("wall_s", 0.0)
        if source.kind in ("checkpoint", "drafter"):
            self.resumed = {"from": str(source.path), "kind": source.kind, "step": source.step,
                            "lr_schedule": cfg.lr_schedule}
        else:
            self.resumed = st.get("resumed")
        self.ckpt = out / "checkpoint"
        self.log = MetricsLog(out / "metrics.jsonl")
        # a restart drops what was logged past its checkpoint; a resumed run starts from its
        # source's log (``<run>/checkpoint/state.pt`` -> ``<run>/metrics.jsonl``)
        seed_log = (MetricsLog(source.path.parent.parent / "metrics.jsonl")
                    if source.kind == "checkpoint" else None)
        self.log.keep_until(self.step, seed_from=seed_log)
        if source.kind != "new":
            print(f"{cfg.arch}: {'restarted' if source.kind == 'restart' else 'resumed'} at step "
                  f"{self.step} from {source.path}; LR plan {plan.to_dict()}")
            # checkpoints from before --dtype: bf16
            before = (st.get("dtype") or {"dtype": "bf16"})["dtype"]
            if source.kind in ("restart", "checkpoint") and before != dtype.dtype:
                print(f"{cfg.arch}: trained in {before} before, continues in {dtype.dtype} "
                      f"({dtype.reason})")

    def update(self, target, taps, tokens, targets) -> float:
        """One optimizer step on a batch: ``taps`` [B, L, nT*H] (its layers), ``tokens`` [B, L],
        ``targets`` the objective's level targets of this batch's teacher pass."""
        t0 = time.perf_counter()
        lr = self.plan.lr_at(self.step)
        for g in self.opt.param_groups:
            g["lr"] = lr
        with student_autocast(self.dtype.dtype, self.device):
            logits = self.objective.forward(self.model, target, taps, tokens)     # [B, L-1, d, Vd]
        loss, per_level = self.objective.loss(logits, targets, self.cfg.gamma)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        self.opt.step()
        synchronize(self.device)  # the wall time of an asynchronous device counts the work done
        self.step += 1
        self.wall_s += time.perf_counter() - t0
        value, levels = float(loss.detach()), per_level.tolist()
        self.history["loss"].append((self.step, value, levels))
        self.log.append({"kind": "train", "step": self.step, "loss": value, "lr": lr,
                         "per_level_loss": levels, "wall_s": round(self.wall_s, 3)})
        return value

    def record_eval(self, evals: dict[str, dict], held_out: bool) -> None:
        self.history["eval"].append((self.step, evals))
        self.log.append(*({"kind": "eval", "step": self.step, "domain": dom, "held_out": held_out,
                           **ev}
                          for dom, ev in evals.items()))

    def checkpoint_state(self, data_pos: int) -> dict:
        """Everything a continued run needs to equal the uninterrupted one."""
        return {"model": self.model.state_dict(), "opt": self.opt.state_dict(),
                "step": self.step, "plan": self.plan.to_dict(), "data_pos": data_pos,
                "data_key": self.key["data_key"], "run_key": self.key,
                "config": _comparable_config(self.model.cfg), "history": self.history,
                "wall_s": self.wall_s, "resumed": self.resumed, "rng": torch.get_rng_state(),
                "dtype": self.dtype.to_dict()}


def _save_checkpoints(students: list[_Student], data_pos: int) -> None:
    """Every student's checkpoint, written as one (atomic across students: see
    :func:`~dart_ray.training.checkpoint.save_states_together`)."""
    from dart_ray.training.checkpoint import save_states_together

    save_states_together([(st.checkpoint_state(data_pos), st.ckpt) for st in students],
                         students[0].ckpt)


def _comparable_config(model_cfg) -> dict:
    """The fields of a drafter's config a resumed run must agree on (as saved in its JSON
    config)."""
    d = asdict(model_cfg)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()
            if k in ("arch", "depth", "max_depth", "draft_vocab", "tap_layers", "num_layers",
                     "init_layers", "target_id", "tie_head")}


class _StopRequest:
    """SIGINT/SIGTERM during training ask for a clean stop after the current step (checkpoint,
    final evaluation, drafter); a second signal, or one outside the loop, acts as usual."""

    def __init__(self) -> None:
        self.requested = False
        self._old: dict = {}

    def __enter__(self) -> Self:
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        import signal

        if self.requested:  # second signal: give up on the clean stop
            signal.signal(signum, self._old.get(signum, signal.SIG_DFL))
            raise KeyboardInterrupt
        self.requested = True
        print(f"\nsignal {signum}: stopping after this step (checkpoint, final evaluation); again "
              "to abort")

    def __exit__(self, *exc) -> None:
        import signal

        for sig, old in self._old.items():
            signal.signal(sig, old)


def _evaluate(students: list[_Student], target, cache, val: dict[str, list],
              t2d: torch.Tensor | None, dtype: str, held_out: bool) -> list[dict[str, dict]]:
    """Evaluate ``students`` on the held-out sequences (one teacher pass per batch for all of them)
    and record it in each one's history and log; returns each one's metrics by domain."""
    evs = evaluate_domains([(st.model, st.cfg) for st in students], target, cache, val, t2d, dtype)
    for st, ev in zip(students, evs, strict=True):
        st.record_eval(ev, held_out)
    return evs


def _val_by_domain(train_rows, val_rows, n: int) -> tuple[dict[str, list], bool]:
    """Held-out sequences per domain (up to ``n`` each); without any held-out rows, the training
    split's last ``n`` per domain (flagged not held out)."""
    held_out = bool(val_rows)
    rows = val_rows if held_out else train_rows
    out: dict[str, list] = {}
    for ids, plen, dom in rows:
        out.setdefault(dom, []).append((ids, plen))
    return {dom: (seqs[:n] if held_out else seqs[-n:])
            for dom, seqs in sorted(out.items())}, held_out


def _revocab_source(src: Source, d2t: torch.Tensor, target_head: torch.Tensor, seqs,
                    vocab: int) -> Source:
    """``src`` with its head moved to the draft vocabulary ``d2t`` (``--revocab``)."""
    model = dict(src.state["model"])
    old = model["d2t"].long()
    print(f"revocab: draft vocab {len(old)} -> {len(d2t)} ({int(torch.isin(d2t, old).sum())} "
          f"shared); the old one covers {coverage(seqs, old, vocab):.1%} of the training answers' "
          "tokens")
    model["head.weight"] = revocab_head(model["head.weight"], old, d2t, target_head)
    model["d2t"] = d2t.clone()
    return _with_model(src, model, draft_vocab=len(d2t))


def _grow_source(src: Source, cfg: TrainConfig) -> Source:
    """``src`` with its MLP grown to ``cfg.mlp_width`` (unchanged when it already has it)."""
    width = src.state["model"]["mlp.down.weight"].shape[1]
    if width == cfg.mlp_width:
        return src
    model = grow_mlp(src.state["model"], cfg.mlp_width, cfg.seed)     # refuses a narrower width
    if src.kind == "checkpoint" and cfg.lr_schedule != "fresh":
        raise ValueError(f"growing {src.path}'s MLP ({width} -> {cfg.mlp_width} units) needs "
                         "--lr-schedule fresh: its optimizer moments have the old shapes")
    print(f"mlp: {width} -> {cfg.mlp_width} units (new down-projection columns start at zero)")
    return _with_model(src, model, intermediate_size=cfg.mlp_width)


def _with_model(src: Source, model: dict[str, torch.Tensor], **config) -> Source:
    """``src`` with new weights ``model`` and its recorded config updated by ``config``."""
    config = {**(src.state.get("config") or {}), **config}
    return dataclasses.replace(src, state={**src.state, "model": model, "config": config})


def _start_sources(cfg: TrainConfig, dirs: dict[str, Path]) -> dict[str, Source]:
    """Where each student starts: its own checkpoint (restart), ``cfg.resume``, or new."""
    from dart_ray.training.checkpoint import (
        STATE_FILE,
        find_resume,
        finish_joint_commit,
        load_state,
    )

    # a joint checkpoint a crash interrupted: completed, or its pending states dropped
    finish_joint_commit(dirs[cfg.arch] / "checkpoint", [d / "checkpoint" for d in dirs.values()])
    out = {}
    for arch, d in dirs.items():
        own = d / "checkpoint" / STATE_FILE
        if own.is_file():
            out[arch] = Source("restart", own, load_state(own))
        elif cfg.resume is not None:
            res = Path(cfg.resume).resolve()
            if res == d.resolve() or d.resolve() in res.parents:
                raise ValueError(f"--resume {cfg.resume} is inside --out {d}: resume into a new "
                                 "--out directory (a run restarts from its own checkpoint by "
                                 "itself)")
            files = tuple({s.config_file for s in method_specs() if s.objective == arch
                           and s.config_file})
            out[arch] = find_resume(cfg.resume, files)
        else:
            out[arch] = Source("new")
    for src in out.values():
        if src.kind == "restart" and "run_key" not in src.state:
            raise ValueError(f"{src.path} was written before runs recorded their LR plan; continue "
                             f"from it into a new --out with --resume {src.path.parent} "
                             "--lr-schedule fresh")
    return out


def _started_vocab(src: Source) -> int | None:
    """Draft vocabulary size of the drafter a run starts from (0 = a full tied head); None for a
    new one."""
    if src.kind == "new":
        return None
    d2t = src.state["model"].get("d2t")
    return 0 if d2t is None else len(d2t)


def train(cfg: TrainConfig, progress: bool = True) -> dict:
    """Train ``cfg.arch`` (and every arch in ``cfg.joint``, on the very same batches and teacher
    pass: equal data and steps by construction). Returns the summary of ``cfg.arch``; with ``joint``
    the students live in ``out/<arch>/``, otherwise in ``out/``. Resumable (see
    :mod:`dart_ray.training.checkpoint`)."""
    from dart_ray.models import load_target
    from dart_ray.training.gen_data import describe_data, load_rows

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, dev)
    print(f"device {dev}, dtype {dtype.dtype} ({dtype.requested}: {dtype.reason})")
    tgt = load_target(cfg.model, dtype.dtype, dev, max_seq_len=cfg.max_len + 8)
    target, args = tgt.model, tgt.args
    train_rows = load_rows(cfg.data, "train")
    if not train_rows:
        raise ValueError(f"no training rows in {cfg.data}")
    train_seqs = [(ids, plen) for ids, plen, _ in train_rows]
    val_rows = load_rows(cfg.data, "val")
    if cfg.eval_data:
        val_rows += load_rows(cfg.eval_data, "val")
    val, held_out = _val_by_domain(train_rows, val_rows, cfg.eval_seqs)
    cache = target.new_cache(cfg.seqs_per_step, cfg.max_len + 8)
    steps_per_epoch = len(train_seqs) // cfg.seqs_per_step
    if steps_per_epoch == 0:
        raise ValueError(f"{len(train_seqs)} training sequences make no batch of "
                         f"seqs_per_step={cfg.seqs_per_step}")
    run_steps = max(1, int(steps_per_epoch * cfg.epochs))
    if cfg.max_steps:
        run_steps = min(run_steps, cfg.max_steps)
    cfgs = {cfg.arch: dataclasses.replace(cfg, joint=())}
    for spec in cfg.joint:
        arch, _, d = spec.partition(":")
        cfgs.setdefault(arch, dataclasses.replace(cfg, arch=arch, joint=(),
                                                  depth=int(d) if d else cfg.depth))
    archs = tuple(cfgs)
    dirs = {a: (out / a if len(archs) > 1 else out) for a in archs}
    sources = _start_sources(cfg, dirs)
    if cfg.draft_vocab is None:
        size = _started_vocab(sources[cfg.arch]) if not cfg.revocab else None
        cfg = dataclasses.replace(cfg, draft_vocab=DEFAULT_DRAFT_VOCAB if size is None else size)
        cfgs = {a: dataclasses.replace(c, draft_vocab=cfg.draft_vocab) for a, c in cfgs.items()}
        whose = "the started drafter's" if size is not None else "the default"
        print(f"draft vocab size {cfg.draft_vocab}: {whose}")
    data_key = data_fingerprint(train_seqs, cfg.seqs_per_step, cfg.max_len, cfg.seed)
    key = run_key(cfg, data_key)
    for arch, src in sources.items():
        if src.kind != "restart":
            continue
        # a setting added after the checkpoint was written reads as its default there
        old = {**{k: v for k, v in config_defaults().items() if k not in RESTART_FREE},
               **src.state["run_key"]}
        if isinstance(old.get("revocab"), bool):     # a bool before "extend" existed
            old["revocab"] = "replace" if old["revocab"] else None
        diff = {k: (old.get(k), key.get(k)) for k in sorted(set(old) | set(key))
                if old.get(k) != key.get(k)}
        if diff:
            raise ValueError(f"{src.path} belongs to a run with other settings {diff} (old, now); "
                             "restarting it with these would silently re-plan it. Rerun with the "
                             "old settings to continue it, or start a new --out with --resume "
                             f"{dirs[arch]} --lr-schedule continue|fresh")
    if len({s.step for s in sources.values()}) > 1:
        raise RuntimeError("joint students resumed at different steps "
                           f"{[s.step for s in sources.values()]} (checkpoints written before "
                           "joint checkpoints were committed together); continue one of them "
                           "into a new --out with --resume, or train them separately")
    # draft vocabulary: a started drafter keeps its own (unless --revocab re-chooses it); a new one
    # takes the most frequent tokens of the data's answers
    t2d = d2t = None
    if cfg.mlp_width and sources[cfg.arch].kind in ("checkpoint", "drafter"):
        sources[cfg.arch] = _grow_source(sources[cfg.arch], cfg)
    if cfg.revocab and sources[cfg.arch].kind in ("checkpoint", "drafter"):
        keep = sources[cfg.arch].state["model"]["d2t"] if cfg.revocab == "extend" else None
        if keep is not None and len(keep) == cfg.draft_vocab:
            raise ValueError(f"revocab 'extend' adds no token: draft_vocab {cfg.draft_vocab} is "
                             "the resumed drafter's own size; give a larger one (--draft-vocab)")
        sources[cfg.arch] = _revocab_source(
            sources[cfg.arch],
            choose_draft_vocab(train_seqs, cfg.draft_vocab, args.vocab_size, keep=keep),
            target.lm_head.weight, train_seqs, args.vocab_size)
    kept = [s.state["model"]["d2t"] for s in sources.values() if s.kind != "new"
            and "d2t" in s.state["model"]]
    if kept:
        d2t = kept[0].long()
        if (any(not torch.equal(k.long(), d2t) for k in kept)
                or (cfg.draft_vocab and len(d2t) != cfg.draft_vocab)):
            sizes = sorted({len(k) for k in kept})
            raise ValueError("the resumed drafters' draft vocabularies differ from each other or "
                             f"from draft_vocab={cfg.draft_vocab} (resumed: {sizes} tokens); pass "
                             "--draft-vocab at the resumed size, or --revocab to re-choose it")
    elif cfg.draft_vocab:
        d2t = choose_draft_vocab(train_seqs, cfg.draft_vocab, args.vocab_size)
    if d2t is not None:
        print(f"draft vocab {len(d2t)}: covers {coverage(train_seqs, d2t, args.vocab_size):.1%} "
              "of the training answers' tokens")
        t2d = target_to_draft(d2t, args.vocab_size).to(dev)
    src0 = sources[cfg.arch]
    # joint students share it
    plan = plan_for(src0, cfg.lr_schedule, cfg.lr, cfg.warmup_steps, run_steps)
    students = [_Student(c, tgt, d2t, dirs[a], sources[a], plan, key, dtype)
                for a, c in cfgs.items()]
    step = src0.step
    # data position: batches of the seeded stream already consumed (kept when the data is the same)
    st0 = src0.state or {}
    data_pos = int(st0.get("data_pos", 0)) if st0.get("data_key") == data_key else 0
    if src0.kind == "checkpoint" and cfg.lr_schedule == "continue":
        old_key = st0.get("run_key") or {}
        batching = {k: (old_key[k], getattr(cfg, k)) for k in ("seqs_per_step", "max_len", "seed")
                    if k in old_key and old_key[k] != getattr(cfg, k)}
        if batching:
            raise ValueError(
                f"--lr-schedule continue carries on {src0.path}'s plan, optimizer and place in "
                f"its data, but {batching} (checkpoint's, now) batch the data otherwise: its "
                "place would be lost and the first batches seen again mid-plan. Use the "
                "checkpoint's values, or --lr-schedule fresh")
    if src0.kind == "checkpoint" and st0.get("data_key") != data_key:
        print(f"{src0.path} was trained on other data: this run reads its data from the start")
    if "rng" in st0 and src0.kind == "restart":
        torch.set_rng_state(st0["rng"])
    end = plan.end
    tap_order = tuple(sorted({t for s in students for t in s.taps}))
    if packing_supported(dev, target.embed.weight.dtype):
        # the frozen teacher's blocks only run inference (students were built and copied above); the
        # LM head stays dense because the students' objectives read its weight every step
        for layer in target.layers:
            pack_linears(layer)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=end, initial=step, desc="train-drafter " + ",".join(archs), unit="step")
    t_start = time.perf_counter()
    tokens_seen = 0
    batches = _batch_stream(len(train_seqs), cfg.seqs_per_step, cfg.seed, skip=data_pos)
    seq_keys = [seq_key(ids[:cfg.max_len]) for ids, _ in train_seqs]
    wanted = set(seq_keys)
    teacher = TeacherCache(int(cfg.teacher_cache_gb * 2**30), target.embed.weight.dtype,
                           cfg.teacher_cache, key=teacher_fields(tgt, dtype.dtype, tap_order,
                                                                 cfg.teacher_topk, dev),
                           wanted=wanted)
    if teacher.loaded:
        print(f"teacher cache: {teacher.loaded} of this run's {len(wanted)} sequences read "
              f"from {teacher.dir} ({teacher.bytes / 2**30:.2f} GiB)")
    stop_reason = "plan complete"
    with _StopRequest() as stop:
        while step < end:
            idx = next(batches)
            tokens, lens = pad_batch([train_seqs[k][0][:cfg.max_len] for k in idx], dev)
            prompt_lens = [train_seqs[k][1] for k in idx]
            t0 = time.perf_counter()
            keys = [seq_keys[k] for k in idx]
            outs = teacher.lookup(keys, lens, dev)
            if outs is None:
                outs = teacher_pass(target, cache, tokens, lens, tap_order, cfg.teacher_topk)
                teacher.store(keys, lens, *outs)
            taps, top_id, top_lp = outs
            synchronize(dev)
            # the shared teacher pass, split evenly
            teacher_s = (time.perf_counter() - t0) / len(students)
            losses = {}
            for st in students:
                targets = st.objective.targets(top_id, top_lp, t2d, st.cfg, lens, prompt_lens)
                losses[st.cfg.arch] = st.update(target, select_taps(taps, tap_order, st.taps),
                                                tokens, targets)
                st.wall_s += teacher_s
            step += 1
            data_pos += 1
            tokens_seen += sum(lens)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(**{k: f"{v:.3f}" for k, v in losses.items()},
                                tok_s=f"{tokens_seen / (time.perf_counter() - t_start):.0f}",
                                cached=teacher.hits)
            out_of_time = (bool(cfg.time_budget_s)
                           and time.perf_counter() - t_start >= cfg.time_budget_s)
            if step % cfg.eval_every == 0 or step == end:
                for st, ev in zip(students, _evaluate(students, target, cache, val, t2d,
                                                      dtype.dtype, held_out), strict=True):
                    print(f"\n{st.cfg.arch} step {step}: " + "; ".join(
                        f"{dom} top1 {[round(a, 3) for a in e['top1'][:4]]} chain_tau "
                        f"{e['chain_tau']:.2f} (answers: top1 "
                        f"{[round(a, 3) for a in e['answer']['top1'][:2]]} chain_tau "
                        f"{e['answer']['chain_tau']:.2f})"
                        for dom, e in ev.items()))
            if step % cfg.ckpt_every == 0 or step >= end or out_of_time or stop.requested:
                teacher.save()
                _save_checkpoints(students, data_pos)
            if out_of_time or stop.requested:
                stop_reason = "time budget" if out_of_time else "signal"
                print(f"\nstopped at step {step} of {end} ({stop_reason}); checkpoint saved: rerun "
                      "the same command to continue")
                break
    if bar is not None:
        bar.close()
    summaries = {}
    data_info = describe_data(cfg.data)
    # the drafters first: a stop that cannot wait for the final evaluation (an orchestrator's short
    # grace period after SIGTERM, a second signal) still leaves each one exported
    for st in students:
        save_dir_atomic(lambda d, m=st.model: _save_bf16(m, d), st.out / "drafter")
    unevaluated = [st for st in students
                   if not st.history["eval"] or st.history["eval"][-1][0] != step]
    if unevaluated:
        _evaluate(unevaluated, target, cache, val, t2d, dtype.dtype, held_out)
        _save_checkpoints(students, data_pos)
    for st in students:
        final_ev = st.history["eval"][-1][1]
        summary = {"arch": st.cfg.arch, "steps": step, "plan_end": end, "stopped": stop_reason,
                   "train_seqs": len(train_seqs), "val_seqs": sum(len(v) for v in val.values()),
                   "val_seqs_by_domain": {k: len(v) for k, v in val.items()}, "held_out": held_out,
                   "train_rows_by_domain": _count_domains(train_rows), "data": data_info,
                   "train_wall_s": st.wall_s, "joint_with": [a for a in archs if a != st.cfg.arch],
                   "tokens_seen_this_run": tokens_seen, "lr_plan": st.plan.to_dict(),
                   "resumed": st.resumed, "final_eval": final_ev.get("all", {}),
                   "final_eval_by_domain":
                       {k: v for k, v in final_ev.items() if k != "all"},
                   "config": asdict(st.cfg), "dtype": dtype.to_dict(),
                   "losses": [h[1] for h in st.history["loss"]],
                   "size_mb": (st.out / "drafter" / "model.safetensors").stat().st_size / 2**20}
        (st.out / "train_summary.json").write_text(json.dumps(summary, indent=2))
        plot_metrics(st.log.records(), st.out / "training.png", title=f"{st.cfg.arch} drafter")
        summaries[st.cfg.arch] = summary
    return summaries[cfg.arch]


def _save_bf16(model, path: Path) -> None:
    """The drafter as shipped: bf16 weights (the training copy stays fp32)."""
    import copy

    copy.deepcopy(model).to(torch.bfloat16).save(path)


def _count_domains(rows) -> dict[str, int]:
    out: dict[str, int] = {}
    for _, _, dom in rows:
        out[dom] = out.get(dom, 0) + 1
    return out
