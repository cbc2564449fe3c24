"""What ``train-drafter`` measures while it trains: held-out per-level accuracy per domain, expected
chain length (:func:`evaluate`, :func:`evaluate_domains`), the metrics log (``metrics.jsonl``) and
its plot (``training.png``).

Definitions (held-out rows, per domain ``chat`` / ``code`` / ``text``: the target's answers to chat
and code prompts, and teacher-only stdlib source; ``chat@SET`` / ``code@SET``: its answers to an
evaluation prompt set, ``gen-data --eval-prompts SET``, requests written apart from every training
prompt; ``all`` pools them):

* **level-k top-1 / top-5**: over every prefix j of a held-out sequence with position j+k inside
  it, whether the drafter's level-k prediction (top-1, or any of its top-5) equals the target's
  argmax at position j+k. Levels are teacher-forced: for DART/Medusa a level's prediction does
  not depend on the drafted tokens anyway; EAGLE's level k is fed the true tokens before it.
* **chain_tau** (the primary number, "expected chain length"): 1 + the mean, over prefixes with
  all d levels inside the sequence, of the number of *leading* correct top-1 levels — the tokens
  one greedy step would commit with a single-chain draft of depth d (accepted drafts + the bonus
  token). SpS: its chain of ``depth`` one-token drafts, level 1 at j, j+1, ... .
* **chain_len_indep**: 1 + sum_{k=1..d} prod_{j<=k} top1_j, the same quantity if levels were
  independent. Levels of one prefix are positively correlated (an easy position makes the next
  one easy), so it is usually below chain_tau; logged because it is the form often quoted.
* **answer** (nested in each domain's record): the same numbers over the prefixes a drafter meets
  while serving only, those that end inside the answer (prefix j >= prompt length - 1: the root
  x_{j+1} is a generated token, so every level predicts a generated token). The top-level numbers
  count every prefix, the prompt's too (chat template, the user's request, a code prompt's
  human-written docstring), which no drafter ever drafts after; they are kept for comparison with
  earlier cards. Teacher-only text has no prompt: its two agree.
* **level1_by_confidence**: level-1 top-1 split by how sure the target is of the token it
  predicts (its top-1 probability there, in the bins of ``CONF_EDGES``), with each bin's share of
  the prefixes: what is hard for the drafter and what is hard for anyone (a token the target gives
  0.3 is one a drafter seldom matches). **level1_in_vocab**: the share of level-1 tokens inside
  the drafter's draft vocabulary (the others it can never draft).

Trees accept more than a chain (several candidates per level); the bench measures that tau.

``metrics.jsonl`` records, one JSON object a line:
``{"kind": "train", "step", "loss", "lr", "per_level_loss", "wall_s"}`` every step and
``{"kind": "eval", "step", "domain", "top1", "top5", "chain_tau", "chain_len_indep", "n_prefixes",
"level1_in_vocab", "level1_by_confidence": [{"p_min", "share", "top1"}, ...], "answer": {the same
over answer prefixes}, "held_out"}`` per domain at every evaluation. A
restarted run drops the records past its checkpoint before appending, so the log of a resumed run
equals an uninterrupted run's.
"""

from __future__ import annotations

import json
import operator
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import reduce
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dart_ray.training.objectives import (
    answer_prefixes,
    get_objective,
    level_positions,
    pad_batch,
    select_taps,
    student_autocast,
    teacher_pass,
)

if TYPE_CHECKING:
    from dart_ray.training.trainer import TrainConfig


PARTS = ("every", "answer")
"""The prefixes a count covers: every prefix, or the answer's (:func:`answer_prefixes`)."""
CONF_EDGES = (0.3, 0.5, 0.7, 0.9)
"""Bin edges of the target's top-1 probability for ``level1_by_confidence``."""


@dataclass
class LevelCounts:
    """Raw counts of one evaluation (summable across batches and domains)."""

    top1: list[float]
    """Correct top-1 predictions per level."""
    top5: list[float]
    total: list[float]
    """Prefixes with level k inside their sequence, per level."""
    chain_sum: float = 0.0
    """Sum over full prefixes of the number of leading correct levels."""
    n_prefixes: int = 0
    """Prefixes with all levels inside their sequence."""
    chain_levels: int | None = None
    """Chain length when it differs from the number of levels (SpS: depth one-token drafts)."""
    conf_top1: list[float] = field(default_factory=lambda: [0.0] * (len(CONF_EDGES) + 1))
    """Correct level-1 top-1 predictions per bin of the target's top-1 probability."""
    conf_total: list[float] = field(default_factory=lambda: [0.0] * (len(CONF_EDGES) + 1))
    """Level-1 prefixes per bin of the target's top-1 probability."""
    in_vocab: float = 0.0
    """Level-1 prefixes whose token is inside the drafter's draft vocabulary (all without one)."""
    meta: dict = field(default_factory=dict)

    @classmethod
    def zeros(cls, levels: int, chain_levels: int | None = None) -> LevelCounts:
        return cls([0.0] * levels, [0.0] * levels, [0.0] * levels, chain_levels=chain_levels)

    def __add__(self, other: LevelCounts) -> LevelCounts:
        def add(x: list[float], y: list[float]) -> list[float]:
            return [a + b for a, b in zip(x, y, strict=True)]

        return LevelCounts(add(self.top1, other.top1), add(self.top5, other.top5),
                           add(self.total, other.total), self.chain_sum + other.chain_sum,
                           self.n_prefixes + other.n_prefixes, self.chain_levels,
                           add(self.conf_top1, other.conf_top1),
                           add(self.conf_total, other.conf_total), self.in_vocab + other.in_vocab)

    def summary(self) -> dict:
        top1 = [c / max(t, 1.0) for c, t in zip(self.top1, self.total, strict=True)]
        top5 = [c / max(t, 1.0) for c, t in zip(self.top5, self.total, strict=True)]
        n1 = max(self.total[0], 1.0)
        lows = (0.0, *CONF_EDGES)
        by_conf = [{"p_min": lo, "share": t / n1, "top1": c / max(t, 1.0)}
                   for lo, c, t in zip(lows, self.conf_top1, self.conf_total, strict=True)]
        return {"top1": top1, "top5": top5,
                "chain_tau": 1.0 + self.chain_sum / max(self.n_prefixes, 1),
                "chain_len_indep": chain_len_indep(top1, self.chain_levels),
                "n_prefixes": self.n_prefixes, "level1_in_vocab": self.in_vocab / n1,
                "level1_by_confidence": by_conf, **self.meta}


def chain_len_indep(top1: list[float], chain_levels: int | None = None) -> float:
    """1 + sum_k prod_{j<=k} top1_j (``chain_levels``: a one-level drafter's chain of that many
    drafts, every level at ``top1[0]``)."""
    acc = [top1[0]] * chain_levels if chain_levels else list(top1)
    out, p = 1.0, 1.0
    for a in acc:
        p *= a
        out += p
    return out


@torch.no_grad()
def evaluate(students: Sequence[tuple[torch.nn.Module, TrainConfig]], target, cache, seqs: list,
             t2d: torch.Tensor | None, dtype: str) -> list[dict[str, LevelCounts]]:
    """Per student ``(model, cfg)``: counts of per-level top-1/top-5 hits vs the target's argmax
    and of leading correct levels on ``seqs`` (``(ids, prompt_len)`` pairs), over every prefix
    (``"every"``) and over the answer's prefixes (``"answer"``, the ones a drafter meets while
    serving), batched like training (one teacher pass per batch serves every student, as in the
    loop; the batching and the teacher's top-K are the run's, the same for every student), each
    student's forward under the run's ``dtype``
    (:func:`~dart_ray.training.objectives.student_autocast`)."""
    objs = [get_objective(cfg.arch) for _, cfg in students]
    wants = [obj.taps(model) for obj, (model, _) in zip(objs, students, strict=True)]
    order = tuple(sorted({t for w in wants for t in w}))
    run = students[0][1]
    counts = [{part: LevelCounts.zeros(obj.levels(cfg), obj.chain_levels(cfg))
               for part in PARTS}
              for obj, (_, cfg) in zip(objs, students, strict=True)]
    for model, _ in students:
        model.eval()
    for i in range(0, len(seqs), run.seqs_per_step):
        batch = seqs[i:i + run.seqs_per_step]
        tokens, lens = pad_batch([s[0][:run.max_len] for s in batch], target.embed.weight.device)
        taps, top_id, top_lp = teacher_pass(target, cache, tokens, lens, order, run.teacher_topk)
        truth = top_id[..., 0]                                                # [B, L] target argmax
        sure = top_lp[..., 0].float().exp()                                   # [B, L] its prob.
        answer = answer_prefixes([s[1] for s in batch], tokens.shape[1] - 1, tokens.device)
        for k, (obj, want, (model, cfg)) in enumerate(zip(objs, wants, students, strict=True)):
            got = _score(obj, model, cfg, target, select_taps(taps, order, want), tokens, lens,
                         truth, sure, t2d, dtype, answer)
            for part in counts[k]:
                counts[k][part] += got[part]
    for model, _ in students:
        model.train()
    return counts


def _score(obj, model, cfg: TrainConfig, target, taps: torch.Tensor | None,
           tokens: torch.Tensor, lens: list[int], truth: torch.Tensor, sure: torch.Tensor,
           t2d: torch.Tensor | None, dtype: str, answer: torch.Tensor) -> dict[str, LevelCounts]:
    """One student's counts on one batch (``truth`` [B, L]: the target's argmax, ``sure`` [B, L]
    its probability; ``answer`` [B, J]: the answer prefixes), over every prefix and over the
    answer's."""
    d = obj.levels(cfg)
    dev = tokens.device
    with student_autocast(dtype, dev):
        logits = obj.forward(model, target, taps, tokens)                   # [B, J, d, Vd]
    J = tokens.shape[1] - 1
    pos, valid = level_positions(J, d, lens, dev)                             # [J, d], [B, J, d]
    idx = pos.clamp(max=tokens.shape[1] - 1)
    tgt = truth[:, idx]                                                       # [B, J, d]
    pred5 = logits.topk(5, dim=-1).indices                                    # [B, J, d, 5]
    if t2d is not None:
        pred5 = model.d2t[pred5]
    hit1 = pred5[..., 0] == tgt                                               # [B, J, d]
    hit5 = (pred5 == tgt[..., None]).any(-1)
    nbin = len(CONF_EDGES) + 1
    conf_bin = torch.bucketize(sure[:, idx[:, 0]],                           # [B, J] level 1's
                               torch.tensor(CONF_EDGES, device=dev), right=True)
    inside = (torch.isin(tgt[..., 0], model.d2t.to(dev)) if t2d is not None
              else torch.ones_like(hit1[..., 0]))                             # [B, J]
    out = {}
    for part, keep in (("every", None), ("answer", answer)):
        v = valid if keep is None else valid & keep[..., None]                # [B, J, d]
        ok1, ok5 = hit1 & v, hit5 & v
        lead, full = obj.leading_correct(ok1, v, lens, cfg)                   # [B, J], [B, J]
        if keep is not None:
            full = full & keep
        v1 = v[..., 0]                                                        # [B, J]
        out[part] = LevelCounts(ok1.sum((0, 1)).float().tolist(), ok5.sum((0, 1)).float().tolist(),
                                v.sum((0, 1)).float().tolist(), float(lead[full].sum()),
                                int(full.sum()), chain_levels=obj.chain_levels(cfg),
                                conf_top1=torch.bincount(conf_bin[ok1[..., 0]], minlength=nbin)
                                .float().tolist(),
                                conf_total=torch.bincount(conf_bin[v1], minlength=nbin)
                                .float().tolist(),
                                in_vocab=float((inside & v1).sum()))
    return out


def evaluate_domains(students: Sequence[tuple[torch.nn.Module, TrainConfig]], target, cache,
                     val: dict[str, list], t2d: torch.Tensor | None,
                     dtype: str) -> list[dict[str, dict]]:
    """Per student ``(model, cfg)``: held-out metrics per domain (``val``: domain -> sequences)
    and pooled (``all``), each over every prefix with the answer prefixes' nested as
    ``"answer"``."""
    by_dom = {dom: evaluate(students, target, cache, seqs, t2d, dtype)
              for dom, seqs in val.items() if seqs}
    out = []
    for k in range(len(students)):
        counts = {dom: c[k] for dom, c in by_dom.items()}
        if counts:
            counts["all"] = {part: reduce(operator.add, (c[part] for c in counts.values()))
                             for part in PARTS}
        out.append({dom: {**c["every"].summary(), "answer": c["answer"].summary()}
                    for dom, c in counts.items()})
    return out


class MetricsLog:
    """Append-only JSONL of training and evaluation records (``metrics.jsonl`` in the run dir)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def records(self) -> list[dict]:
        if not self.path.is_file():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a crash mid-write
                continue
        return out

    def append(self, *records: dict) -> None:
        with open(self.path, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
            f.flush()

    def keep_until(self, step: int, seed_from: MetricsLog | None = None) -> None:
        """Drop records past ``step`` (a restart continues from its checkpoint at ``step``); when
        this log is empty, start it with ``seed_from``'s records up to ``step`` (a run resumed
        from another run continues that run's curves)."""
        src = self if self.path.is_file() or seed_from is None else seed_from
        keep = [r for r in src.records() if r.get("step", 0) <= step]
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
        os.replace(tmp, self.path)


def plot_metrics(records: list[dict], path: str | Path, title: str = "") -> bool:
    """Loss, per-level held-out top-1 per domain and chain length over steps -> ``path`` (PNG).
    False when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    domains = sorted({r["domain"] for r in evals if r["domain"] != "all"}) or ["all"]
    fig, axes = plt.subplots(1, 2 + len(domains), figsize=(5 * (2 + len(domains)), 4))
    ax = axes[0]
    if train:
        s = [r["step"] for r in train]
        ax.plot(s, [r["loss"] for r in train], lw=0.6, alpha=0.5, label="loss")
        w = max(1, len(train) // 50)
        if w > 1:
            windows = [train[max(0, i - w + 1):i + 1] for i in range(len(train))]
            sm = [sum(r["loss"] for r in win) / len(win) for win in windows]
            ax.plot(s, sm, lw=1.2, label=f"mean of {w}")
        ax.set_xlabel("step")
        ax.set_ylabel("weighted KL loss")
        ax.set_title("training loss")
        ax.legend(fontsize=7)
    for ax, dom in zip(axes[1:], domains, strict=False):
        rs = [r for r in evals if r["domain"] == dom]
        if rs:
            s = [r["step"] for r in rs]
            for t in range(len(rs[-1]["top1"])):
                ax.plot(s, [r["top1"][t] if t < len(r["top1"]) else float("nan") for r in rs],
                        marker="o", ms=3, label=f"level {t + 1}")
            ax.legend(fontsize=7)
        ax.set_xlabel("step")
        ax.set_ylabel("top-1 accuracy (held-out)")
        ax.set_title(f"per-level accuracy: {dom}")
    ax = axes[-1]
    for dom in domains:
        rs = [r for r in evals if r["domain"] == dom]
        if rs:
            s = [r["step"] for r in rs]
            line, = ax.plot(s, [r["chain_tau"] for r in rs], marker="o", ms=3,
                            label=f"{dom}: chain_tau")
            ax.plot(s, [r["chain_len_indep"] for r in rs], ls="--", color=line.get_color(),
                    label=f"{dom}: 1 + sum prod top1")
            ans = [(st, r["answer"]["chain_tau"]) for st, r in zip(s, rs, strict=True)
                   if "answer" in r]
            if ans and dom != "text":
                ax.plot(*zip(*ans, strict=True), ls=":", marker="x", ms=3, color=line.get_color(),
                        label=f"{dom}: chain_tau, answers only")
    ax.set_xlabel("step")
    ax.set_ylabel("expected chain length")
    ax.set_title("expected accepted chain length")
    ax.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
