"""eval.harness_tasks in a training run (docs/evaluation.md): the tasks checked before any work, then scored on the
model as it trains.

In pretraining, each `eval.every` step the model is gathered and written to `harness/step-N/`, and
recipes/evaluate.py scores it in a process of its own while training goes on, so a run with the harness on
trains bit-equal to one without; one scoring runs at a time, and training never waits for one. A fine-tune
scores its base and its result in its own process at the end (recipes/finetune.py, `score`).
When scores are logged, and the last step's: docs/internals.md, toolkit/training/harness_runs.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

from toolkit.export.hf_folder import save_final_model
from toolkit.launch.cli import command as cli_command
from toolkit.launch.environment import alone_environment
from toolkit.launch.rank_process import TRAINER_PID
from toolkit.run.writes import WriteFailed, writing
from toolkit.training.harness import HarnessConfig, check_tasks, harness, task_manager
from toolkit.training.harness_hub import check_hub

LOG = "harness.log"  # every scoring's output, appended, in harness/


class HarnessRuns:
    def __init__(self, cfg: HarnessConfig, root: Path, main: bool, say: Callable[[str], None],
                 log: Callable[..., None], dtype: str = "float32", now: Callable[[], int] = lambda: 0):
        self.cfg, self.root, self.main, self.say, self.log, self.dtype = cfg, root, main, say, log, dtype
        self.now = now  # the step training is at: the trackers take a late row there
        self.manager = None
        if main:  # only the main process scores; its refusal is the launch's one line (toolkit.training.entry)
            harness()  # installed: else one line, before any work
            check_hub(cfg)  # tasks the Hub would give where it cannot be reached: refused before the harness's index
            self.manager = task_manager(cfg)
            check_tasks(cfg, self.manager)
        self.running: tuple[int, str, subprocess.Popen, Path, bool] | None = None
        self.skipped = 0  # due steps not scored: the last scoring still ran
        if main and root.is_dir():  # a model folder a killed run left unscored
            for stale in root.glob("step-*/"):  # the folders; their JSON stays
                shutil.rmtree(stale, ignore_errors=True)

    @classmethod
    def of(cls, trainer) -> HarnessRuns | None:
        cfg = trainer.cfg
        if not cfg.eval.harness_tasks:
            return None
        return cls(HarnessConfig.of_training(cfg.eval), trainer.run.harness, trainer.strategy.is_main, trainer.print,
                   trainer.log, cfg.checkpoint.final_dtype, lambda: trainer.step)

    # ---------------------------------------------------------------- pretraining
    def at_step(self, trainer, due: bool) -> None:
        """A step's part: the scores that arrived, logged; at a `due` step (collective), the model written and a
        scoring of it started, unless the last one still runs: training never waits for a scoring."""
        if self.main:
            self.poll()
        if not due:
            return
        from accelerate.utils import broadcast_object_list

        scoring = broadcast_object_list([self.running[0] if self.running is not None else None])[0]
        if scoring is not None:
            if self.main and not self.skipped:
                self.say(f"step {trainer.step} is not scored: step {scoring}'s scoring still runs, and training does "
                         "not wait for it (raise eval.every or lower eval.harness_limit to score every one; said once)")
            self.skipped += 1
            return
        folder = self.write(trainer.strategy, trainer.model, trainer.tokenizer, trainer.step)
        if folder is not None:
            self.start(trainer.step, "train", folder)

    def write(self, strategy, model, tokenizer, step: int) -> Path | None:
        """Collective: the model gathered and written by the main process for a scoring (None where its write
        failed: said, and training goes on)."""
        live = strategy.accelerator.unwrap_model(model)
        # the folder generates with the KV cache; the model training on keeps its config as a run without this
        cached = [(c, c.use_cache) for c in (live.config, getattr(live, "generation_config", None)) if c is not None]
        folder = None
        try:  # in final_dtype: as final/ will be scored
            folder = save_final_model(strategy, model, tokenizer, self.root / f"step-{step}", {}, {}, self.dtype,
                                      card="", writer="harness scoring")
        except WriteFailed as exc:  # the main process's, said; the writer lets the run go on
            self.say(f"warning: {exc}")
        finally:
            for config, value in cached:
                config.use_cache = value
        return folder

    def start(self, step: int, phase: str, folder: Path, keep: bool = False) -> None:
        """Main process: recipes/evaluate.py on `folder` in a process of its own (after the one still running)."""
        self.wait()
        cfg = self.cfg
        # what `llm-toolkit evaluate` runs, as a user would start it
        command = cli_command(["evaluate", "--from", str(folder), "--tasks", ",".join(cfg.tasks),
                               "--batch-size", str(cfg.batch_size), "--output", str(self.root / f"step-{step}.json"),
                               "--overwrite"])
        for option, value in (("--include-path", cfg.include_path), ("--num-fewshot", cfg.num_fewshot),
                              ("--limit", cfg.limit)):
            if value is not None:
                command += [option, str(value)]
        env = {**alone_environment(), TRAINER_PID: str(os.getpid())}  # one process, not a rank; dies with this one
        out = None
        with writing("harness scoring", say=self.say):
            self.root.mkdir(parents=True, exist_ok=True)  # the first scoring may be final/'s (eval.every=0)
            out = open(self.root / LOG, "a")  # noqa: SIM115 - the child's output; closed once it is started
        if out is None:  # said; the step is not scored
            if not keep:
                shutil.rmtree(folder, ignore_errors=True)
            return
        with out:
            # its own session: a Ctrl-C meant for training stops training, whose end then ends the scoring too
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                       start_new_session=True)
        self.running = (step, phase, process, folder, keep)

    def poll(self) -> None:
        """Main process: the scores of a scoring that has ended, logged."""
        if self.running is not None and self.running[2].poll() is not None:
            self._collect()

    def wait(self) -> None:
        if self.running is not None:
            self.running[2].wait()
            self._collect()

    def abandon(self) -> None:
        """A run stopped or failed (toolkit.training.entry): its scoring ends with it, and the model it was given goes."""
        if self.running is not None:
            step, _, process, folder, keep = self.running
            self.running = None
            try:
                os.killpg(process.pid, signal.SIGKILL)  # its session (start): whatever it started too
            except ProcessLookupError:  # ended already
                process.kill()
            process.wait()
            if not keep:
                shutil.rmtree(folder, ignore_errors=True)

    def _collect(self) -> None:
        step, phase, process, folder, keep = self.running
        self.running = None
        if not keep:
            shutil.rmtree(folder, ignore_errors=True)
        results = self.root / f"step-{step}.json"
        try:
            scores = json.loads(results.read_text())["llm_toolkit_evaluation"]["scores"] if process.returncode == 0 \
                else None
        except (OSError, ValueError, KeyError):
            scores = None
        if scores is None:
            self.say(f"warning: the harness could not score step {step} (exit code {process.returncode}); its output "
                     f"is in {self.root / LOG}; training goes on")
            return
        self.log("harness", {"step": step, "phase": phase, **scores}, at=max(step, self.now()))
        self.say(f"step {step} ({phase}): harness {said(scores)}")


def said(scores: dict[str, float]) -> str:
    return ", ".join(f"{key.removeprefix('harness/')} {value:.4f}" for key, value in scores.items())

