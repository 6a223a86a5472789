"""The README's and docs/' commands run as written on the machine they say they are for: every launch of a CPU-sized
recipe (pretrain_tiny, the SmolLM2 fine-tunes) starts no more processes than a 2-core machine has cores, as
recipes/launch.sh judges a launch (an accelerate config alone says 8, a node of GPUs)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from accelerate.commands.launch import launch_command_parser

from toolkit.launch.cli import command
from toolkit.launch.launcher import ranks_per_machine

ROOT = Path(__file__).resolve().parents[1]
CPU_SIZED = re.compile(r"pretrain_tiny|finetune_smollm2")  # also as llm-toolkit names them


def launches(text: str) -> list[list[str]]:
    """Each `accelerate launch` or `bash recipes/launch.sh` command of the README's code blocks, as its arguments."""
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    commands = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    found = []
    for line in commands:
        words = shlex.split(line.split("#")[0])
        if words[:1] == ["llm-toolkit"] and words[1:2] in (["pretrain"], ["finetune"]):
            words = command(words[1:])  # what the installed command runs: the launcher's arguments, or one process
            words = ["bash", "recipes/launch.sh", *words[3:]] if "toolkit.launch.launcher" in words else []
        for start in ("accelerate launch", "bash recipes/launch.sh"):
            head = start.split()
            if words[: len(head)] == head:
                found.append(words[len(head):])
    return found


def test_the_readmes_cpu_launches_fit_a_2_core_machine(monkeypatch):
    monkeypatch.chdir(ROOT)
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    readme = [c for c in launches(pages[0].read_text()) if CPU_SIZED.search(" ".join(c))]
    assert readme, "the README's fine-tune under ZeRO-3 by llm-toolkit"
    commands = [c for page in pages for c in launches(page.read_text()) if CPU_SIZED.search(" ".join(c))]
    assert len(commands) >= 4  # and the pretraining, the LoRA fine-tune and the DPO one of docs/
    for argv in commands:
        assert ranks_per_machine(launch_command_parser().parse_args(argv), gpus=0, cores=2) is None, shlex.join(argv)


@pytest.mark.parametrize("argv, fits", [(["--config_file", "accelerate_configs/zero3.yaml", "x.py"], False),
                                        (["--config_file", "accelerate_configs/zero3.yaml", "--num_processes", "2", "x.py"], True)])
def test_the_check_tells_a_crowded_launch(argv, fits, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert (ranks_per_machine(launch_command_parser().parse_args(argv), gpus=0, cores=2) is None) == fits


def test_the_readme_gets_to_a_fine_tuned_exported_model_in_its_first_screen():
    """Install, fine-tune and export, as commands, within the README's first 40 lines (issue 42: the fine-tuning command
    came at line ~190 of 575); the reference lives in docs/."""
    first = (ROOT / "README.md").read_text().splitlines()[:40]
    commands = [line.split()[:2] for line in first]
    # an environment first: Debian's and Ubuntu's own python3 take nothing from pip (PEP 668), and install.sh says so
    for wanted in (["python3", "-m"], ["bash", "recipes/install.sh"], ["llm-toolkit", "finetune"],
                   ["llm-toolkit", "export"]):
        assert wanted in commands, wanted


def test_every_link_between_the_readme_and_docs_leads_to_a_file_and_heading_that_exist():
    """Sections moved between the README and docs/ keep their links: each relative link's file exists, and a
    `#fragment` names one of its headings (as GitHub makes them: lower case, spaces to '-', punctuation dropped)."""
    pages = [ROOT / "README.md", ROOT / "tests" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # a web address
            path, _, fragment = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif fragment and file.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", file.read_text(), re.M)
                slugs = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}
                if fragment not in slugs:
                    broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, broken


# issue 41's switches (and the profile mode): each a row of the README's table of options
SPEED_OPTIONS = ("train.step_sync", "model.cast_weights", "model.compile", "model.loss", "model.loss_positions",
                 "model.gradient_checkpointing",
                 "train.mixed_precision", "train.fp8_recipe", "train.fp8_layers", "checkpoint.async_save", "optim.fused",
                 "logging.profile")


def test_the_readmes_table_of_options_lists_every_speed_switch_with_its_choices_and_a_test_that_exists():
    """Each switch under "Options for speed on a GPU": its choices as the config takes them, the default first, and the
    CPU test that shows it trains the same model, a test that exists (issue 41: "documented in the README's table of
    options")."""
    import dataclasses
    import typing

    from toolkit.config.load import load_config
    from toolkit.training.recipe_config import PretrainConfig

    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Options for speed on a GPU", 1)[1].split("\n## ", 1)[0]
    rows = {cells[0].strip("` "): cells for line in section.splitlines() if line.startswith("| `")
            for cells in [[c.strip() for c in line.strip("|").split("|")]]}
    assert set(rows) == set(SPEED_OPTIONS)
    cfg = load_config(PretrainConfig, None, [])
    tests = {p.name: p.read_text() for p in (ROOT / "tests").rglob("test_*.py")}
    for key in SPEED_OPTIONS:
        section_name, name = key.split(".")
        section_cfg = getattr(cfg, section_name)
        hint = typing.get_type_hints(type(section_cfg))[name]
        default = getattr(section_cfg, name)
        choices = re.findall(r"`([^`]+)`", rows[key][1])
        if typing.get_origin(hint) is typing.Literal:
            assert choices == [default, *(c for c in typing.get_args(hint) if c != default)], key
        elif hint is bool:  # as YAML writes them
            assert choices == [str(default).lower(), str(not default).lower()], key
        else:  # logging.profile: off, or the steps to trace
            assert choices[0] == str(default).replace(" ", ""), key
        assert any(f.name == name for f in dataclasses.fields(section_cfg))
        for file, test in re.findall(r"`(test_\w+\.py)::(test_\w+)", rows[key][3]):
            assert f"def {test}(" in tests[file], (key, file, test)
    below = re.findall(r"`(test_\w+\.py)::(test_\w+)`", section.split("\n\n")[-2])
    assert below and all(f"def {test}(" in tests[file] for file, test in below)
