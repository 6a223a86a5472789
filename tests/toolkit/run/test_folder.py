"""The run folder contract. What a flag may do to output_dir: a run's own outputs are replaced only by newer outputs of the
same run (resume from its newest complete checkpoint, or overwrite=true), nothing else is deleted."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from toolkit.checkpoint.trainer_state import TrainerState
from toolkit.config.errors import UserError
from toolkit.run.folder import STATE_FILE, RunDir, checkpoint_step, converted_state


def finished_run(folder: Path, checkpoint: str | None = "complete") -> Path:
    """What a finished pretraining run leaves; its checkpoint complete, interrupted or gone."""
    (folder / "final").mkdir(parents=True)
    (folder / "final" / "model.safetensors").write_bytes(b"weights")
    (folder / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    (folder / "loss.png").write_bytes(b"png")
    if checkpoint is not None:
        step = folder / "checkpoints" / "step-4"
        step.mkdir(parents=True)
        (step / "model.safetensors").write_bytes(b"weights")
        if checkpoint == "complete":
            (step / STATE_FILE).write_text('{"step": 4}')
    return folder


def refusal(output_dir: Path, resume: str | None = None, overwrite: bool = False) -> str:
    with pytest.raises(UserError) as info:
        RunDir(output_dir).check(resume, overwrite)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("resume, overwrite", [(None, False), ("auto", False), (None, True)])
def test_a_missing_or_empty_folder_is_a_fresh_start(tmp_path, resume, overwrite):
    RunDir(tmp_path / "missing").check(resume, overwrite)
    RunDir(tmp_path).check(resume, overwrite)


def test_resume_auto_refuses_a_run_without_a_complete_checkpoint(tmp_path):
    for name, checkpoint in (("deleted", None), ("interrupted", "incomplete")):
        run = finished_run(tmp_path / name, checkpoint)
        message = refusal(run, resume="auto")
        assert message.startswith(f"output_dir={run} holds a run (")
        assert "final/" in message and "metrics.jsonl" in message
        assert "no complete checkpoint to continue from" in message
        assert "overwrite=true" in message and "another output_dir" in message


def test_resume_auto_continues_a_run_with_a_complete_checkpoint(tmp_path):
    RunDir(finished_run(tmp_path / "run")).check("auto", False)


def test_no_flag_refuses_a_run_and_offers_what_works(tmp_path):
    resumable = refusal(finished_run(tmp_path / "resumable"))
    assert "already holds a run (final/, checkpoints/, metrics.jsonl and 1 more)" in resumable
    assert "to keep it and continue, resume=auto" in resumable and "to start over, overwrite=true (deletes it)" in resumable
    not_resumable = refusal(finished_run(tmp_path / "finished", checkpoint=None))
    assert "already holds a run" in not_resumable and "overwrite=true" in not_resumable
    assert "resume=auto" not in not_resumable  # it would be refused


def test_overwrite_accepts_a_folder_of_run_entries_only(tmp_path):
    RunDir(finished_run(tmp_path / "run", checkpoint="incomplete")).check(None, True)
    every = tmp_path / "every"
    every.mkdir()
    for name in RunDir.ENTRIES:
        (every / name).mkdir()
    RunDir(every).check(None, True)


@pytest.mark.parametrize("resume, overwrite", [(None, True), ("auto", False), (None, False)])
def test_foreign_files_are_never_a_run(tmp_path, resume, overwrite):
    folder = tmp_path / "thesis"
    folder.mkdir()
    (folder / "thesis.tex").write_text("\\documentclass{article}")
    (folder / "metrics.jsonl").write_text('{"step": 1}\n')  # a name the toolkit uses, still not a run
    message = refusal(folder, resume, overwrite)
    assert message == (
        f"output_dir={folder} holds files that are not a toolkit run (thesis.tex); the toolkit will "
        "not delete them or start a run among them; choose another output_dir"
    )
    assert "already holds a run" not in message and "overwrite=true" not in message


def test_foreign_entries_are_named_a_few_then_counted(tmp_path):
    run = finished_run(tmp_path / "run")
    for name in ("a.txt", "b.txt", "c.txt", "d.txt"):
        (run / name).write_text(name)
    (run / "notes").mkdir()
    message = refusal(run, overwrite=True)
    assert "(a.txt, b.txt, c.txt and 2 more)" in message
    # the run itself can still be continued: resume=auto writes beside the user's files
    RunDir(run).check("auto", False)
    assert "continue the run there with resume=auto" in refusal(run)


def test_a_file_is_not_an_output_dir(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    assert refusal(tmp_path / "notes.txt", overwrite=True).endswith("is a file, not a folder; choose another output_dir")
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_an_output_dir_that_cannot_be_created_is_refused_before_any_work(tmp_path):
    """The OS answers (root passes permission bits, so /proc stands for an unwritable place);
    nothing is left behind."""
    assert refusal(Path("/proc/x/run")) == (
        "output_dir=/proc/x/run cannot be created: /proc does not accept new entries (No such file or directory); "
        "choose a writable output_dir"
    )
    (tmp_path / "notes.txt").write_text("mine")
    assert refusal(tmp_path / "notes.txt" / "run") == (
        f"output_dir={tmp_path / 'notes.txt' / 'run'} cannot be created: {tmp_path / 'notes.txt'} is a file, not a "
        "folder; choose another output_dir"
    )
    RunDir(tmp_path / "new" / "run").check(None, False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_an_explicit_checkpoint_is_left_to_resolve_resume(tmp_path):
    RunDir(finished_run(tmp_path / "run")).check(str(tmp_path / "run" / "checkpoints" / "step-4"), False)


def test_run_entries_sorts_own_from_foreign(tmp_path):
    run = finished_run(tmp_path / "run")
    (run / "thesis.tex").write_text("x")
    assert RunDir(run).entries() == (["final/", "checkpoints/", "metrics.jsonl", "loss.png"], ["thesis.tex"])
    assert RunDir(tmp_path / "missing").entries() == ([], [])


def test_remove_run_deletes_only_the_runs_own_entries(tmp_path):
    run = finished_run(tmp_path / "run")
    (run / "final.tmp").mkdir()
    (run / "thesis.tex").write_text("mine")  # appeared after check_output_dir: still kept
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("keep")
    (run / "tensorboard").symlink_to(elsewhere, target_is_directory=True)
    RunDir(run).remove_own()
    assert sorted(p.name for p in run.iterdir()) == ["thesis.tex"]
    assert (run / "thesis.tex").read_text() == "mine"
    assert (elsewhere / "keep.txt").read_text() == "keep"  # the link went, not what it points to
    RunDir(tmp_path / "missing").remove_own()


def test_checkpoints_are_found_by_step_number_and_completeness(tmp_path):
    run = RunDir(tmp_path / "run")
    for step, complete in ((10, True), (9, True), (11, False)):
        folder = run.checkpoint(step)
        folder.mkdir(parents=True)
        if complete:
            TrainerState(step=step).write(folder)
    (run.checkpoints / "step-x").mkdir()
    assert [p.name for p in run.complete_checkpoints()] == ["step-9", "step-10"]  # numeric order, not text
    assert run.latest_checkpoint() == run.checkpoint(10)
    assert run.resolve_resume("auto") == run.checkpoint(10)
    assert run.resolve_resume(None) is None
    assert checkpoint_step(run.checkpoint(12)) == 12 and checkpoint_step(run.checkpoints / "step-x") is None
    assert RunDir.of_checkpoint(run.checkpoint(10)) == run
    assert RunDir.of_checkpoint(tmp_path) is None
    with pytest.raises(UserError, match="incomplete checkpoint"):
        run.resolve_resume(str(run.checkpoint(11)))
    with pytest.raises(UserError, match="nowhere does not exist"):
        run.resolve_resume(str(tmp_path / "nowhere"))


def test_the_paths_a_run_writes(tmp_path):
    run = RunDir(tmp_path)
    named = [run.final, run.adapter, run.checkpoints, run.metrics, run.tensorboard, run.loss_plot, run.samples]
    assert {p.name for p in named} <= set(RunDir.ENTRIES)  # overwrite=true may delete each of them
    assert run.checkpoint(3) == tmp_path / "checkpoints" / "step-3"


def test_a_checkpoints_conversion_is_beside_it_and_never_a_checkpoint(tmp_path):
    """step-N.converted holds step-N's state by parameter name (a resume under another strategy made it):
    not a checkpoint for resume=auto or rotation, even with a state file inside."""
    run = RunDir(tmp_path / "run")
    folder = run.checkpoint(4)
    folder.mkdir(parents=True)
    TrainerState(step=4).write(folder)
    converted = converted_state(folder)
    assert converted == run.checkpoints / "step-4.converted"
    converted.mkdir()
    TrainerState(step=5).write(converted)
    (run.checkpoints / "step-5.converted.tmp").mkdir()  # one interrupted before its rename
    assert run.complete_checkpoints() == [folder] and run.latest_checkpoint() == folder
    assert checkpoint_step(converted) is None


def test_a_refused_run_leaves_the_folder_as_it_found_it(tmp_path):
    run = finished_run(tmp_path / "run")
    before = sorted(p.name for p in run.iterdir())
    refusal(run)
    assert sorted(p.name for p in run.iterdir()) == before
    RunDir(run).check("auto", False, launch="x", main=True)  # and it is free again
    RunDir(run).release()


@pytest.mark.parametrize("name", ["a component over NAME_MAX", "a unicode component over NAME_MAX in bytes",
                                  "a path over PATH_MAX", "checkpoints would be over PATH_MAX"])
def test_a_path_the_os_cannot_hold_is_one_line(tmp_path, name):
    out = {
        "a component over NAME_MAX": tmp_path / ("r" * 300),
        "a unicode component over NAME_MAX in bytes": tmp_path / ("é" * 130),
        "a path over PATH_MAX": tmp_path / "/".join(["d" * 200] * 21),
        "checkpoints would be over PATH_MAX": tmp_path / "/".join(["d" * 200] * 19) / ("x" * (4000 - 19 * 201 - len(str(tmp_path)))),
    }[name]
    message = refusal(out)
    if "NAME_MAX" in name:
        assert re.search(r"has a folder name of \d+ bytes \(.*\); this filesystem allows at most 255: choose a shorter name",
                         message), message
    else:
        assert "over this system's limit of 4096 for a path: choose a shorter one" in message, message
    assert len(message) < 300
    assert not any(tmp_path.iterdir())
    with pytest.raises(UserError, match="has a folder name of 300 bytes"):
        RunDir(tmp_path).resolve_resume(str(tmp_path / ("r" * 300) / "checkpoints" / "step-2"))


def test_resume_from_a_checkpoint_rotated_away_names_those_there(tmp_path):
    """resume=run/checkpoints/step-2 after checkpoint.keep_last deleted it said 'is not a folder' (issue 44's probe)."""
    checkpoints = tmp_path / "run" / "checkpoints"
    for step in (4, 6, 8):
        (checkpoints / f"step-{step}").mkdir(parents=True)
        (checkpoints / f"step-{step}" / "trainer_state.json").write_text(f'{{"step": {step}}}')
    (checkpoints / "step-8" / "trainer_state.json").unlink()  # a save cut short: not offered
    with pytest.raises(UserError) as refused:
        RunDir(tmp_path / "run").resolve_resume(str(checkpoints / "step-2"))
    assert str(refused.value) == (f"resume={checkpoints / 'step-2'} does not exist; {checkpoints} holds step-4, step-6 "
                                  "(checkpoint.keep_last keeps the newest); give one of them, or resume=auto")
