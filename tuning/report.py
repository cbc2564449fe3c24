"""Summary table and PNG plots (optimisation history, parameter importances and, for the
``throughput+p95`` objective, the Pareto front) of a tune run."""

from __future__ import annotations

import warnings
from pathlib import Path


def short_number(v) -> str:
    """A number for a log line: floats to 3 significant digits, anything else as is."""
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def _f(v, nd=1) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def format_summary(results, space) -> str:
    """Markdown table: per batch size, default vs best on the held-out split, plus changed knobs."""
    rows = [("| batch | trials (ok/pruned/err/intr/load) | default tok/s | tuned tok/s | gain | "
             "tau def -> tuned | p95 s def -> tuned | chosen | changed knobs |"),
            "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        c = r.counts
        changed = ""
        if r.best_params:
            diffs = [f"{k}={_v(r.best_params[k])}" for k in space.names
                     if k in r.best_params and _v(r.best_params[k]) != _v(r.default_params.get(k))]
            changed = ", ".join(diffs) or "(none)"
        gain = ("-" if r.default_tps is None or r.best_tps is None
                else f"{r.best_tps / r.default_tps:.2f}x")
        trials = (f"{c['complete']}/{c['pruned']}/{c['failed']}/{c['interrupted']}"
                  f"/{c.get('load_flagged', 0)}")
        rows.append(f"| {r.batch_size} | {trials} | {_f(r.default_tps)} | {_f(r.best_tps)} | "
                    f"{gain} | {_f(r.tau_default, 2)} -> {_f(r.tau_best, 2)} | "
                    f"{_f(r.default_p95, 2)} -> {_f(r.best_p95, 2)} | {r.chosen} | {changed} |")
    notes = [f"- bs {r.batch_size}: {r.note}" for r in results if r.note]
    return "\n".join(rows + (["", *notes] if notes else []))


def _v(x):
    return round(x, 3) if isinstance(x, float) else x


def write_plots(studies: dict, out: Path, chosen: dict | None = None,
                p95_bounds: dict | None = None) -> list[Path]:
    """``<out stem>.history.png`` and ``<out stem>.importance.png`` (one panel per batch size), and
    ``<out stem>.pareto.png`` when the studies are two-objective (``chosen``: batch size -> the
    chosen trial number; ``p95_bounds``: batch size -> the latency bound, drawn as a line)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator
    from optuna.trial import TrialState

    from tuning.study import throughput

    out = Path(out)
    sizes = sorted(studies)
    n = len(sizes)
    hist = out.with_name(out.stem + ".history.png")
    imp = out.with_name(out.stem + ".importance.png")

    fig = Figure(figsize=(5.0 * n, 3.8), dpi=110)
    FigureCanvasAgg(fig)
    for i, b in enumerate(sizes):
        ax = fig.add_subplot(1, n, i + 1)
        trials = studies[b].get_trials(deepcopy=False)
        comp = [(t.number, throughput(t)) for t in trials if t.state == TrialState.COMPLETE
                and t.values]
        pruned = [(t.number, t.intermediate_values[max(t.intermediate_values)])
                  for t in trials if t.state == TrialState.PRUNED and t.intermediate_values]
        failed = [t.number for t in trials if t.state == TrialState.FAIL
                  and not t.user_attrs.get("interrupted")]
        default = [(t.number, throughput(t)) for t in trials
                   if t.user_attrs.get("is_default") and t.state == TrialState.COMPLETE
                   and t.values]
        flagged = [(t.number, throughput(t)) for t in trials
                   if t.user_attrs.get("load_flag") and t.state == TrialState.COMPLETE and t.values]
        if comp:
            ax.scatter(*zip(*comp, strict=True), s=22, color="tab:blue", label="complete", zorder=3)
            best, line = float("-inf"), []
            for num, val in sorted(comp):
                best = max(best, val)
                line.append((num, best))
            ax.step(*zip(*line, strict=True), where="post", color="tab:orange", label="best so far")
        if pruned:
            ax.scatter(*zip(*pruned, strict=True), s=18, color="0.6", marker="v",
                       label="stopped early (ASHA)", zorder=2)
        if default:
            ax.scatter(*zip(*default, strict=True), s=120, marker="*", color="tab:green",
                       label="default", zorder=4)
        if flagged:
            ax.scatter(*zip(*flagged, strict=True), s=60, facecolors="none", edgecolors="tab:red",
                       label="under load", zorder=5)
        if failed:
            lo = min([v for _, v in comp + pruned], default=0.0)
            ax.scatter(failed, [lo] * len(failed), marker="x", color="tab:red", label="error",
                       zorder=4)
        ax.set_title(f"batch size {b}")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("trial")
        ax.set_ylabel("tokens/s")
        ax.grid(alpha=0.3)
        if comp or pruned or failed:
            ax.legend(fontsize=7, loc="lower right")
    fig.suptitle("Optimisation history")
    fig.tight_layout()
    fig.savefig(hist)

    fig = Figure(figsize=(5.0 * n, 3.8), dpi=110)
    FigureCanvasAgg(fig)
    for i, b in enumerate(sizes):
        ax = fig.add_subplot(1, n, i + 1)
        ax.set_title(f"batch size {b}")
        imps, why = _importances(studies[b])
        if imps:
            names = list(imps)[::-1]
            ax.barh(names, [imps[k] for k in names], color="tab:blue")
            ax.set_xlabel("importance (share)")
        else:
            ax.text(0.5, 0.5, why, ha="center", va="center", transform=ax.transAxes, fontsize=9)
            ax.set_axis_off()
    fig.suptitle("Parameter importances")
    fig.tight_layout()
    fig.savefig(imp)
    paths = [hist, imp]
    if any(len(studies[b].directions) > 1 for b in sizes):
        paths.append(write_pareto_plot(studies, out.with_name(out.stem + ".pareto.png"), chosen,
                                       p95_bounds))
    return paths


def write_pareto_plot(studies: dict, path: Path, chosen: dict | None = None,
                      p95_bounds: dict | None = None) -> Path:
    """Tokens/s vs p95 request latency of every complete trial, the Pareto front as a line, the
    default and the chosen point marked, load-flagged trials circled; one panel per batch size."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from tuning.study import complete_trials, p95_latency, pareto_front, throughput

    sizes = sorted(studies)
    fig = Figure(figsize=(5.0 * len(sizes), 3.8), dpi=110)
    FigureCanvasAgg(fig)
    for i, b in enumerate(sizes):
        ax = fig.add_subplot(1, len(sizes), i + 1)
        every = [t for t in complete_trials(studies[b], include_flagged=True)
                 if p95_latency(t) is not None]
        pts = [(p95_latency(t), throughput(t)) for t in every]
        if pts:
            ax.scatter(*zip(*pts, strict=True), s=22, color="tab:blue", label="complete", zorder=3)
        front = [(p95_latency(t), throughput(t)) for t in pareto_front(complete_trials(studies[b]))]
        if front:
            ax.step(*zip(*sorted(front), strict=True), where="post", color="tab:orange",
                    label="Pareto front", zorder=2)
        marks = [("is_default", "*", "tab:green", "default"),
                 ("load_flag", "o", "tab:red", "under load")]
        for attr, marker, color, label in marks:
            sel = [(p95_latency(t), throughput(t)) for t in every if t.user_attrs.get(attr)]
            if sel:
                face = color if marker == "*" else "none"
                ax.scatter(*zip(*sel, strict=True), s=120 if marker == "*" else 60, marker=marker,
                           facecolors=face, edgecolors=color, label=label, zorder=4)
        pick = [(p95_latency(t), throughput(t)) for t in every if chosen and t.number
                == chosen.get(b)]
        if pick:
            ax.scatter(*zip(*pick, strict=True), s=140, marker="D", facecolors="none",
                       edgecolors="black", label="chosen", zorder=5)
        bound = (p95_bounds or {}).get(b)
        if bound is not None:
            ax.axvline(bound, color="0.4", linestyle="--", linewidth=1, label="p95 bound")
        ax.set_title(f"batch size {b}")
        ax.set_xlabel("p95 request latency (s)")
        ax.set_ylabel("tokens/s")
        ax.grid(alpha=0.3)
        if pts:
            ax.legend(fontsize=7, loc="lower right")
    fig.suptitle("Throughput vs p95 latency (Pareto front)")
    fig.tight_layout()
    fig.savefig(path)
    return path


def _importances(study) -> tuple[dict, str]:
    import optuna
    from optuna.trial import TrialState

    done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))]
    if len(done) < 3:
        return {}, f"needs >= 3 completed trials\n(have {len(done)})"
    if len({t.values[0] for t in done if t.values}) < 2:
        return {}, "all completed trials scored the same"
    # multi-objective studies: importance for throughput (negated: the evaluator minimises a target)
    try:
        target = (lambda t: -t.values[0]) if len(study.directions) > 1 else None
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*low `target` values.*")
            return dict(optuna.importance.get_param_importances(study, target=target)), ""
    except Exception as e:  # e.g. degenerate distributions
        return {}, f"importance unavailable:\n{type(e).__name__}"
