"""The training loop every recipe runs: explicit, top to bottom, no callbacks.

    trainer = Trainer("pretrain", cfg)             # checks output_dir, launches the strategy
    trainer.use_data(train, val, collate, counts)  # after the recipe's data; then its model:
    trainer.prepare(model, tokenizer, ...)         # optimizer and schedule, resume, metrics
    trainer.fit(); trainer.finish()                # steps and what is due after each; the last save
    trainer.close()                                # after the recipe's deliverable: trackers, metrics, loss plot
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import datasets
import torch
from accelerate.utils import gather_object

from toolkit.checkpoint.checkpointer import Checkpointer, SaveStopped
from toolkit.checkpoint.settings import check_before_preparing, trained_settings
from toolkit.checkpoint.trainer_state import TrainerState
from toolkit.config.combinations import check as check_combinations
from toolkit.config.declarations import declared
from toolkit.config.load import to_dict
from toolkit.config.switches import Machine
from toolkit.config.switches import resolve as resolve_switches
from toolkit.data.batching import BatchSchedule
from toolkit.data.mixture import MixtureSchedule
from toolkit.data.packing import check_attention
from toolkit.data.streaming import MixedStreams, StreamingBlocks
from toolkit.export.hf_folder import write_model_files
from toolkit.launch.environment import is_launch_main
from toolkit.launch.rank_process import launch_id
from toolkit.models.loss import output_head
from toolkit.models.preference_loss import PreferenceLoss
from toolkit.models.router import RouterLoss
from toolkit.models.weight_cast import AUTOCAST, weight_cast
from toolkit.run.faults import model_kill_points, planted
from toolkit.run.folder import RunDir
from toolkit.run.paths import check_run_paths
from toolkit.strategy.accelerator import release_freed_memory
from toolkit.strategy.distributed import Strategy
from toolkit.strategy.sharding import GradientMeter, held_bytes
from toolkit.training.cadence import Due, Stepped, Window
from toolkit.training.canary import Canary
from toolkit.training.evaluation import evaluate, forwards, said
from toolkit.training.feed import Feed
from toolkit.training.forgetting import Budget, Judged
from toolkit.training.harness_runs import HarnessRuns
from toolkit.training.loss_plot import plot_loss
from toolkit.training.metrics import (
    HostCopy,
    MetricsWriter,
    TrackerLog,
    beside_the_bar,
    check_kind,
    check_trackers,
    estimate_mfu,
    flat_hparams,
    peak_flops,
    peak_memory_mb,
    tracker_log_with,
)
from toolkit.training.optim import prepare_optimization, use_fused, wind_back
from toolkit.training.phases import EVALUATIONS, Phases
from toolkit.training.profiling import StepProfiler
from toolkit.training.step import (
    Diverged,
    check_step_sync,
    host_decides,
    optimizer_step,
    pipeline_step,
    skips_on_device,
    verdict,
)
from toolkit.training.stop import StopRequest


class Stopped(Exception):
    """Raised after the stop checkpoint is saved; the recipe exits with a non-zero code."""


class Trainer:
    """One run's loop. `cfg` is a recipe config with output_dir, seed, resume, overwrite and the
    sections model (attn_implementation), train, optim, checkpoint, logging and eval."""

    def __init__(self, name: str, cfg: Any):
        self.phases = Phases(is_launch_main())  # what each phase of this process costs, from here; the recipes' too
        self.name, self.cfg, self.run = name, cfg, RunDir(cfg.output_dir)
        self.stop = StopRequest(name, is_launch_main(), self.run.release)
        check_attention(cfg.model.attn_implementation)
        check_trackers(cfg.logging.trackers)
        check_run_paths(cfg)  # no folder where it or another run deletes; then the folder's one owner from here:
        self.run.check(cfg.resume, cfg.overwrite, launch_id(), is_launch_main())  # (released by close or a refusal)
        try:
            self._launch(name, cfg)
        except BaseException:
            self.run.release()
            raise

    def _launch(self, name: str, cfg: Any) -> None:
        self.resume_from = self.run.resolve_resume(cfg.resume)
        self.run.check_unfinished(cfg)
        if self.resume_from is not None:  # what its record decides that the launch does not: before DeepSpeed loads
            check_before_preparing(self.resume_from, cfg, optimizer_in_ds_json=True, launched=False)

        # The strategy, world size and backend come from the accelerate config file.
        t = cfg.train
        self.strategy = strategy = Strategy.launch(
            mixed_precision=t.mixed_precision, global_batch=t.global_batch_size, micro_batch=t.micro_batch_size,
            max_grad_norm=cfg.optim.max_grad_norm, project_dir=str(self.run.root), pipeline_stages=t.pipeline_stages,
            trackers=tracker_log_with(cfg.logging.trackers, str(self.run.root)), timeout_s=t.collective_timeout_s,
        )
        self.accelerator = strategy.accelerator
        if said := resolve_switches(cfg, Machine(self.accelerator.device.type, self.accelerator.mixed_precision,
                                                 strategy.layout)):
            self.print(said)
        check_combinations(cfg, strategy.layout, self.accelerator.mixed_precision,  # before the model loads
                           self.accelerator.device.type)
        strategy.check_sequence_length(cfg.data.seq_len)
        owned = bool(strategy.family.optimization_owned(strategy))  # a DeepSpeed JSON's own optimizer
        fused = use_fused(cfg.optim.fused, self.accelerator.device) and not owned
        check_step_sync(t.step_sync, host_decides(strategy.family, self.accelerator.mixed_precision == "fp16", fused))
        if self.resume_from is not None:  # with the switches made concrete, and the optimizer's keys where they run
            check_before_preparing(self.resume_from, cfg, owned)
        restart = cfg.resume == "auto" and self.resume_from is None and self.run.died_before_first_checkpoint()
        if restart:
            self.print(f"resume=auto: {self.run.root} has no complete checkpoint yet (the run stopped before "
                       "its first one); starting it over")
        if (cfg.overwrite or restart) and strategy.is_main:
            self.run.remove_own()  # only its own entries: check() refused anything else
        self.accelerator.wait_for_everyone()
        self.run.root.mkdir(parents=True, exist_ok=True)
        # the length of a run of train.epochs is said here too: its steps follow once the data is packed (use_data)
        length = f" train.epochs={t.epochs:g} (its steps follow from the packed blocks)" if t.epochs is not None else ""
        self.print(strategy.describe() + length)
        if not strategy.is_main:
            datasets.disable_progress_bars()

        self.state = TrainerState(seed=cfg.seed, global_batch_size=cfg.train.global_batch_size)
        self.feed: Feed | None = None  # set by use_data, use_mixture or use_stream
        self.objective: PreferenceLoss | None = None  # set by use_data: the loss of preference pairs
        self.eval_step = -1
        self.checkpoints = Checkpointer(strategy, self.run, cfg.checkpoint, self.print, self.log)
        self.measured = False
        self.metrics: MetricsWriter | None = None
        self.trackers = TrackerLog(self.accelerator, cfg.logging.trackers, self.print)  # until a write fails
        self.nonfinite_in_a_row = 0  # skipped steps since the last one that trained
        self.harness = HarnessRuns.of(self)  # eval.harness_tasks: checked now, before the data and the model
        self.budget: Budget | None = None  # set by use_budget: a fine-tune's forgetting budget
        self.judged: Judged | None = None  # the budget's verdict on the newest evaluation
        self.harness_steps = self.harness is not None and type(cfg).HARNESS_STEPS

    @property
    def step(self) -> int:
        return self.state.step

    @property
    def resumed(self) -> bool:
        return self.resume_from is not None

    def print(self, line: str) -> None:
        with beside_the_bar(getattr(self, "bar", None)):
            self.strategy.print(f"[{self.name}] {line}")

    # ------------------------------------------------------------------ setup
    def use_data(
        self, train: datasets.Dataset, val: datasets.Dataset | None, collate: Callable, target_counts: Callable,
        objective: PreferenceLoss | None = None,
    ) -> BatchSchedule:
        """Packed blocks, their collate (blocks -> model inputs with labels) and per-block target counts; with a
        preference `objective`, blocks of pairs and their counts of pairs (toolkit.data.preference)."""
        self.objective = objective
        t = self.cfg.train
        schedule = BatchSchedule(len(train), t.global_batch_size, t.micro_batch_size, *self.strategy.data_ranks,
                                 self.cfg.seed)
        self.feed = Feed(collate, val, t.global_batch_size, t.micro_batch_size, train, target_counts, schedule)
        if t.epochs is not None:  # the steps follow from the packed blocks; a resume derives the same number
            t.max_steps = schedule.steps_for(t.epochs)
            self.print(schedule.epochs_said(t.epochs, t.max_steps))
        return schedule

    def use_mixture(self, train: dict[str, datasets.Dataset], val: dict[str, datasets.Dataset], plan: list,
                    collate: Callable, target_counts: Callable,
                    objective: PreferenceLoss | None = None) -> MixtureSchedule:
        """use_data for several sources mixed by weight: each one's packed and held-out blocks by name, and the
        weights from each step on (toolkit.data.mixture.weight_plan)."""
        self.objective = objective
        t, names = self.cfg.train, list(train)
        schedule = MixtureSchedule([len(train[n]) for n in names], plan, names, t.global_batch_size,
                                   t.micro_batch_size, *self.strategy.data_ranks, self.cfg.seed)
        blocks = datasets.concatenate_datasets([train[n] for n in names])
        self.feed = Feed(collate, val, t.global_batch_size, t.micro_batch_size, blocks, target_counts, schedule)
        self.state.mixture = self.feed.mixture
        return schedule

    def use_stream(self, train: StreamingBlocks | MixedStreams, val: datasets.Dataset | dict | None,
                   collate: Callable) -> None:
        """Blocks packed as the steps take them (data.streaming): each rank takes its next
        global_batch / data ranks blocks a step, and the loss normaliser is summed over the ranks."""
        t = self.cfg.train
        self.feed = Feed(collate, val, t.global_batch_size, t.micro_batch_size, stream=train)
        self.state.mixture = self.feed.mixture

    def use_budget(self, budget: Budget, general: datasets.Dataset | None = None,
                   collate: Callable | None = None) -> None:
        """A forgetting budget judged at each evaluation (after use_data or use_mixture): `general` is the held-out
        blocks of a general set read from a path, with their `collate` (None: a source of the mixture)."""
        self.budget, self.general, self.general_collate = budget, general, collate
        self.state.budget = budget.state

    def step_data(self, step: int) -> tuple[Iterator[dict], int, int]:
        """This rank's micro-batches (block columns) of `step`, and the global batch's target and token counts."""
        acc, (world, _) = self.accelerator, self.strategy.data_ranks
        # every rank of a tensor/context/sequence-parallel group or pipeline holds the same blocks
        return self.feed.step_data(step, world, self.strategy.layout.world // world,
                                   lambda t: acc.reduce(t.to(acc.device), "sum").cpu())

    def prepare(
        self, model: torch.nn.Module, tokenizer, n_params: int, flops_token: float,
        model_files: dict[str, dict] | None = None,
    ) -> None:
        """Optimizer and schedule over the trainable weights, prepared by the strategy; then resume.

        `model_files` are extra JSON files for each checkpoint's model_files/ (e.g. base_model.json)."""
        cfg = self.cfg
        self.tokenizer, self.n_params, self.flops_token = tokenizer, n_params, flops_token
        self.vocab_size = getattr(getattr(model, "config", None), "vocab_size", None)  # for the dead-model check
        self.router = RouterLoss.of(model)  # a mixture of experts: its routers' loss joins the objective
        self.model_files = model_files or {}
        if cfg.model.chunk_tokens:
            output_head(model)  # a head the chunked loss cannot replace is refused before any step
        # The recipe's AdamW + warmup/decay, unless a user's DeepSpeed JSON defines its own.
        if owned := self.strategy.family.optimization_owned(self.strategy):
            self.print(f"the DeepSpeed config defines {' and '.join(owned)}: using them instead of the recipe's optim "
                       "section")
        if cfg.optim.lr_scaling != "none":
            self.print(
                f"optim.lr={cfg.optim.lr:g} was tuned at a global batch of {cfg.optim.lr_reference_batch}; scaled "
                f"{cfg.optim.lr_scaling} to train.global_batch_size={cfg.train.global_batch_size}: peak lr "
                f"{cfg.optim.peak_lr(cfg.train.global_batch_size):g}"
            )
        model = self.strategy.apply_model_parallel(model, cfg.data.seq_len, cfg.model.attn_implementation)
        for line in self.strategy.notes:
            self.print(line)
        if self.strategy.layout.ep > 1:  # the first line is logged before the model is known: say it again, whole
            self.print(self.strategy.describe())
        self.model, self.optimizer, self.scheduler, self.step_scheduler = prepare_optimization(
            self.strategy, model, cfg.optim, cfg.train.max_steps, cfg.train.global_batch_size
        )
        self.skip_on_device = skips_on_device(cfg.train.step_sync, self.accelerator, self.optimizer,
                                              self.strategy.family)
        self.state.settings = trained_settings(cfg, bool(owned))  # train.epochs has set max_steps
        self.weight_cast = weight_cast(cfg.model.cast_weights, self.accelerator.unwrap_model(self.model),
                                       self.strategy.layout, AUTOCAST.get(self.accelerator.mixed_precision),
                                       cfg.model.compile)
        unwrapped, stream = self.accelerator.unwrap_model(self.model), self.feed.stream
        self.canary = Canary.of(cfg, unwrapped, self.weight_cast, self.accelerator.mixed_precision, self.skip_on_device,
                                self.print, self.log)
        self.checkpoints.attach(unwrapped, lambda d: write_model_files(unwrapped, self.tokenizer, d, self.model_files),
                                stream)
        if self.resume_from is not None:
            self.state = self.checkpoints.load(
                self.resume_from, self.state, auto=cfg.resume == "auto", streaming=stream is not None,
                max_steps=cfg.train.max_steps, peak_lr=cfg.optim.peak_lr(cfg.train.global_batch_size),
                scheduler=self.scheduler if self.step_scheduler else None, on_resume=declared(type(cfg), "resume"),
            )
            self.resume_from, self.eval_step = self.checkpoints.loaded, self.state.eval_step
        if self.strategy.is_main:
            self.metrics = MetricsWriter(self.run.metrics, self.step, self.print)
        if cfg.logging.trackers:
            # the project is the run folder's name (wandb's project, mlflow's experiment, ...); tensorboard
            # keeps its events in tensorboard/ (tracker_log_with)
            project = self.run.root.resolve().name
            self.accelerator.init_trackers(project, config=flat_hparams(to_dict(cfg)))
        self.peak = peak_flops(self.strategy.device)
        self.profiler = StepProfiler(cfg.logging.profile, self.run.root, self.accelerator.is_main_process,
                                     self.strategy.device, self.print)

    # ------------------------------------------------------------------ train
    def fit(self) -> None:
        self.stop.step = lambda: self.state.step
        self.stop.training = True
        if self.budget is not None:  # resumed: replay's decisions so far, so that the data order goes on as it would have
            self.state.budget = self.budget.restore(self.state.budget, self.feed.schedule)
            if ended := self.budget.ended_said():
                self.print(ended)
        # The bar's line ends also when a step raises (the phase closes it), so the error line each rank prints
        # starts a line of its own instead of being glued after the bar's last "\r".
        with self.phases("training", total=self.cfg.train.max_steps, initial=self.state.step, leave=True) as bar:
            self.train_steps(bar)

    def train_steps(self, bar) -> None:
        """A step, then what is due after it, in this order; each (but the verdict) due at a step, then run."""
        cfg, state = self.cfg, self.state
        window = Window()
        self.previous: HostCopy | None = None  # the step before's all-reduce
        self.unread: tuple[int, int] | None = None  # (step, tokens) of a step whose verdict stayed on the device
        while state.step < cfg.train.max_steps and not (self.budget and self.budget.state["ended"]):
            done = self.train_step(window)
            trained = self.judge(done, bar)
            if trained and done.due.log:
                self.log_step(done, window, bar)
            bar.update(1)
            # The final evaluation runs here, before the last checkpoint: under FSDP2 an evaluation
            # forward after save_state, with no training step between, leaves the root's
            # parameters unsharded in storage that cannot be freed, and gathering the final
            # model then fails ("Trying to resize storage that is not resizable").
            judged = None
            if done.due.eval:
                state.last_eval = self.evaluate("after" if done.due.last else "train")
                judged = self.judged
                if judged is not None and judged.plan is not None:  # replay: the next steps draw by the new weights
                    self.feed.schedule.reweigh(judged.plan)
            # A signal, and the end of a checkpoint's writes, are seen in this step's values where they were
            # read, else in the previous step's, which arrived while this step ran: every rank agrees at one step.
            flags = done.values if done.values is not None else self.previous.get() if self.previous else None
            self.save_on_cadence(done, flags, keep=judged is not None and judged.keep)
            self.previous = done.totals
            if flags is not None and flags[1] > 0:
                self.stop_at(done, bar)
            if self.harness is not None:
                self.harness.at_step(self, done.due.harness)
            if judged is not None and judged.end:
                best = self.budget.state["best_step"]
                self.print(f"forgetting.patience={cfg.forgetting.patience}: no better domain loss within the budget "
                           f"for {cfg.forgetting.patience} evaluations; the run ends at step {state.step} of "
                           f"{cfg.train.max_steps}" + (f" (the best within it: step {best})" if best else
                                                       " (none within it)"))
        bar.close()
        self.checkpoints.wait(state.step)  # training ends with its checkpoints complete

    def train_step(self, window: Window) -> Stepped:
        """One optimizer step: this rank's micro-batches forward and backward, the update, and the step's one
        all-reduce, read on the host where something due after the step needs its values."""
        cfg, acc, state = self.cfg, self.accelerator, self.state
        self.profiler.begin(state.step + 1)
        t0 = time.perf_counter()
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this step trains with
        blocks, targets, tokens = self.step_data(state.step)
        scale = self.strategy.backward_scale(targets)
        split, attn = self.strategy.split_sequences, cfg.model.attn_implementation
        batches = (split(self.feed.collate(columns, attn)) for columns in blocks)
        # Once per run, measure the bytes each rank really holds (sharding made visible).
        meter = GradientMeter(acc, self.model, self.optimizer) if not self.measured else None
        with (
            planted(acc.unwrap_model(self.model), state.step + 1) as faulty,
            meter or contextlib.nullcontext(),
            self.weight_cast.step() if self.weight_cast is not None else contextlib.nullcontext(),
        ):
            if self.canary is not None:  # train.canary: where due, the step's fast paths checked before it trains
                batches = self.canary.before(state.step + 1, batches, cfg.model.chunk_tokens)
            loss_sum, grad_norm, nonfinite, extras = self.update(faulty(batches), scale, meter)
        if self.canary is not None:
            self.canary.after(nonfinite, lr)
        on_device = nonfinite if isinstance(nonfinite, torch.Tensor) else None  # the verdict's flags, unread
        # A skipped step leaves the schedule where it was; one read later steps it now and back if skipped.
        if self.step_scheduler and (nonfinite is None or on_device is not None):
            self.scheduler.step()
        state.step += 1
        totals = self.reduce_step(loss_sum, on_device, extras)
        due = Due.at(state.step, cfg, self.feed.val is not None, self.harness_steps)
        # Inside the timed window, so that tokens/s counts the device's work, not its queueing.
        needed = due.log or due.eval or due.save or self.checkpoints.unproven
        # (a verdict left on the device is read when needed on the CPU too: the same steps as on a GPU)
        values = totals.get() if needed or (totals.immediate and on_device is None) else None
        window.add(tokens, time.perf_counter() - t0)
        self.profiler.end(state.step)
        if meter is not None:
            self.measured = True
            held = gather_object([held_bytes(acc, self.model, self.optimizer, meter)])
            self.log("memory", {"step": state.step, "held_bytes": held})
        loss = None if values is None else values[0] / self.strategy.loss_copies / max(1, targets)
        return Stepped(state.step, lr, tokens, grad_norm, nonfinite, totals, values, loss, due)

    def update(self, batches: Iterator[dict], scale, meter: GradientMeter | None) -> tuple:
        """Forward and backward over the micro-batches, clipped, stepped: (loss sum, grad norm, what was not
        finite, the extras the all-reduce carries)."""
        cfg, acc = self.cfg, self.accelerator
        if self.strategy.pipeline is not None:
            return pipeline_step(acc, self.strategy.pipeline, self.optimizer, batches, scale, cfg.optim.max_grad_norm,
                                 meter)
        return optimizer_step(acc, self.model, self.optimizer, batches, scale, cfg.optim.max_grad_norm,
                              cfg.model.chunk_tokens, self.router, self.objective, self.skip_on_device,
                              self.weight_cast, self.strategy.family)

    def reduce_step(self, loss_sum: torch.Tensor, on_device: torch.Tensor | None, extras: torch.Tensor) -> HostCopy:
        """One all-reduce for the global loss and for "did any rank get a stop signal", read on the host only where
        a value is needed: waiting for it each step would leave the GPU idle while the host prepares the next step.
        Its values: [loss, stop, the non-finite flags (loss, grad), router loss, the objective's STATS, writing]."""
        acc = self.accelerator
        stop_flag = torch.tensor(float(self.stop.requested), dtype=torch.float64, device=acc.device)
        skipped = on_device if on_device is not None else torch.zeros(2, dtype=torch.float64, device=acc.device)
        # the ranks whose checkpoint files are still being written in the background
        writing = torch.tensor([float(self.checkpoints.writing())], dtype=torch.float64, device=acc.device)
        return HostCopy(acc.reduce(torch.cat([torch.stack([loss_sum, stop_flag]), skipped, extras, writing]),
                                   reduction="sum"))

    def judge(self, done: Stepped, bar) -> bool:
        """Whether step `done` trained. Its verdict is settled now, or, left on the device (train.step_sync=none),
        at the next step, with this one's values, which arrived while that step ran; the first step that trained
        after a resume is checked for a dead model."""
        if self.unread is not None:
            self.settle(*self.unread, verdict(self.previous.get()[2:4]), bar, unread=True)
            self.unread = None
        nonfinite = done.nonfinite
        if done.on_device is not None and done.values is None:
            self.unread = (done.step, done.tokens)
        else:
            if done.on_device is not None:
                nonfinite = verdict(done.values[2:4])
            self.settle(done.step, done.tokens, nonfinite, bar, unread=done.on_device is not None)
        if nonfinite is None:
            self.checkpoints.check_loaded(done.loss, done.grad_norm, self.vocab_size, self.objective is not None)
        return nonfinite is None

    def log_step(self, done: Stepped, window: Window, bar) -> None:
        """The step's train row, and the bar's numbers; the window starts again."""
        state, values, acc = self.state, done.values, self.accelerator
        tps = window.rate()
        self.log("train", {
            "step": done.step,
            "loss": done.loss,
            "lr": done.lr,
            "grad_norm": None if done.grad_norm is None else float(done.grad_norm),
            "tokens": state.tokens_seen,
            "tokens_per_s": tps,
            "mfu": estimate_mfu(tps, self.flops_token, acc.num_processes, self.peak),
            "epoch": self.feed.epoch(done.step),
            **{f"tokens/{name}": n for name, n in state.source_tokens.items()},
            # a mixture of experts: the routers' load-balancing loss, mean over every micro-batch
            **({} if self.router is None else
               {"router_aux_loss": values[4] / (acc.num_processes * self.strategy.accumulation)}),
            **({} if self.objective is None else PreferenceLoss.means(values[5:-1], "rewards")),
        })
        bar.set_postfix(loss=f"{done.loss:.3f}", lr=f"{done.lr:.2e}", tok_s=f"{tps:,.0f}")
        window.reset()

    def save_on_cadence(self, done: Stepped, flags: list[float] | None, keep: bool = False) -> None:
        """A background save taken to its next step once no rank writes any more (`flags`: this step's values, or
        the previous step's); then this step's checkpoint, where one is due or the forgetting budget `keep`s it."""
        seen_at = done.step if done.values is not None else done.step - 1
        self.checkpoints.poll(done.step, seen_at, flags)
        if done.due.save or keep:
            self.save_checkpoint(background=self.cfg.checkpoint.async_save)

    def stop_at(self, done: Stepped, bar) -> None:
        """A stop signal some rank got, seen by every rank at this step: its checkpoint, then Stopped."""
        if self.unread is not None:  # the checkpoint counts this step's tokens only if it trained
            self.settle(*self.unread, verdict(done.totals.get()[2:4]), bar, unread=True)
        bar.close()
        step = self.state.step
        self.checkpoints.wait(step)
        folder = (self.save_checkpoint() if self.checkpoints.tried != step
                  else self.run.checkpoint(step) if self.checkpoints.step == step else None)
        newest = self.run.latest_checkpoint()
        saved = (f"checkpoint saved in {folder}; continue with resume=auto" if folder else
                 f"its checkpoint failed, {newest} is the newest; continue with resume=auto" if newest else
                 "its checkpoint failed and no other was saved: run the same command again to start over")
        raise Stopped(f"stopped by a signal at step {step}; {saved}")

    def settle(self, step: int, step_tokens: int, nonfinite: str | None, bar, unread: bool = False) -> None:
        """What a step's verdict decides: the tokens it trained on count, or its skip is logged and the run stops
        where the config says. `unread`: the verdict was left on the device, and the schedule stepped meanwhile."""
        if nonfinite is None:
            self.state.tokens_seen += step_tokens
            for name, tokens in self.feed.source_tokens(step - 1).items():
                self.state.source_tokens[name] = self.state.source_tokens.get(name, 0) + tokens
            self.nonfinite_in_a_row = 0
            return
        if unread and self.step_scheduler:
            wind_back(self.scheduler)
        self.skip_or_abort(nonfinite, bar, step)

    def skip_or_abort(self, found: str, bar, step: int) -> None:
        """A step whose loss or gradients were not finite on some rank was not applied (on any rank):
        log it, and stop the run where the config says so (Diverged, on every rank alike)."""
        t = self.cfg.train
        self.nonfinite_in_a_row += 1
        k = self.nonfinite_in_a_row
        abort = t.on_nonfinite == "abort" or k >= t.max_nonfinite_skips
        self.log("nonfinite", {"step": step, "nonfinite": found, "action": "abort" if abort else "skip", "in_a_row": k})
        what = "loss" if found == "loss" else "gradients"
        if not abort:
            self.print(
                f"step {step}: non-finite {what} (NaN or inf); batch skipped, weights and optimizer unchanged "
                f"({k} in a row; {t.max_nonfinite_skips} in a row stop the run)"
            )
            return
        bar.close()
        with contextlib.suppress(SaveStopped):  # (every rank aborts here) a save of good weights still written ends
            self.checkpoints.wait(step)         # first; one that fails is logged, and the divergence is the line
        why = "train.on_nonfinite=abort" if t.on_nonfinite == "abort" else (
            f"{k} steps in a row, train.max_nonfinite_skips={t.max_nonfinite_skips}"
        )
        passed = [c for c in self.run.complete_checkpoints() if TrainerState.passed(c)]
        then = f"resume from the last good checkpoint with resume={passed[-1]}" if passed else "start over"
        raise Diverged(
            f"non-finite {what} (NaN or inf) at step {step} ({why}); the run diverged and that step was not "
            f"applied: lower optim.lr or check the data of step {step}, then {then}"
        )

    def evaluate(self, phase: str) -> dict[str, float]:
        """Held-out loss and perplexity (collective); `phase` is before, train or after training."""
        cfg = self.cfg
        general = self.general if self.budget is not None else None  # the forgetting budget's, read from a path
        passes = sum(forwards(blocks, cfg.train.micro_batch_size, cfg.eval.blocks, self.strategy.data_ranks[0])
                     for blocks in (self.feed.val, general) if blocks is not None)

        def over(blocks, collate, bar, objective=None) -> dict[str, float]:
            return evaluate(self.accelerator, self.model, blocks, cfg.train.micro_batch_size, cfg.eval.blocks,
                            cfg.model.attn_implementation, collate, cfg.model.chunk_tokens, self.strategy.data_ranks,
                            self.strategy.split_sequences, self.strategy.pipeline, objective=objective, bar=bar)

        release_freed_memory(self.accelerator.device)  # a CPU run's peak was the training's heap kept under this
        with self.phases(EVALUATIONS[phase], total=passes) as bar:
            with model_kill_points(self.accelerator.unwrap_model(self.model), self.step, "eval"):
                result = over(self.feed.val, self.feed.collate, bar, self.objective)
            self.eval_step = self.state.eval_step = self.step
            self.log("eval", {"step": self.step, "phase": phase, **result})
            line = said(result)
            if self.budget is not None:
                general_loss = None if general is None else over(general, self.general_collate, bar)["eval_loss"]
                self.judged = self.budget.judge(self.step, phase, result, general_loss, self.state.tokens_seen)
                self.log("budget", self.judged.row)
                line += f"; {self.judged.line}"
        self.print(f"step {self.step} ({phase}): {line}")  # once its bar is gone
        return result

    def save_checkpoint(self, background: bool = False) -> Path | None:
        """Collective: this step's checkpoint (Checkpointer.save)."""
        with self.phases("checkpoints"):
            return self.checkpoints.save(self.state, background=background, skipped=self.nonfinite_in_a_row)

    # ---------------------------------------------------------------- the end
    def finish(self) -> None:
        """Collective: the last evaluation and checkpoint (so that resume=auto can always extend
        the run), then the replica check and every rank's peak memory."""
        if self.feed.val is not None and self.eval_step != self.step:
            self.state.last_eval = self.evaluate("after")
        if self.checkpoints.tried != self.step:  # a save of this step that failed is said once, not tried again
            self.save_checkpoint()
        if self.budget is not None and (kept := self.budget.selected(self.step)) is not None:
            self.keep_selected(kept)
        for line in self.budget.warnings(self.step) if self.budget is not None else []:
            self.print(line)
        digests = self.strategy.check_replicas_in_sync(self.model)
        memory = gather_object([peak_memory_mb(self.strategy.device)])
        if self.metrics is None or not self.metrics.has(self.step, "parameter_digests"):  # a finished run re-run
            self.log("summary", {"step": self.step, "parameter_digests": digests, "peak_memory": memory})

    def keep_selected(self, kept: int) -> None:
        """Collective: the weights of step `kept`, the forgetting budget's best, in place of the last step's."""
        folder = self.checkpoints.restore(kept, self.resume_from)
        if folder is None:
            self.print(f"warning: forgetting.select keeps step {kept}, and its checkpoint is gone (deleted by hand?); "
                       f"the result is the last step's, {self.step}")
            self.budget.state["gone"] = True
            return
        self.state.last_eval = {k: v for k, v in self.budget.state["best_eval"].items()
                                if k not in ("domain_loss", "general_loss")}
        self.print(f"forgetting.select: the result is step {kept}'s ({folder}), the best domain loss within the "
                   f"budget; the last step's checkpoint is step {self.step}'s")

    def facts(self, model_type: str) -> dict:
        """What every model card says about the run."""
        # a forgetting budget's kept step: its weights are the result
        step, tokens = self.budget.result(self.step, self.state.tokens_seen) if self.budget else (self.step, None)
        return {
            "recipe": self.name, "model_type": model_type, "params": self.n_params, "step": step,
            "tokens": self.state.tokens_seen if tokens is None else tokens, "strategy": self.strategy.layout.name,
            **self.state.last_eval, **({"trained_steps": self.step} if step != self.step else {}),
        }

    def close(self) -> Path | None:
        """Flush the trackers, close metrics.jsonl (its last row: each phase's cost); the main process plots the loss."""
        if self.metrics is not None and not self.metrics.has(self.step, "seconds", kind="phases"):  # a finished run re-run
            self.log("phases", {"step": self.step, **self.phases.row()}, tracked={})
        self.trackers.close()
        self.run.release()  # after the deliverable: the recipe wrote it before calling close
        if self.metrics is None:
            return None
        self.metrics.close()
        self.metrics = None
        return plot_loss(self.run.metrics, self.run.loss_plot, self.print)

    def log(self, kind: str, record: dict, at: int | None = None, tracked: dict | None = None) -> None:
        """A row of metrics.jsonl of `kind` (toolkit.training.metrics.KINDS: the columns each kind has), and its
        numbers (or `tracked`'s) to the trackers at its step, or `at` (a row that arrives after later steps' rows:
        wandb drops a step that goes back)."""
        if self.metrics is not None:
            self.metrics.write({"kind": check_kind(kind, record), **record})
        if tracked is None:
            tracked = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
        if tracked:
            self.trackers.log(tracked, record["step"] if at is None else at)

