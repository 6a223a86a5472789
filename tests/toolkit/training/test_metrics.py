"""Training metrics: the logging section's checks, the FLOPs/MFU arithmetic, and metrics.jsonl across a resume."""

from __future__ import annotations

import json

import pytest
import torch

from toolkit.config.errors import UserError
from toolkit.training.metrics import (
    LoggingConfig,
    MetricsWriter,
    check_trackers,
    estimate_mfu,
    flops_per_token,
    peak_flops,
    peak_memory_mb,
    read_metrics,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# LoggingConfig and trackers


def test_logging_defaults_are_valid():
    cfg = LoggingConfig()
    assert cfg.validate() == []
    assert cfg.trackers == ["tensorboard"]


ACCELERATE_TRACKERS = "aim, tensorboard, wandb, trackio, comet_ml, mlflow, clearml, dvclive, swanlab"


def test_logging_problems_are_all_reported():
    problems = LoggingConfig(every=0, trackers=["tensorboard", "neptune", "comet"]).validate()
    assert len(problems) == 3
    assert problems[0].startswith("every=0") and "at least 1" in problems[0]
    assert problems[1:] == [
        f"trackers has 'neptune', which Accelerate does not drive; its trackers are {ACCELERATE_TRACKERS}",
        f"trackers has 'comet', which Accelerate does not drive; its trackers are {ACCELERATE_TRACKERS}; did you "
        "mean comet_ml?",
    ]
    assert LoggingConfig(every=-2).validate()[0].startswith("every=-2")
    assert LoggingConfig(trackers=[]).validate() == []  # logging to metrics.jsonl only is allowed


def test_every_tracker_accelerate_drives_is_accepted():
    """Only tensorboard and wandb were; the names are Accelerate's own (LoggerType), not a copy of them."""
    from accelerate.utils import LoggerType

    names = [str(t) for t in LoggerType if t != LoggerType.ALL]
    assert {"mlflow", "comet_ml", "aim", "clearml", "dvclive", "swanlab", "trackio"} <= set(names)
    assert LoggingConfig(trackers=names).validate() == []
    assert LoggingConfig(trackers=["all"]).validate() != []  # a run names the trackers it logs to


def test_a_tracker_whose_package_is_missing_is_one_line(monkeypatch):
    """By Accelerate's own availability check (it would drop the tracker with a debug line)."""
    import accelerate.tracking

    monkeypatch.setattr(accelerate.tracking, "_available_trackers", [])  # as on a machine without tensorboard
    with pytest.raises(UserError) as excinfo:
        check_trackers(["tensorboard"])
    assert str(excinfo.value) == ("logging.trackers has tensorboard, but the tensorboard package is not installed; "
                                  "pip install tensorboard, or remove it from logging.trackers")


def test_check_trackers_accepts_installed_packages():
    check_trackers(["tensorboard"])
    check_trackers([])


def test_check_trackers_names_a_missing_package():
    missing = "no_such_tracker_package_xyz"
    with pytest.raises(UserError) as excinfo:
        check_trackers(["tensorboard", missing])
    assert str(excinfo.value) == (
        f"logging.trackers has {missing}, but the {missing} package is not installed; "
        f"pip install {missing}, or remove it from logging.trackers"
    )


# FLOPs and MFU


def test_flops_per_token_formula():
    # 6N for the weight matmuls, 12 * layers * seq_len * hidden for attention (PaLM appendix B)
    assert flops_per_token(1000, 2, 64, 128) == 6 * 1000 + 12 * 2 * 128 * 64 == 202_608
    assert flops_per_token(0, 0, 64, 128) == 0
    # attention grows with the sequence, the weight term does not
    assert flops_per_token(10**6, 4, 256, 2048) - flops_per_token(10**6, 4, 256, 1024) == 12 * 4 * 1024 * 256


def test_estimate_mfu():
    assert estimate_mfu(1000.0, 6e9, 1, None) is None  # unknown peak: no guess
    # 1000 tokens/s * 6 GFLOP/token on one 989 TFLOP/s GPU
    assert estimate_mfu(1000.0, 6e9, 1, 989e12) == pytest.approx(6e12 / 989e12)
    # the same throughput spread over 4 GPUs is a quarter of the utilisation
    assert estimate_mfu(1000.0, 6e9, 4, 989e12) == pytest.approx(6e12 / (4 * 989e12))
    assert estimate_mfu(0.0, 6e9, 1, 1e12) == 0.0


def test_peak_flops_is_not_guessed_on_cpu():
    assert peak_flops(torch.device("cpu")) is None
    assert estimate_mfu(5000.0, 1e6, 1, peak_flops(torch.device("cpu"))) is None


def test_peak_memory_on_cpu():
    mem = peak_memory_mb(torch.device("cpu"))
    assert set(mem) == {"peak_rss_mb"}
    assert 10 < mem["peak_rss_mb"] < 1e6  # MiB: this process holds at least torch


# MetricsWriter and read_metrics


def write_steps(path, steps, resume_step=None, **extra):
    writer = MetricsWriter(path, resume_step)
    for step in steps:
        writer.write({"step": step, "loss": 10.0 - step, **extra})
    writer.close()


def test_metrics_round_trip(tmp_path):
    path = tmp_path / "metrics.jsonl"
    records = [
        {"step": 1, "loss": 3.5, "lr": 1e-4},
        {"step": 2, "loss": 3.25, "mfu": None},
        {"step": 2, "eval_loss": 3.4, "eval_ppl": 29.96},
    ]
    writer = MetricsWriter(path, resume_step=None)
    for r in records:
        writer.write(r)
        assert read_metrics(path)[-1] == r  # flushed at once: a crash loses nothing already written
    writer.close()
    assert read_metrics(path) == records
    assert len(path.read_text().splitlines()) == 3


def test_read_metrics_skips_blank_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n\n   \n{"step": 2}\n')
    assert read_metrics(path) == [{"step": 1}, {"step": 2}]


def test_resuming_drops_the_lines_past_the_checkpoint(tmp_path):
    """A run logged steps 1..6, checkpointed at 4 and died; the resumed run logs 5.. again."""
    path = tmp_path / "metrics.jsonl"
    writer = MetricsWriter(path, None)
    writer.write({"event": "start"})  # a line without a step is kept (as step 0)
    for step in range(1, 7):
        writer.write({"step": step, "loss": float(step)})
        if step == 4:
            writer.write({"step": 4, "eval_loss": 2.0})
    writer.close()

    write_steps(path, [5, 6, 7], resume_step=4, resumed=True)
    rows = read_metrics(path)
    assert rows[0] == {"event": "start"}
    assert [r["step"] for r in rows[1:]] == [1, 2, 3, 4, 4, 5, 6, 7]  # no step twice from two runs
    assert {"step": 4, "eval_loss": 2.0} in rows  # the checkpoint step's own lines stay
    assert all(r.get("resumed") for r in rows if r.get("step", 0) > 4)


def test_resuming_twice_and_without_a_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_steps(path, [1], resume_step=3)  # resuming where no metrics were written yet: a new file
    assert read_metrics(path) == [{"step": 1, "loss": 9.0}]
    write_steps(path, [2, 3, 4])
    write_steps(path, [3, 4], resume_step=2)
    write_steps(path, [4, 5], resume_step=3)
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4, 5]


def test_without_a_resume_step_lines_are_appended(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_steps(path, [1, 2])
    write_steps(path, [1])
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 1]


def test_resume_drops_a_line_torn_by_a_hard_kill(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_steps(path, [1, 2, 3])
    with path.open("a") as f:
        f.write('{"step": 4, "loss": 6.')  # SIGKILL in the middle of a write
    writer = MetricsWriter(path, resume_step=3)
    writer.write({"step": 4, "loss": 6.0})
    writer.close()
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4]


def test_a_resumed_writer_knows_what_its_kept_records_hold(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_steps(path, [1, 2])
    MetricsWriter(path, None).close()
    with path.open("a") as f:
        f.write(json.dumps({"step": 2, "parameter_digests": ["ab"]}) + "\n")
    writer = MetricsWriter(path, resume_step=2)
    assert writer.has(2, "parameter_digests") and writer.has(1, "loss")
    assert not writer.has(1, "parameter_digests") and not writer.has(3, "loss")
    writer.close()


def test_docs_metrics_md_lists_each_row_kind_with_its_columns():
    """Issue 42 point 11: a documented schema per row kind. docs/metrics.md's table has a row for each kind the writer
    checks (toolkit.training.metrics.KINDS), no other, and names each of that kind's columns."""
    from pathlib import Path

    from toolkit.training.metrics import KINDS

    doc = (Path(__file__).resolve().parents[3] / "docs" / "metrics.md").read_text()
    rows = {}
    for line in doc.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) == 3:
            rows[cells[0].strip("`")] = cells[2]
    assert set(rows) == set(KINDS), sorted(set(rows) ^ set(KINDS))
    for kind, columns in KINDS.items():
        missing = [c for c in columns if f"`{c}`" not in rows[kind]]
        assert not missing, f"docs/metrics.md's {kind} row does not name {missing}"
