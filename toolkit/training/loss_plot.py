"""loss.png: the train loss (raw and smoothed), each evaluation as a point where it was measured, and a fine-tune's
forgetting budget (its general held-out loss against the limit, and the step whose checkpoint is kept)."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable
from pathlib import Path

from toolkit.run.writes import writing

MIN_SMOOTHED = 3  # fewer logged losses than this: no smoothed curve, it would only redraw the raw one


def plot_loss(metrics_path: Path, out_png: Path, say: Callable[[str], None] = print) -> Path | None:
    """loss.png; None where it could not be written (said through `say`: metrics.jsonl holds the same numbers)."""
    with writing("loss plot", out_png, say=say):
        return _plot_loss(metrics_path, out_png)
    return None


def _plot_loss(metrics_path: Path, out_png: Path) -> Path:
    loss_figure(metrics_path).savefig(out_png)
    return out_png


def loss_figure(metrics_path: Path):
    """The figure of loss.png (a matplotlib Figure, outside pyplot: nothing to close, no backend to choose)."""
    from matplotlib.figure import Figure

    rows = _rows(metrics_path)
    preference = any("rewards/margin" in r or "eval_rewards/margin" in r for r in rows)
    fig = Figure(figsize=(12 if preference else 7, 4), dpi=110)
    axes = fig.subplots(1, 2 if preference else 1, squeeze=False)[0]
    ax = axes[0]
    _train(ax, [r for r in rows if _kind(r) == "train"])
    evals = [r for r in rows if _kind(r) == "eval"]
    _measured(ax, evals, "eval_loss", "C1", "held-out loss")
    general = {r.get("general") for r in rows if _kind(r) == "budget"}  # drawn below as the general held-out loss
    sources = sorted({k.split("/", 1)[1] for r in evals for k in r if k.startswith("eval_loss/")} - general)
    for i, name in enumerate(sources):  # a mixture's sources (data.sources), each its own points
        _measured(ax, evals, f"eval_loss/{name}", f"C{3 + i}", f"held-out loss: {name}", marker=".")
    _budget(ax, [r for r in rows if _kind(r) == "budget"])
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("preference loss (mean over pairs)" if preference else "cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    _legend(ax)
    if preference:  # the rewards beside the loss: the margin should widen, the accuracy rise
        ax = axes[1]
        for key, style, label in (("rewards/margin", "-", "train reward margin"),
                                  ("eval_rewards/margin", "o-", "held-out reward margin"),
                                  ("rewards/accuracy", "-", "train reward accuracy"),
                                  ("eval_rewards/accuracy", "o-", "held-out reward accuracy")):
            steps, values = _points(rows, key)
            if steps:
                ax.plot(steps, values, style, linewidth=1, label=label)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        _legend(ax)
    fig.tight_layout()
    return fig


def _train(ax, rows: list[dict]) -> None:
    """The logged losses thin and light (a skipped step's null loss leaves a gap), and their smoothed curve bold."""
    logged = sorted(((r["step"], r.get("loss")) for r in rows if _number(r.get("step"))), key=lambda p: p[0])
    if not logged:
        return
    ax.plot([s for s, _ in logged], [v if _number(v) else math.nan for _, v in logged], color="C0", alpha=0.35,
            linewidth=0.8, label="train loss")
    measured = [(s, v) for s, v in logged if _number(v)]
    if len(measured) >= MIN_SMOOTHED:
        ax.plot([s for s, _ in measured], smoothed([v for _, v in measured]), color="C0", linewidth=2,
                label="train (smoothed)")


def smoothed(values: list[float]) -> list[float]:
    # An exponential moving average debiased as TensorBoard's smoothing is (divided by 1 - w**n, so it starts at the
    # first loss, not near 0), rather than a centred rolling mean: each point is the trend of the losses up to it, as
    # in tensorboard beside it, and the last is not a window cut short. It spans ~10 % of the points, so a long run is
    # smoothed as much as a short one, and at least 4 (a shipped fine-tune logs 12: a span of 2 left its +-0.2 jumps).
    weight = 1 - 1 / max(4.0, len(values) / 10)
    out, last = [], 0.0
    for n, value in enumerate(values, 1):
        last = weight * last + (1 - weight) * value
        out.append(last / (1 - weight**n))
    return out


def _measured(ax, rows: list[dict], key: str, color: str, label: str, marker: str = "o") -> None:
    """Each row's `key` as a marker at its step, the base (phase before) starred. Three or more are joined by a
    thin line; two (a fine-tune's before and after) are not: a line between them is a curve nothing measured."""
    steps, values = _points(rows, key)
    if not steps:
        return
    ax.plot(steps, values, marker=marker, linestyle="-" if len(steps) > 2 else "none", linewidth=1, color=color,
            label=label)
    base = [(r["step"], r[key]) for r in rows if r.get("phase") == "before" and _number(r.get(key))]
    if base:
        named = "base model" not in ax.get_legend_handles_labels()[1]
        ax.plot(*zip(*base, strict=True), marker="*", markersize=13, linestyle="none", color=color,
                markeredgecolor="black", label="base model" if named else "_base model")


def _budget(ax, rows: list[dict]) -> None:
    """A budgeted fine-tune's general held-out loss, its limit, and the step whose checkpoint is kept."""
    _measured(ax, rows, "general_loss", "C2", "general held-out", marker="D")
    last = sorted(rows, key=lambda r: r.get("step", 0))[-1] if rows else {}
    limit, base, kept = last.get("general_limit"), last.get("general_base"), last.get("best_step")
    if _number(limit):  # null: a general set reported without a budget
        percent = f" ({(limit / base - 1) * 100:+.3g} %)" if _number(base) and base > 0 else ""
        ax.axhline(limit, color="C2", linestyle="--", linewidth=1, label=f"general budget{percent}")
    if _number(kept):
        ax.axvline(kept, color="0.3", linestyle=":", linewidth=1.5, label=f"kept: step {int(kept)}")


def _rows(path: Path) -> list[dict]:
    """metrics.jsonl's rows; a line torn by a hard kill (anything but a JSON object) is left out."""
    rows = []
    for line in Path(path).read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            row = json.loads(line)
            if isinstance(row, dict):
                rows.append(row)
    return rows


def _kind(row: dict) -> str | None:
    """A row's kind; a row without one (written before rows had kinds) by its columns."""
    return row.get("kind") or ("eval" if "eval_loss" in row else "train" if "loss" in row else None)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _points(rows: list[dict], key: str) -> tuple[list, list]:
    """(steps, values) of the rows with a number under `key`, in step order."""
    points = sorted(((r["step"], r[key]) for r in rows if _number(r.get("step")) and _number(r.get(key))),
                    key=lambda p: p[0])
    return [s for s, _ in points], [v for _, v in points]


def _legend(ax) -> None:
    """A legend where a curve was drawn (a run that stopped before its first logged step has none, and
    matplotlib warns about an empty legend)."""
    handles = ax.get_legend_handles_labels()[0]
    if handles:  # more than a few entries beside the axes, where they hide no point
        ax.legend(fontsize="small", **({"loc": "upper left", "bbox_to_anchor": (1.01, 1)} if len(handles) > 4 else {}))
