"""Checkpoints saved by an earlier commit, kept in tests/fixtures/checkpoints/: a change to the code that
saves or resumes must still resume what users saved before it.

Each fixture is a 6-step pretraining run (PRETRAIN) under one strategy, cut down to what a resume
reads: its `step-3/` checkpoint, its `metrics.jsonl` (the uninterrupted run's steps 4-6 are the
reference a resume continues) and, where the strategy has one, `saved.pt`: what its optimizer held when it
saved step 3 (tests/support/resume_probe.py). MADE.json says which commit and libraries wrote them.

Made again only on purpose (a deliberate change of the numbers or of a format), at the commit before the change:

    python tests/support/saved_checkpoints.py
"""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from recipe_runner import ROOT, TINY, run_recipe

FIXTURES = ROOT / "tests" / "fixtures" / "checkpoints"
GLOBAL_BATCH = 12
# TINY at half its width (51k parameters): 0.7-1.4 MB a fixture, 5 MB for the five
PRETRAIN = [*TINY, "model.config.hidden_size=32", "model.config.intermediate_size=64",
            f"train.global_batch_size={GLOBAL_BATCH}", "train.max_steps=6", "checkpoint.every=3", "eval.every=0"]
PIPELINE = ["train.pipeline_stages=2"]  # under ddp.yaml
PROBE = ["tests/support/resume_probe.py"]
# (accelerate config, processes, pipeline): the sources of tests/recipes/test_resume_elsewhere.py, one of each format
SOURCES = [("zero2", 2, False), ("fsdp", 2, False), ("ddp", 3, False), ("zero3", 2, False), ("ddp", 2, True)]


def name(strategy: str, processes: int, pipeline: bool = False) -> str:
    """A fixture's folder: "zero2@2", "pipeline@2"."""
    return f"{'pipeline' if pipeline else strategy}@{processes}"


def copy(fixture: str, into: Path) -> tuple[Path, Path]:
    """(run folder, its saved.pt) of fixture "zero2@2" copied into `into`: a resume writes step-3.converted beside it."""
    out = into / fixture
    shutil.copytree(FIXTURES / fixture, out)
    (out / "checkpoints").mkdir()
    (out / "step-3").rename(out / "checkpoints" / "step-3")
    return out, out / "saved.pt"


def make(cache: Path) -> None:
    shutil.rmtree(FIXTURES, ignore_errors=True)
    FIXTURES.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        for strategy, processes, pipeline in SOURCES:
            out, probe = Path(tmp) / name(strategy, processes, pipeline), Path(tmp) / f"{strategy}{processes}.pt"
            overrides = [*PRETRAIN, *(PIPELINE if pipeline else []), f"output_dir={out}"]
            run_recipe("pretrain", overrides, nproc=processes, cache=cache, accelerate_config=f"{strategy}.yaml",
                       env={"RESUME_PROBE_OUT": str(probe), "RESUME_PROBE_STEP": "3"},
                       script=None if pipeline else [*PROBE, "pretrain"], launcher=True)
            fixture = FIXTURES / name(strategy, processes, pipeline)
            shutil.copytree(out / "checkpoints" / "step-3", fixture / "step-3")
            shutil.copy(out / "metrics.jsonl", fixture)
            if probe.is_file():  # less the module's own copies, which a resume's checks do not read
                torch.save({k: v for k, v in torch.load(probe, weights_only=True).items() if k != "module"},
                           fixture / "saved.pt")
            print(f"{fixture.relative_to(ROOT)}: {sum(f.stat().st_size for f in fixture.rglob('*') if f.is_file()) >> 10} KiB")
    versions = {m: importlib.metadata.version(m) for m in ("torch", "accelerate", "deepspeed", "transformers")}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    (FIXTURES / "MADE.json").write_text(json.dumps({"commit": commit, **versions, "overrides": PRETRAIN}, indent=1) + "\n")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as cache:
        make(Path(cache))
