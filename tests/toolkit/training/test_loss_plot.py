"""loss.png: evaluations where they were measured, the train loss raw and smoothed, and a budgeted fine-tune's
general held-out loss with its budget line and kept step (toolkit.training.loss_plot)."""

from __future__ import annotations

import json
import math
import warnings

import pytest

from toolkit.training.loss_plot import loss_figure, plot_loss, smoothed
from toolkit.training.metrics import MetricsWriter

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_plot_loss_writes_a_png(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with path.open("w") as f:
        for step in range(1, 21):
            f.write(json.dumps({"step": step, "loss": 5.0 / step}) + "\n")
            if step % 5 == 0:
                f.write(json.dumps({"step": step, "eval_loss": 5.5 / step, "eval_ppl": 2.0}) + "\n")
    out = plot_loss(path, tmp_path / "loss.png")
    assert out == tmp_path / "loss.png"
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC)
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (770, 440)  # figsize (7, 4) at 110 dpi


def test_a_mixtures_sources_each_get_a_held_out_curve(tmp_path, monkeypatch):
    import matplotlib.axes

    labels, real = [], matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", lambda ax, *a, **kw: labels.append(kw.get("label")) or real(ax, *a, **kw))
    path = tmp_path / "metrics.jsonl"
    with path.open("w") as f:
        for step in range(1, 7):
            f.write(json.dumps({"step": step, "loss": 5.0 / step, "tokens/web": step, "tokens/code": step}) + "\n")
            if step % 3 == 0:
                f.write(json.dumps({"step": step, "eval_loss": 5.5 / step, "eval_loss/web": 5.0 / step,
                                    "eval_loss/code": 6.0 / step}) + "\n")
    assert plot_loss(path, tmp_path / "loss.png").read_bytes().startswith(PNG_MAGIC)
    assert labels == ["train loss", "train (smoothed)", "held-out loss", "held-out loss: code", "held-out loss: web"]


def test_a_preference_run_is_plotted_with_its_rewards_beside_the_loss(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with path.open("w") as f:
        for step in range(1, 11):
            f.write(json.dumps({"step": step, "loss": 0.69 / step, "rewards/margin": step / 10,
                                "rewards/accuracy": 0.5}) + "\n")
        for step, phase in ((0, "before"), (10, "after")):
            f.write(json.dumps({"step": step, "phase": phase, "eval_loss": 0.69 - step / 100,
                                "eval_rewards/margin": step / 20, "eval_rewards/accuracy": step / 10}) + "\n")
    data = plot_loss(path, tmp_path / "loss.png").read_bytes()
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1320, 440)  # a second panel: figsize (12, 4) at 110 dpi


def test_plot_loss_with_train_lines_only(tmp_path):
    path = tmp_path / "metrics.jsonl"
    writer = MetricsWriter(path, None)
    for step in (1, 2, 3):
        writer.write({"step": step, "loss": 10.0 - step})
    writer.close()
    assert plot_loss(path, tmp_path / "train.png").read_bytes().startswith(PNG_MAGIC)


def test_a_run_stopped_before_its_first_logged_step_is_plotted_without_a_warning(tmp_path):
    """A run that diverged at step 3 of logging.every=10 has a skip row and no loss: an empty chart, and
    no matplotlib warning about an empty legend on the user's terminal."""
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 3, "nonfinite": "loss", "action": "abort", "in_a_row": 1}) + "\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plot_loss(path, tmp_path / "none.png").read_bytes().startswith(PNG_MAGIC)


def fine_tune_metrics(path, evals=(0, 10, 20, 30), budget=True, limit=3.15, train_steps=range(5, 31, 5)):
    """A budgeted fine-tune's metrics.jsonl as a run writes it: a train row every 5 steps whose loss jumps by
    +-0.2 (step 15 skipped: null), evaluations (step 0 the base), a budget row after each, rows of other kinds,
    and a last line torn by a hard kill."""
    rows = [{"kind": "train", "step": s, "loss": None if s == 15 else 2.0 - s / 100 + (0.2 if s % 10 else -0.2),
             "lr": 1e-4, "grad_norm": 1.0, "tokens": 64 * s, "tokens_per_s": 1e3, "mfu": None, "epoch": 0}
            for s in train_steps]
    rows.append({"kind": "memory", "step": 1, "held_bytes": {}})
    rows.append({"kind": "canary", "step": 1, "loss": 99.0, "reference_loss": 99.0, "loss_drift": 0.0,
                 "grad_drift": 0.0, "tolerance": 0.01, "drifted": None})  # a loss, but no train loss
    kept = None
    for i, s in enumerate(evals):
        phase = "before" if s == 0 else "after" if s == evals[-1] else "train"
        rows.append({"kind": "eval", "step": s, "phase": phase, "eval_loss": 2.3 - i / 10, "eval_ppl": 9.0})
        if budget:
            general = (3.0, 3.05, 3.1, 3.2)[i]
            kept = s if s and limit is not None and general <= limit else kept
            rows.append({"kind": "budget", "step": s, "phase": phase, "domain_loss": 2.3 - i / 10,
                         "general_loss": general, "general_base": 3.0, "general_limit": limit,
                         "general_change": general / 3.0 - 1, "within": limit is None or general <= limit, "share": None,
                         "best_step": kept})
    rows.append({"kind": "harness", "step": 0, "phase": "before", "harness/x/acc": 0.5})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"kind": "summary", "step": 30, "param')
    return path


def variation(ys) -> float:
    """Total variation of a curve, over its gaps."""
    ys = [y for y in ys if not math.isnan(y)]
    return sum(abs(b - a) for a, b in zip(ys, ys[1:], strict=False))


def drawn(path) -> dict:
    """The loss axes' lines of loss.png, by label."""
    return {line.get_label(): line for line in loss_figure(path).axes[0].get_lines()}


def test_evaluations_are_markers_at_the_measured_steps_and_the_base_is_starred(tmp_path):
    lines = drawn(fine_tune_metrics(tmp_path / "metrics.jsonl"))
    held_out = lines["held-out loss"]
    assert list(held_out.get_xdata()) == [0, 10, 20, 30] and held_out.get_marker() not in ("", "None", None)
    assert list(lines["base model"].get_xdata()) == [0] and list(lines["base model"].get_ydata()) == [2.3]


def test_two_evaluations_are_two_markers_and_no_line_between_them(tmp_path):
    lines = drawn(fine_tune_metrics(tmp_path / "metrics.jsonl", evals=(0, 30), budget=False))
    held_out = lines["held-out loss"]
    assert list(held_out.get_xdata()) == [0, 30]
    assert held_out.get_marker() not in ("", "None", None) and held_out.get_linestyle() == "None"
    assert [label for label, line in lines.items() if line.get_linestyle() != "None" and 30 in line.get_xdata()
            and 0 in line.get_xdata()] == []  # no artist spans the two with a line


def test_the_train_loss_is_drawn_raw_and_smoothed(tmp_path):
    lines = drawn(fine_tune_metrics(tmp_path / "metrics.jsonl"))
    raw, smooth = lines["train loss"], lines["train (smoothed)"]
    assert list(raw.get_xdata()) == [5, 10, 15, 20, 25, 30]  # the canary's row is no train loss
    assert math.isnan(raw.get_ydata()[2])  # the skipped step is a gap, not a line through it
    assert list(smooth.get_xdata()) == [5, 10, 20, 25, 30] and smooth.get_linewidth() > raw.get_linewidth()

    assert variation(smooth.get_ydata()) < variation(raw.get_ydata())


def test_two_train_losses_are_not_smoothed(tmp_path):
    lines = drawn(fine_tune_metrics(tmp_path / "metrics.jsonl", train_steps=(5, 10)))
    assert "train loss" in lines and "train (smoothed)" not in lines


def test_smoothing_starts_at_the_first_loss_and_keeps_a_constant():
    assert smoothed([2.0, 2.0, 2.0]) == pytest.approx([2.0, 2.0, 2.0])  # debiased: no climb from 0
    assert smoothed([3.0, 1.0, 3.0, 1.0])[0] == 3.0
    noisy = [2.0 - i / 100 + (0.2 if i % 2 else -0.2) for i in range(100)]
    assert variation(smoothed(noisy)) < variation(noisy) / 4  # a long run is smoothed more than a short one


def test_a_forgetting_budget_is_drawn_with_its_limit_and_the_kept_step(tmp_path):
    lines = drawn(fine_tune_metrics(tmp_path / "metrics.jsonl"))
    general = lines["general held-out"]
    assert list(general.get_xdata()) == [0, 10, 20, 30] and general.get_marker() not in ("", "None", None)
    assert list(general.get_ydata()) == [3.0, 3.05, 3.1, 3.2]
    assert list(lines["general budget (+5 %)"].get_ydata()) == [3.15, 3.15]
    assert list(lines["kept: step 20"].get_xdata()) == [20, 20]  # step 30 is over the budget


def test_the_kept_step_is_the_last_budget_rows(tmp_path):
    lines = drawn(fine_tune_metrics(tmp_path / "metrics.jsonl", limit=3.07))  # over the budget from step 20
    assert [label for label in lines if label.startswith("kept")] == ["kept: step 10"]
    assert list(lines["general budget (+2.33 %)"].get_ydata()) == [3.07, 3.07]


def test_a_general_source_is_drawn_once_as_the_general_held_out_loss(tmp_path):
    path = fine_tune_metrics(tmp_path / "metrics.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()[:-1]]
    for r in rows:  # the general set is the mixture's source "web": its eval_loss/web is the budget's general_loss
        if r["kind"] == "eval":
            r["eval_loss/web"] = 3.0
        if r["kind"] == "budget":
            r["general"] = "web"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert "general held-out" in drawn(path) and "held-out loss: web" not in drawn(path)


def test_without_budget_rows_no_budget_is_drawn(tmp_path):
    lines = drawn(fine_tune_metrics(tmp_path / "metrics.jsonl", budget=False))
    assert not [label for label in lines if label.startswith(("general", "kept"))]


def test_a_general_set_without_a_budget_is_drawn_without_a_limit(tmp_path):
    lines = drawn(fine_tune_metrics(tmp_path / "metrics.jsonl", limit=None))
    assert "general held-out" in lines and not [label for label in lines if label.startswith("general budget")]


def test_a_budgeted_fine_tunes_plot_is_written_past_a_torn_line(tmp_path):
    out = plot_loss(fine_tune_metrics(tmp_path / "metrics.jsonl"), tmp_path / "loss.png", say=pytest.fail)
    assert out == tmp_path / "loss.png" and out.read_bytes().startswith(PNG_MAGIC)
