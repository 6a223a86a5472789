"""The planted faults: parsed as written, each fired once, and nothing at all when unset."""

from __future__ import annotations

import errno
import subprocess
import sys

import pytest

from toolkit.run import faults


@pytest.fixture
def log(tmp_path, monkeypatch):
    path = tmp_path / "faults.log"
    monkeypatch.setenv(faults.LOG_ENV, str(path))
    return path


def test_nothing_is_armed_without_the_variable(monkeypatch):
    monkeypatch.delenv(faults.ENV, raising=False)
    monkeypatch.delenv(faults.FAIL_ENV, raising=False)
    assert not faults.armed("backward", 3)
    faults.kill_point("backward", 3)  # returns: nothing planned


def test_a_kill_matches_its_point_step_and_rank_only(monkeypatch, log):
    monkeypatch.setenv(faults.ENV, "backward@3/0,save.manifest@4/1,final")
    assert faults.armed("backward", 3)
    assert not faults.armed("backward", 2) and not faults.armed("forward", 3)
    assert not faults.armed("save.manifest", 4)  # rank 1's, and this process is rank 0
    assert faults.armed("final") and faults.armed("final", 7)  # no step: the first time it is reached


def test_a_kill_fires_once_and_really_kills(tmp_path, log):
    """SIGKILL in a child process; the log keeps a relaunch from dying at the same point."""
    code = "from toolkit.run import faults; faults.kill_point('eval', 3); print('survived')"
    env = {faults.ENV: "eval@3/0", faults.LOG_ENV: str(log), "PATH": ""}
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert first.returncode == -9 and "survived" not in first.stdout
    assert log.read_text().split() == ["eval@3/0"]
    again = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert again.returncode == 0 and "survived" in again.stdout


def test_a_write_failure_raises_the_errno_it_names_once(monkeypatch, log, tmp_path):
    monkeypatch.setenv(faults.FAIL_ENV, "save.rank_files@4/0=EIO,save.manifest@4/0")
    with pytest.raises(OSError) as info:
        faults.fail_point("save.rank_files", 4, tmp_path / "model.safetensors")
    assert info.value.errno == errno.EIO and info.value.filename == str(tmp_path / "model.safetensors")
    faults.fail_point("save.rank_files", 4, tmp_path)  # fired already
    with pytest.raises(OSError) as info:
        faults.fail_point("save.manifest", 4, tmp_path)
    assert info.value.errno == errno.ENOSPC  # the default


def test_a_misspelt_point_or_a_missing_log_is_refused(monkeypatch, log):
    monkeypatch.setenv(faults.ENV, "backwards@3")
    with pytest.raises(RuntimeError, match="unknown point 'backwards'"):
        faults.armed("backward", 3)
    monkeypatch.setenv(faults.ENV, "backward@3")
    monkeypatch.delenv(faults.LOG_ENV)
    with pytest.raises(RuntimeError, match="without LLM_TOOLKIT_KILL_LOG"):
        faults.armed("backward", 3)


@pytest.mark.parametrize("adapter", [False, True], ids=["full", "lora"])
def test_the_backward_point_fires_once_the_later_layers_have_their_gradients(tiny_model, monkeypatch, log, adapter):
    """backward@N fires once, inside the backward, when every decoder layer but the first has its gradients: at the
    embedding's output where the embedding trains, at the first trained module's where it is frozen (a LoRA: its
    embedding's output needs no gradient, and the point was never reached)."""
    import torch
    from peft import LoraConfig, get_peft_model

    monkeypatch.setenv(faults.ENV, "backward@3/0")
    model = tiny_model("llama", num_hidden_layers=2)
    if adapter:
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    trained = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    fired = []
    monkeypatch.setattr(faults, "kill_point", lambda point, step=None: fired.append(
        (point, step, {name for name, p in trained if p.grad is not None})))
    ids = torch.randint(0, 100, (2, 8))
    with faults.model_kill_points(model, 3):
        loss = model(input_ids=ids, labels=ids).loss
        assert fired == []  # not in the forward
        loss.backward()
    assert [(point, step) for point, step, _ in fired] == [("backward", 3)]
    later = [name for name, _ in trained if ".layers.1." in name]
    assert later and set(later) <= fired[0][2]
    model(input_ids=ids, labels=ids).loss.backward()  # outside the context: its hooks are gone
    assert len(fired) == 1
