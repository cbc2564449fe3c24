"""Summary table and PNG plots (optimisation history, parameter importances) of a tune run."""

from __future__ import annotations

from pathlib import Path


def _f(v, nd=1) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def format_summary(results, space) -> str:
    """Markdown table: per batch size, default vs best on the held-out split, plus changed knobs."""
    rows = [("| batch | trials (ok/pruned/err/intr) | default tok/s | tuned tok/s | gain | tau def -> tuned "
             "| chosen | changed knobs |"),
            "|---|---|---|---|---|---|---|---|"]
    for r in results:
        c = r.counts
        changed = ""
        if r.best_params:
            diffs = [f"{k}={_v(r.best_params[k])}" for k in space.names
                     if k in r.best_params and _v(r.best_params[k]) != _v(r.default_params.get(k))]
            changed = ", ".join(diffs) or "(none)"
        gain = "-" if r.default_tps is None or r.best_tps is None else f"{r.best_tps / r.default_tps:.2f}x"
        rows.append(f"| {r.batch_size} | {c['complete']}/{c['pruned']}/{c['failed']}/{c['interrupted']} "
                    f"| {_f(r.default_tps)} | {_f(r.best_tps)} | {gain} "
                    f"| {_f(r.tau_default, 2)} -> {_f(r.tau_best, 2)} | {r.chosen} | {changed} |")
    notes = [f"- bs {r.batch_size}: {r.note}" for r in results if r.note]
    return "\n".join(rows + (["", *notes] if notes else []))


def _v(x):
    return round(x, 3) if isinstance(x, float) else x


def write_plots(studies: dict, out: Path) -> list[Path]:
    """``<out stem>.history.png`` and ``<out stem>.importance.png``: one panel per batch size."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator
    from optuna.trial import TrialState

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
        comp = [(t.number, t.value) for t in trials if t.state == TrialState.COMPLETE and t.value is not None]
        pruned = [(t.number, t.intermediate_values[max(t.intermediate_values)])
                  for t in trials if t.state == TrialState.PRUNED and t.intermediate_values]
        failed = [t.number for t in trials if t.state == TrialState.FAIL and not t.user_attrs.get("interrupted")]
        default = [(t.number, t.value) for t in trials
                   if t.user_attrs.get("is_default") and t.state == TrialState.COMPLETE]
        if comp:
            ax.scatter(*zip(*comp), s=22, color="tab:blue", label="complete", zorder=3)
            best, line = float("-inf"), []
            for num, val in sorted(comp):
                best = max(best, val)
                line.append((num, best))
            ax.step(*zip(*line), where="post", color="tab:orange", label="best so far")
        if pruned:
            ax.scatter(*zip(*pruned), s=18, color="0.6", marker="v", label="stopped early (ASHA)", zorder=2)
        if default:
            ax.scatter(*zip(*default), s=120, marker="*", color="tab:green", label="default", zorder=4)
        if failed:
            lo = min([v for _, v in comp + pruned], default=0.0)
            ax.scatter(failed, [lo] * len(failed), marker="x", color="tab:red", label="error", zorder=4)
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
    return [hist, imp]


def _importances(study) -> tuple[dict, str]:
    import optuna
    from optuna.trial import TrialState

    done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))]
    if len(done) < 3:
        return {}, f"needs >= 3 completed trials\n(have {len(done)})"
    if len({t.value for t in done}) < 2:
        return {}, "all completed trials scored the same"
    try:
        return dict(optuna.importance.get_param_importances(study)), ""
    except Exception as e:  # e.g. degenerate distributions
        return {}, f"importance unavailable:\n{type(e).__name__}"
