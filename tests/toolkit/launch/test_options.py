"""Every option of `accelerate launch` the launcher passes on is honoured or refused (toolkit/launch/options.py), without
a launch: the launcher's checks run, and Accelerate's choice of launcher is read with its launchers replaced."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from accelerate.commands import launch as accelerate_launch

from toolkit.launch import launcher
from toolkit.launch.options import OPTIONS, repeated

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = str(ROOT / "recipes" / "pretrain.py")


def options() -> dict[str, object]:
    """Accelerate's launch options by dest (the first action of each), positionals and --help left out."""
    found = {}
    for action in accelerate_launch.launch_command_parser()._actions:
        if action.option_strings and action.dest != "help":
            found.setdefault(action.dest, action)
    return found


def test_every_option_of_accelerate_launch_is_classified():
    """An option Accelerate adds fails here until OPTIONS says how it is honoured or the line that refuses it."""
    assert set(options()) - set(OPTIONS) == set(), "classify these in toolkit/launch/options.py OPTIONS"
    assert set(OPTIONS) - set(options()) == set(), "Accelerate no longer has these: drop them from OPTIONS"
    for dest, option in OPTIONS.items():
        assert option.how or option.refused, dest
        assert not option.needs or option.refused, f"{dest}: where it is not honoured, its line is missing"


@pytest.fixture
def launched(monkeypatch, tmp_path):
    """launcher.main(argv) -> (its exit code, the launcher Accelerate took: simple, multi or deepspeed, and the
    args it got), nothing started."""
    monkeypatch.chdir(tmp_path)
    taken = []
    for name in ("simple_launcher", "multi_gpu_launcher", "deepspeed_launcher"):
        monkeypatch.setattr(accelerate_launch, name, lambda args, name=name: taken.append((name, args)))
    monkeypatch.setattr(launcher, "_launch", lambda args: accelerate_launch.launch_command(args) or 0)  # no signals
    monkeypatch.setattr(launcher, "gpus", lambda: 0)

    def launch(argv: list[str]):
        code = launcher.main([*argv, SCRIPT, "--config", "x"])
        return code, taken[-1] if taken else None

    return launch


def a_value(action) -> list[str]:
    """The flag and a value Accelerate's parser takes for it."""
    if action.nargs == 0:
        return [action.option_strings[0]]
    return [action.option_strings[0], str(action.choices[0]) if action.choices else "1"]


def test_each_option_refused_everywhere_is_one_line(launched, capsys):
    for dest, action in options().items():
        if OPTIONS[dest].how:
            continue
        code, taken = launched(["--num_processes", "2", *a_value(action)])
        assert (code, taken) == (2, None), dest
        assert capsys.readouterr().err == f"error: {action.option_strings[0]} {OPTIONS[dest].refused}\n", dest


DDP = str(ROOT / "accelerate_configs" / "ddp.yaml")
ZERO3 = str(ROOT / "accelerate_configs" / "zero3.yaml")
FSDP_TP = str(ROOT / "accelerate_configs" / "fsdp_tp.yaml")

# launch options -> the launcher Accelerate takes and its processes, or the refusal's start (each option refused
# somewhere: once where it is, once where it is not)
CASES = {
    "--num_processes 2 alone (was one process)": (["--num_processes", "2"], ("multi_gpu_launcher", 2)),
    "--num_processes 1": (["--num_processes", "1"], ("simple_launcher", 1)),
    "nothing": ([], ("simple_launcher", 1)),
    "--max_restarts under DDP": (["--config_file", DDP, "--num_processes", "2", "--max_restarts", "1"],
                                 ("multi_gpu_launcher", 2)),
    "--max_restarts on one process": (["--max_restarts", "1"], "--max_restarts is torchrun's"),
    "--main_process_port on one process": (["--main_process_port", "0"], "--main_process_port is torchrun's"),
    "--num_machines 2 on one process": (["--num_machines", "2", "--num_processes", "1"], "--num_machines is torchrun's"),
    "--cpu": (["--cpu"], ("simple_launcher", 1)),
    "--cpu with 2 processes (was one)": (["--cpu", "--num_processes", "2"], "--cpu makes Accelerate launch one process"),
    "--multi_gpu with 2": (["--multi_gpu", "--num_processes", "2"], ("multi_gpu_launcher", 2)),
    "--multi_gpu alone (was a traceback)": (["--multi_gpu"], "--multi_gpu needs 2 or more processes"),
    "two strategies (was a traceback)": (["--multi_gpu", "--use_fsdp", "--num_processes", "2"],
                                         "--multi_gpu and --use_fsdp each choose the launch's strategy"),
    "--zero_stage under ZeRO-3": (["--config_file", ZERO3, "--num_processes", "2", "--zero_stage", "3"],
                                  ("deepspeed_launcher", 2)),
    "--zero_stage under DDP": (["--num_processes", "2", "--zero_stage", "3"], "--zero_stage is DeepSpeed's"),
    "--deepspeed_hostfile on one machine": (["--config_file", ZERO3, "--num_processes", "2", "--deepspeed_hostfile",
                                             "h"], "--deepspeed_hostfile is DeepSpeed's multi-machine launcher's"),
    "--fsdp_version under FSDP": (["--use_fsdp", "--num_processes", "2", "--fsdp_version", "2"],
                                  ("multi_gpu_launcher", 2)),
    "--fsdp_version under DDP": (["--num_processes", "2", "--fsdp_version", "2"], "--fsdp_version is FSDP's"),
    "a tp size under fsdp_tp.yaml": (["--config_file", FSDP_TP, "--parallelism_config_tp_size", "2"],
                                     ("multi_gpu_launcher", 2)),
    "a tp size under DDP": (["--num_processes", "2", "--parallelism_config_tp_size", "2"],
                            "--parallelism_config_tp_size is a parallelism_config size"),
    "--use_parallelism_config beside FSDP2": (["--use_fsdp", "--fsdp_version", "2", "--num_processes", "2",
                                               "--use_parallelism_config"], ("multi_gpu_launcher", 2)),
    "--use_parallelism_config under ZeRO-3 (was a traceback)": (["--config_file", ZERO3, "--num_processes", "2",
                                                                  "--use_parallelism_config"],
                                                                 "--use_parallelism_config is taken by Accelerate only"),
    "--gpu_ids without a GPU": (["--num_processes", "2", "--gpu_ids", "0,1"], "--gpu_ids chooses among GPUs"),
    "--enable_cpu_affinity without a GPU": (["--enable_cpu_affinity"], "--enable_cpu_affinity chooses among GPUs"),
}


@pytest.mark.parametrize("case", CASES)
def test_an_option_is_honoured_where_it_takes_effect_and_refused_elsewhere(case, launched, capsys):
    argv, expected = CASES[case]
    code, taken = launched(argv)
    err = capsys.readouterr().err
    if isinstance(expected, str):
        assert (code, taken) == (2, None), err
        assert err.startswith(f"error: {expected}") and err.count("\n") == 1, err
        return
    assert code == 0 and taken is not None, err
    assert (taken[0], int(taken[1].num_processes)) == expected


def test_conditional_options_are_each_refused_somewhere_in_the_cases():
    """Each option honoured in some launches only has a case where it is refused, or shares its line with one."""
    tried = {word for argv, _ in CASES.values() for word in argv}
    lines = {OPTIONS[dest].refused for dest, action in options().items() if action.option_strings[0] in tried}
    for dest, option in OPTIONS.items():
        if option.how and option.needs:
            assert option.refused in lines, dest


def test_two_processes_without_a_config_launch_quietly(launched, caplog):
    """Accelerate's box of "values were not passed" lines (num_machines, mixed_precision, dynamo_backend) is not shown:
    the launcher fills them with the values Accelerate would take."""
    with caplog.at_level(logging.WARNING):
        code, (name, args) = launched(["--num_processes", "2"])
    assert code == 0 and name == "multi_gpu_launcher"
    assert (args.num_machines, args.mixed_precision, args.dynamo_backend) == (1, "no", "no")
    assert "were not passed" not in caplog.text


def test_every_option_given_twice_is_one_line():
    """argparse keeps an option's last value in silence: each option of the launch parser, given twice before the
    recipe (as --opt v and --opt=v), is refused in one line that names both values; once, or after the recipe, it is
    not."""
    parser = accelerate_launch.launch_command_parser()
    for dest, action in options().items():
        flag = next(f for f in action.option_strings if f.startswith("--"))
        value = [] if action.nargs == 0 else ["1"]
        twice = [flag, *value, f"{flag}={value[0]}" if value else flag, SCRIPT, "--config", "x.yaml"]
        said = f"{action.option_strings[0]} is given twice{' (1, 1)' if value else ''}; give it once"
        assert repeated(parser, twice, SCRIPT) == said, dest
        assert repeated(parser, [flag, *value, SCRIPT, flag, *value], SCRIPT) is None, dest  # the recipe's own


def test_a_repeated_option_is_refused_before_anything_launches(launched, capsys):
    """(was: the last --config_file taken, zero2.yaml's 8 processes, then an unrelated batch-size error)"""
    assert launched(["--config_file", DDP, "--config_file", ZERO3]) == (2, None)
    assert capsys.readouterr().err == f"error: --config_file is given twice ({DDP}, {ZERO3}); give it once\n"
