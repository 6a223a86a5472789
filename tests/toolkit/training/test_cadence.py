"""What runs after a step, decided once per step from the recipe config's cadences."""

from __future__ import annotations

from types import SimpleNamespace

from toolkit.training.cadence import Due, Window


def config(max_steps=10, log=4, evaluate=5, save=3):
    return SimpleNamespace(train=SimpleNamespace(max_steps=max_steps), logging=SimpleNamespace(every=log),
                           eval=SimpleNamespace(every=evaluate), checkpoint=SimpleNamespace(every=save))


def due_steps(cfg, held_out=True, harness_steps=True) -> dict[str, list[int]]:
    steps = {name: [] for name in ("last", "log", "eval", "save", "harness")}
    for step in range(1, cfg.train.max_steps + 1):
        due = Due.at(step, cfg, held_out, harness_steps)
        for name in steps:
            if getattr(due, name):
                steps[name].append(step)
    return steps


def test_each_cadence_is_due_at_its_multiples_and_the_last_step_logs_and_evaluates():
    assert due_steps(config()) == {"last": [10], "log": [4, 8, 10], "eval": [5, 10], "save": [3, 6, 9],
                                   "harness": [5]}  # the last step's scoring reads final/, after training


def test_a_zero_cadence_never_comes_due_and_no_held_out_blocks_means_no_evaluation():
    steps = due_steps(config(evaluate=0, save=0))
    assert steps["eval"] == [10] and steps["save"] == steps["harness"] == []
    steps = due_steps(config(), held_out=False, harness_steps=False)
    assert steps["eval"] == steps["harness"] == [] and steps["log"] == [4, 8, 10]


def test_the_window_counts_tokens_per_second_since_the_last_logged_step():
    window = Window()
    window.add(1000, 0.5)
    window.add(1000, 1.5)
    assert window.rate() == 1000.0
    window.reset()
    assert window.rate() == 0.0
