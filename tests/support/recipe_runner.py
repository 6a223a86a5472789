"""Launch the real recipes as subprocesses, the way users do.

A plain module (not conftest) so that test files can import it reliably.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import cost
import launching
import probe_ranks
import pytest

ROOT = Path(__file__).resolve().parents[2]
LAUNCH_TIMEOUT_S = 600  # one launch; the slowest (SmolLM2 under ZeRO-3, 2 CPU processes) takes ~3 min

# A very small LLaMA and short run, so that a 2-process launch takes seconds on 2 CPU cores.
TINY = [
    "model.config.hidden_size=64",
    "model.config.intermediate_size=128",
    "model.config.num_hidden_layers=2",
    "model.config.num_attention_heads=4",
    "model.config.num_key_value_heads=2",
    "tokenizer.vocab_size=512",
    "data.seq_len=64",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "optim.warmup_steps=2",
    "logging.every=1",
    "eval.every=3",
    "eval.blocks=8",
    "logging.trackers=[]",
    "checkpoint.every=3",
    "samples.max_new_tokens=0",
]
# 6 steps of TINY (checkpoints and evaluations at 3 and 6) with full gradient checkpointing: the strategy
# matrix's run (conftest.strategy_runs), whose outputs the pretraining, strategy and export tests all read
MATRIX_RUN = [*TINY, "train.max_steps=6", "model.gradient_checkpointing=full"]


def run_recipe(
    recipe: str, overrides: list[str], nproc: int, cache: Path, config: str = "pretrain_tiny.yaml",
    accelerate_config: str = "ddp.yaml", check: bool = True, env: dict[str, str | None] | None = None,
    timeout: float = LAUNCH_TIMEOUT_S, script: list[str] | None = None, launch: bool = False,
    launch_args: list[str] | None = None, wrapper: bool = False, launcher: bool = False,
) -> subprocess.CompletedProcess:
    """The recipe on `nproc` ranks forked from tests/support/probe_ranks.py's server (each with the environment
    `accelerate launch --config_file accelerate_config` gives it; plain `python` for one process), its
    imports done once: ~1 CPU-s of start-up instead of ~13 for a 2-process launch (`launch`: one process with
    that launcher's environment too). Forked ranks' output, rank by rank, is the result's stdout (stderr is
    empty). That is every run whose numbers, files or `error:` line a test reads.

    `launcher`: start it as a user's command does, for a test of what the launcher does or of what a run
    prints as a user reads it (the imports' notices included): 1 process, a new `python`; more (or
    `launch`), `accelerate launch` with its own port; `wrapper` (implies `launcher`), recipes/launch.sh's
    launcher with the same arguments. Each costs the imports of every process it starts, and the suite's
    launches have a budget (tests/README.md, "Budget"). `launch_args` go to `accelerate launch` before the script. `script`
    replaces `recipes/{recipe}.py` (e.g. a test-only wrapper). An `env` value None removes that variable.
    A run still going after `timeout` seconds is killed with all its ranks and fails the test: a hang
    never stalls the suite.
    """
    if config.startswith("finetune_smollm2") and not any(o.startswith("model.path=") for o in overrides):
        cost.tally["real_model"] += 1  # the shipped SmolLM2 configs' base
    script = [*(script or [f"recipes/{recipe}.py"]), "--config", f"recipes/configs/{config}", *overrides]
    if nproc == 1 and not launch:
        cmd = [sys.executable, *script]
    else:
        cmd = [
            sys.executable, "-m", "toolkit.launch.launcher" if wrapper else "accelerate.commands.launch",
            "--config_file", accelerate_config if "/" in accelerate_config else f"accelerate_configs/{accelerate_config}",
            "--num_processes", str(nproc), "--main_process_port", str(launching.free_port()), *(launch_args or []), *script,
        ]
    env = {**os.environ, "LLM_TOOLKIT_CACHE": str(cache), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           **(env or {})}
    env = {k: v for k, v in env.items() if v is not None}
    launcher = launcher or wrapper
    if not launcher and nproc == 1 and not launch:
        proc = probe_ranks.python(ROOT / script[0], script[1:], env, timeout)
    elif not launcher:
        proc = probe_ranks.run(ROOT / script[0], script[1:], nproc, accelerate_config, env, timeout, launch_args or [])
    else:
        proc = launching.run(cmd, timeout, cwd=ROOT, env=env)
    if check and proc.returncode != 0:
        _keep_log(proc.stdout, proc.stderr)
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}")
    return proc


def _keep_log(stdout: str, stderr: str) -> None:
    (ROOT / "runs").mkdir(exist_ok=True)
    (ROOT / "runs" / "last_failed_launch.log").write_text(stdout + "\n" + stderr)


def recipe_module(recipe: str):
    """A recipe script imported as a module, to drive its class in-process (one process only)."""
    spec = importlib.util.spec_from_file_location(f"recipe_{recipe}", ROOT / "recipes" / f"{recipe}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# A short chat SFT / continued pretraining on the tiny model that the pretraining recipe wrote.
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
FT_TINY = [
    "data.seq_len=128",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "optim.lr=3e-3",
    "optim.warmup_steps=1",
    "logging.every=1",
    "eval.every=0",
    "eval.blocks=4",
    "logging.trackers=[]",
    "checkpoint.every=3",
    "samples.max_new_tokens=0",
]


# What a run prints, line by line (docs/training.md, "What a run prints"): the recipe's own lines, its end summary,
# progress bars (one terminal line holds a bar's every update, "\r"-separated) and blank lines.
TOOLKIT_LINE = re.compile(
    r"\[(pretrain|finetune|export)\] .*"                       # the recipe's log lines
    r"|error: .*"                                                # a user error, one line
    r"|[a-z][a-z ]{11}: .*"                                      # the summary: 'final model : runs/ft/final'
    r"|(held-out|-{10,}|loss|perplexity|reward margin|reward accuracy) {2,}\S.*"  # the fine-tune's before/after table
)
PROGRESS_BAR = re.compile(r"([^:]{1,60}: *)?\d+%\|[^|]*\| .*")


def foreign_lines(output: str) -> list[str]:
    """The lines of a launch's stdout + stderr that are none of the toolkit's shapes: another library's
    warnings, logs or prints, which the run should not produce."""
    foreign = []
    for line in output.splitlines():
        parts = [p for p in line.split("\r") if p.strip()]
        if not parts or all(PROGRESS_BAR.fullmatch(p) for p in parts):
            continue
        last = parts[-1]  # a line may start after a bar's last update, without a newline between them
        if not (TOOLKIT_LINE.fullmatch(last) and all(PROGRESS_BAR.fullmatch(p) for p in parts[:-1])):
            foreign.append(last[:300])
    return foreign


def assert_generates_with_the_cache(folder: Path) -> None:
    """A folder the toolkit writes for inference (final/, an HF export, a merged LoRA, a weight-only export, the
    GGUF's float copy an adapter names as its base) says use_cache in config.json and generation_config.json:
    training's use_cache=false kept in an export of a checkpoint made generate() 2.6x slower (issue 42 point 5)."""
    import json

    config = json.loads((Path(folder) / "config.json").read_text())
    assert config.get("use_cache") is True, f"{folder}/config.json: use_cache={config.get('use_cache')!r}"
    generation = json.loads((Path(folder) / "generation_config.json").read_text())
    assert generation.get("use_cache", True) is True, f"{folder}/generation_config.json: {generation}"


def saved_lora(base: Path, folder: Path, std: float) -> Path:
    """A LoRA adapter of `base` on q_proj and v_proj, saved in `folder` (no tokenizer: the base's); its B drawn with
    `std` rather than peft's zeros, as a trained adapter's, so that it changes what the model says."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                                LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=std)
    peft_model.save_pretrained(folder)
    return folder
