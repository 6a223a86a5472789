"""Pretrain a LLaMA/GPT-style causal LM from scratch with Accelerate.

    accelerate launch --config_file accelerate_configs/ddp.yaml recipes/pretrain.py \\
        --config recipes/configs/pretrain_tiny.yaml train.max_steps=200 output_dir=runs/tiny

Features
- Any transformers `model_type` (llama, gpt2, qwen2, mistral, ...) with sizes from the YAML.
- Corpus from files, a folder, a glob or a hub id; the CPython docs when none is given.
- A byte-level BPE trained on the corpus when no tokenizer is given.
- Packed blocks in which attention never crosses a document boundary.
- Loss normalised by target tokens over the whole global batch (accumulation- and rank-exact).
- Checkpoints every N steps (keep the last K), `resume=auto` or `resume=PATH`.
- metrics.jsonl, tensorboard, held-out perplexity, a loss-curve PNG, and final/ in HF format.

Errors (one line, exit code 2): unknown/misspelled or mistyped config keys, missing data path,
empty corpus, seq_len over the model's max positions, batch sizes that do not divide, an
output_dir that holds another run or files that are not a run, resume=auto on a run with no
complete checkpoint, an incomplete checkpoint, an attention kind that cannot keep packed
documents apart. Ranks that fall out of step (a collective waits past
train.collective_timeout_s): one line per rank, exit code 4.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import datasets
import torch
from accelerate.utils import gather_object
from tqdm.auto import tqdm

from toolkit.training import checkpoint as ckpt
from toolkit.data.batching import BatchSchedule
from toolkit.config import to_dict
from toolkit.data.corpus import load_corpus, split_documents
from toolkit.strategy.distributed import (
    build_accelerator,
    check_fsdp_layers,
    check_replicas_in_sync,
    configure_deepspeed,
    describe,
    exit_process,
    outside_training,
    strategy_name,
)
from toolkit.training.entry import flat_hparams, run
from toolkit.training.evaluation import evaluate
from toolkit.models.gradient_checkpointing import apply_gradient_checkpointing
from toolkit.export.hf_folder import save_final_model, write_model_files
from toolkit.training.loss import backward_scale
from toolkit.training.metrics import (
    MetricsWriter,
    check_trackers,
    estimate_mfu,
    flops_per_token,
    peak_flops,
    peak_memory_mb,
    plot_loss,
)
from toolkit.models.scratch import build_model, check_seq_len, count_parameters, hf_config, meta_model
from toolkit.training.optim import prepare_optimization
from toolkit.data.packing import check_attention, collate, column, packed_dataset, target_counts
from toolkit.training.recipe_config import PretrainConfig
from toolkit.training.samples import sample_folder
from toolkit.strategy.sharding import GradientMeter, held_bytes
from toolkit.training.step import optimizer_step
from toolkit.data.tokenizer import get_tokenizer


class PretrainRecipe:
    def __init__(self, cfg: PretrainConfig):
        self.cfg = cfg
        self.out = Path(cfg.output_dir)
        self.step = 0
        self.tokens_seen = 0
        self.last_eval: dict[str, float] = {}
        self.eval_step = self.checkpoint_step = -1
        self.measured = False
        self.stop = ckpt.StopRequest()

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        cfg = self.cfg
        check_attention(cfg.model.attn_implementation)
        check_seq_len(cfg.model, cfg.data.seq_len)
        check_trackers(cfg.logging.trackers)
        ckpt.check_output_dir(self.out, cfg.resume, cfg.overwrite)
        resume_from = ckpt.resolve_resume(cfg.resume, self.out)

        # Distributed: strategy, world size and backend come from the accelerate config file.
        world = int(os.environ.get("WORLD_SIZE", "1"))
        self.accum = cfg.train.accumulation_steps(world)
        self.accelerator = acc = build_accelerator(
            cfg.train.mixed_precision, self.accum, str(self.out), cfg.logging.trackers,
            cfg.train.collective_timeout_s,
        )
        if cfg.overwrite and acc.is_main_process:
            ckpt.remove_run(self.out)  # only its own entries: check_output_dir refused anything else
        acc.wait_for_everyone()
        self.out.mkdir(parents=True, exist_ok=True)
        acc.print(f"[pretrain] {describe(acc)}")
        # Strategy settings that contradict the recipe fail now, before any data work.
        check_fsdp_layers(acc, lambda: meta_model(cfg.model))
        ds_owned = configure_deepspeed(acc, cfg.train.micro_batch_size, cfg.optim.max_grad_norm)
        if not acc.is_main_process:
            datasets.disable_progress_bars()

        # Data: the main process tokenizes and packs into the cache; the others then read it.
        cache = cfg.data.resolved_cache_dir()
        with acc.main_process_first():
            corpus, source = load_corpus(cfg.data)
            train_docs, val_docs = split_documents(corpus, cfg.data.val_fraction, cfg.seed)
            cache.mkdir(parents=True, exist_ok=True)
            tok_key = f"{source}-v{cfg.tokenizer.vocab_size}-f{cfg.tokenizer.min_frequency}"
            self.tokenizer = get_tokenizer(cfg.tokenizer, train_docs, cache / f"tokenizer-{tok_key}")
            split_key = f"{source}-seed{cfg.seed}-val{cfg.data.val_fraction}"
            self.train_blocks = packed_dataset(
                train_docs, self.tokenizer, cfg.data.seq_len, cache, f"{split_key}-train", cfg.data.num_proc
            )
            self.val_blocks = None
            if val_docs is not None:
                self.val_blocks = packed_dataset(
                    val_docs, self.tokenizer, cfg.data.seq_len, cache, f"{split_key}-val", cfg.data.num_proc
                )
        self.train_blocks = self.train_blocks.with_format("numpy")
        self.block_targets = target_counts(self.train_blocks)
        self.block_tokens = column(self.train_blocks, "num_tokens").astype("int64")
        self.schedule = BatchSchedule(
            len(self.train_blocks), cfg.train.global_batch_size, cfg.train.micro_batch_size,
            acc.num_processes, acc.process_index, cfg.seed,
        )
        acc.print(
            f"[pretrain] data: {len(train_docs)} train / {len(val_docs or [])} held-out documents -> "
            f"{len(self.train_blocks)} blocks of {cfg.data.seq_len} tokens "
            f"({self.schedule.steps_per_epoch} steps per epoch); vocab {len(self.tokenizer)}"
        )

        # Model: random init from the config, seeded identically on every rank.
        config = hf_config(cfg.model, len(self.tokenizer), self.tokenizer.eos_token_id, self.tokenizer.pad_token_id)
        with outside_training(acc):
            model = build_model(cfg.model, config, cfg.seed)
        apply_gradient_checkpointing(model, cfg.model.gradient_checkpointing, cfg.model.gradient_checkpointing_k)
        self.n_params = count_parameters(model)
        self.flops_token = flops_per_token(
            count_parameters(model, exclude_embeddings=True), config.num_hidden_layers, config.hidden_size,
            cfg.data.seq_len,
        )
        acc.print(
            f"[pretrain] model: {cfg.model.model_type}, {self.n_params:,} parameters, "
            f"gradient checkpointing {cfg.model.gradient_checkpointing}"
        )

        # Optimizer and schedule: the recipe's AdamW + warmup/decay, unless a user's DeepSpeed JSON
        # defines its own. Ours is stepped once per optimizer step by us (Accelerate would step it
        # once per process) and saved through register_for_checkpointing.
        if ds_owned:
            acc.print(f"[pretrain] the DeepSpeed config defines {' and '.join(ds_owned)}: using them instead of the recipe's optim section")
        self.model, self.optimizer, self.scheduler, self.step_scheduler = prepare_optimization(
            acc, model, cfg.optim, cfg.train.max_steps, ds_owned
        )

        if resume_from is not None:
            state = ckpt.load_checkpoint(acc, resume_from)
            self.step, self.tokens_seen = state["step"], state["tokens_seen"]
            self.last_eval = state.get("last_eval", {})
            self.checkpoint_step = self.step
            acc.print(f"[pretrain] resumed from {resume_from} at step {self.step}")

        self.metrics = MetricsWriter(self.out / "metrics.jsonl", self.step) if acc.is_main_process else None
        if cfg.logging.trackers:
            acc.init_trackers("tensorboard", config=flat_hparams(to_dict(cfg)))
        self.peak = peak_flops(acc.device)

    # ------------------------------------------------------------------ train
    def train(self) -> None:
        cfg, acc = self.cfg, self.accelerator
        bar = tqdm(total=cfg.train.max_steps, initial=self.step, disable=not acc.is_main_process, desc="pretrain")
        window_tokens, window_time = 0, 0.0
        while self.step < cfg.train.max_steps:
            t0 = time.perf_counter()
            lr = self.optimizer.param_groups[0]["lr"]  # the rate this step trains with
            global_idx = self.schedule.global_indices(self.step)
            global_targets = int(self.block_targets[global_idx].sum())
            scale = backward_scale(global_targets, acc.num_processes, self.accum)
            batches = (
                collate(self.train_blocks[micro], cfg.model.attn_implementation)
                for micro in self.schedule.micro_batches(self.step)
            )
            # Once per run, measure the bytes each rank really holds (sharding made visible).
            meter = GradientMeter(acc, self.model, self.optimizer) if not self.measured else None
            with meter or contextlib.nullcontext():
                loss_sum, grad_norm = optimizer_step(acc, self.model, self.optimizer, batches, scale, cfg.optim.max_grad_norm)
            if self.step_scheduler:
                self.scheduler.step()
            self.step += 1
            step_tokens = int(self.block_tokens[global_idx].sum())
            self.tokens_seen += step_tokens
            # One all-reduce for the global loss and for "did any rank get a stop signal".
            stop_flag = torch.tensor(float(self.stop.requested), dtype=torch.float64, device=acc.device)
            totals = acc.reduce(torch.stack([loss_sum, stop_flag]), reduction="sum")
            loss = totals[0].item() / max(1, global_targets)
            window_tokens += step_tokens
            window_time += time.perf_counter() - t0
            if meter is not None:
                self.measured = True
                held = gather_object([held_bytes(acc, self.model, self.optimizer, meter)])
                self._log({"step": self.step, "held_bytes": held})

            if self.step % cfg.logging.every == 0 or self.step == cfg.train.max_steps:
                tps = window_tokens / max(window_time, 1e-9)
                record = {
                    "step": self.step,
                    "loss": loss,
                    "lr": lr,
                    "grad_norm": None if grad_norm is None else float(grad_norm),
                    "tokens": self.tokens_seen,
                    "tokens_per_s": tps,
                    "mfu": estimate_mfu(tps, self.flops_token, acc.num_processes, self.peak),
                    "epoch": self.schedule.epoch(self.step),
                }
                self._log(record)
                bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tps:,.0f}")
                window_tokens, window_time = 0, 0.0
            bar.update(1)

            # The final evaluation runs here, before the last checkpoint: under FSDP2 an evaluation
            # forward after save_state, with no training step between, leaves the root's
            # parameters unsharded in storage that cannot be freed, and gathering the final
            # model then fails ("Trying to resize storage that is not resizable").
            last = self.step == cfg.train.max_steps
            if self.val_blocks is not None and (last or cfg.logging.eval_every and self.step % cfg.logging.eval_every == 0):
                self.evaluate()
            if cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0:
                self.save_checkpoint()
            if totals[1].item() > 0:
                bar.close()
                if self.checkpoint_step != self.step:
                    self.save_checkpoint()
                raise ckpt.Stopped(
                    f"stopped by a signal at step {self.step}; checkpoint saved in "
                    f"{self.out / 'checkpoints' / f'step-{self.step}'}; continue with resume=auto"
                )
        bar.close()

    def evaluate(self) -> None:
        cfg = self.cfg
        self.last_eval = evaluate(
            self.accelerator, self.model, self.val_blocks, cfg.train.micro_batch_size,
            cfg.logging.eval_blocks, cfg.model.attn_implementation,
        )
        self.eval_step = self.step
        self._log({"step": self.step, **self.last_eval})
        self.accelerator.print(
            f"[pretrain] step {self.step}: held-out loss {self.last_eval['eval_loss']:.4f}, "
            f"perplexity {self.last_eval['eval_ppl']:.2f}"
        )

    def save_checkpoint(self) -> None:
        state = {"step": self.step, "tokens_seen": self.tokens_seen, "last_eval": self.last_eval, "seed": self.cfg.seed}
        self.checkpoint_step = self.step
        unwrapped = self.accelerator.unwrap_model(self.model)
        folder = ckpt.save_checkpoint(
            self.accelerator, self.out, state, self.cfg.checkpoint.keep_last,
            lambda d: write_model_files(unwrapped, self.tokenizer, d),
        )
        self.accelerator.print(f"[pretrain] checkpoint saved: {folder}")

    # ---------------------------------------------------------------- cleanup
    def cleanup(self) -> None:
        cfg, acc = self.cfg, self.accelerator
        if self.val_blocks is not None and self.eval_step != self.step:
            self.evaluate()
        if self.checkpoint_step != self.step:
            self.save_checkpoint()  # so the run can always be extended with resume=auto
        digests = check_replicas_in_sync(acc, self.model)
        memory = gather_object([peak_memory_mb(acc.device)])
        self._log({"step": self.step, "parameter_digests": digests, "peak_memory": memory})

        facts = {
            "recipe": "pretrain", "model_type": cfg.model.model_type, "params": self.n_params,
            "step": self.step, "tokens": self.tokens_seen, "strategy": strategy_name(acc), **self.last_eval,
        }
        final = save_final_model(
            acc, self.model, self.tokenizer, self.out / "final", facts, to_dict(cfg), cfg.checkpoint.final_dtype
        )
        acc.end_training()
        if not acc.is_main_process:
            return
        self.metrics.close()
        plot = plot_loss(self.out / "metrics.jsonl", self.out / "loss.png")
        print(f"\nfinal model : {final}")
        print(f"metrics     : {self.out / 'metrics.jsonl'}")
        print(f"loss plot   : {plot}")
        if cfg.logging.trackers:
            print(f"tensorboard : tensorboard --logdir {self.out / 'tensorboard'}")
        if cfg.sample.max_new_tokens:
            with outside_training(acc):  # a fresh load, not one partitioned by ZeRO-3's leftover config
                text = sample_folder(final, cfg.sample.prompt, cfg.sample.max_new_tokens, cfg.seed)
            print(f"sample      : {text!r}")

    def _log(self, record: dict) -> None:
        if self.metrics is not None:
            self.metrics.write(record)
        scalars = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
        if self.cfg.logging.trackers:
            self.accelerator.log(scalars, step=record["step"])


def main(argv: list[str] | None = None) -> int:
    return run("pretrain", PretrainConfig, PretrainRecipe, argv)


if __name__ == "__main__":
    exit_process(main())
