"""Hard kills of a fine-tune held to a forgetting budget (toolkit.training.forgetting), in the small deterministic form
of bench/kill_soak.py --finetune-budget: each kill lands after an evaluation whose replay decision moved the general
source's share, before that step's checkpoint is complete, and resume=auto must take the decisions up again from the
checkpoint it resumes (the data order, the kept step, the forced saves), ending with the uninterrupted run's losses,
tokens per source, budget rows, adapter and final/ bit for bit."""

from __future__ import annotations

import json
import sys

import pytest
from kill_relaunch import through_kills
from recipe_runner import ROOT, run_recipe

sys.path.insert(0, str(ROOT / "bench"))
import kill_soak  # noqa: E402  (the hard-kill harness, bench/kill_soak.py)

pytestmark = pytest.mark.distributed

# save.manifest@6/0: replay moved the share at 6 (a checkpoint.every step), whose checkpoint is left incomplete: the
# resume is from step 4, a save the budget forced (its best step then), with the decision of step 2 in its state.
# save.rank_files@10/1: at 10 the best step moves and replay moves the share again; rank 1 dies inside the save the
# budget forces there: the resume is from step 9, which keeps step 4 as the best, and must save 10 again.
KILLS = ["save.manifest@6/0", "save.rank_files@10/1"]


def test_hard_kills_of_a_budgeted_fine_tune_come_back_bit_exact(tiny_base, tmp_path, data_cache):
    overrides = kill_soak.budgeted(tiny_base, kill_soak.code_corpus(tmp_path))
    reference = tmp_path / "reference"
    done = run_recipe("finetune", [*overrides, f"output_dir={reference}"], nproc=2, cache=data_cache,
                      config="finetune_smollm2_lora.yaml")
    schedule = kill_soak.Schedule.observed(done.stdout, reference, overrides)
    budget = [json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines()]
    budget = {r["step"]: r for r in budget if r["kind"] == "budget"}
    moved = [s for s in budget if s and budget[s]["share"] != budget[max(e for e in budget if e < s)]["share"]]
    # the kills matter only where the budget acts as they say: their steps moved the share, 4 and 10 are forced saves
    assert {6, 10} <= set(moved) and {4, 6, 9, 10} <= set(schedule.saves), (moved, schedule)
    assert budget[4]["best_step"] == 4 and budget[10]["best_step"] == 10, budget
    assert set(KILLS) <= set(kill_soak.possible_kills(overrides, "ddp", schedule))

    out, log = tmp_path / "run", tmp_path / "kills.log"
    output = through_kills("finetune", [*overrides, "resume=auto", f"output_dir={out}"], KILLS, log, data_cache,
                           config="finetune_smollm2_lora.yaml")
    assert kill_soak.compare(out, reference) == []
    assert log.read_text().split() == KILLS, "each kill fires once, in order"
    expected = [kill_soak.expected_resume(kill, overrides, schedule.saves) for kill in KILLS]
    assert expected == [4, 9] and kill_soak.resumed_steps(output) == expected, output[-6000:]
    assert kill_soak.audit(out, newest_saved=schedule.saves[-1]) == []
    assert sorted(c.name for c in (out / "checkpoints").iterdir()) == ["step-10", "step-12"]  # the kept one, the last
