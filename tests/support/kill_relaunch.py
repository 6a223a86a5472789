"""A run relaunched through its planned hard kills (toolkit.run.faults), as a scheduler's requeue would bring it back:
the tests' small deterministic form of bench/kill_soak.py."""

from __future__ import annotations

from pathlib import Path

from recipe_runner import run_recipe

from toolkit.run.faults import ENV, LOG_ENV


def through_kills(recipe: str, overrides: list[str], kills: list[str], log: Path, cache: Path, **launch) -> str:
    """The launches' output, rank by rank: one launch per kill in `kills` (each must stop at its kill, which `log`
    records), then the one that finishes. `overrides` hold resume=auto and output_dir; `launch` is run_recipe's."""
    outputs = []
    for _ in range(len(kills) + 1):
        proc = run_recipe(recipe, overrides, nproc=2, cache=cache, check=False,
                          env={ENV: ",".join(kills), LOG_ENV: str(log)}, **launch)
        outputs.append(proc.stdout)
        if proc.returncode == 0:
            break
        assert len(log.read_text().split()) == len(outputs), proc.stdout[-6000:]  # it stopped at its kill
    output = "\n".join(outputs)
    assert proc.returncode == 0, output[-6000:]
    return output
