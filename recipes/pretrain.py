"""Pretrain a LLaMA/GPT-style causal LM from scratch with Accelerate.

    accelerate launch --config_file accelerate_configs/ddp.yaml recipes/pretrain.py \\
        --config recipes/configs/pretrain_tiny.yaml train.max_steps=200 output_dir=runs/tiny

Features
- Any transformers `model_type` (llama, gpt2, qwen2, mistral, ...) with sizes from the YAML.
- Corpus from files, a folder, a glob or a hub id; the CPython docs when none is given.
- A byte-level BPE trained on the corpus when no tokenizer is given.
- Packed blocks in which attention never crosses a document boundary.
- data.streaming=true: blocks packed as the steps take them, with nothing prepared ahead.
- Loss normalised by target tokens over the whole global batch (accumulation- and rank-exact).
- Checkpoints every N steps (keep the last K), `resume=auto` or `resume=PATH`.
- metrics.jsonl, tensorboard, held-out perplexity, a loss-curve PNG, and final/ in HF format.
- A bar for each pass that can take minutes (each evaluation, the samples), and the summary's last
  line says what each phase cost (toolkit.training.phases).

The loop, checkpoints, resume and metrics are toolkit.training.trainer's, shared with the
fine-tuning recipe; this file builds the tokenizer, the packed corpus and a fresh model.

Errors (one line, exit code 2; docs/faults.md lists them with their tests): unknown/misspelled or
mistyped config keys, a model_type with no causal LM, missing or unreadable data path, empty
corpus, data that is not UTF-8 text, a text column that is not strings, a hub id while offline,
seq_len over the model's max positions, batch sizes that
do not divide, an output_dir that cannot be created or written, or that holds another run or
files that are not a run, resume=auto on a run with no complete checkpoint, an incomplete
checkpoint, a checkpoint of another model shape, an attention kind that cannot keep packed
documents apart. Ranks that fall out of step (a collective waits past
train.collective_timeout_s): one line per rank, exit code 4.
"""

from __future__ import annotations

import contextlib
import hashlib
import sys

import datasets

from toolkit.config.errors import UserError
from toolkit.config.load import to_dict
from toolkit.data.corpus import EMBEDDED, load_corpus, split_documents, stream_corpus
from toolkit.data.mixture import naming, stages_said, weight_plan
from toolkit.data.packing import Seen, collate, column, packed_dataset, packed_splits, target_counts
from toolkit.data.streaming import MixedStreams, StreamingBlocks, held_out_documents
from toolkit.data.tokenizer import STREAM_DOCUMENTS, get_tokenizer
from toolkit.export.hf_folder import save_final_model
from toolkit.launch.verdict import exit_process
from toolkit.models.adapter import leave_out_bitsandbytes
from toolkit.models.scratch import build_model, check_seq_len, describe_sizes, hf_config, meta_model
from toolkit.planner.estimate import check_fits
from toolkit.training.assembly import assemble
from toolkit.training.entry import run
from toolkit.training.preview import column_of, show
from toolkit.training.recipe_config import PretrainConfig
from toolkit.training.sample_prompts import prompts_line
from toolkit.training.samples import check_prompt_lengths, sample_folder
from toolkit.training.trainer import Trainer


class PretrainRecipe:
    def __init__(self, cfg: PretrainConfig):
        self.cfg = cfg
        self.first = contextlib.nullcontext  # the main process first, once setup has launched (a preview: alone)

    def setup(self) -> None:
        cfg = self.cfg
        leave_out_bitsandbytes()
        check_seq_len(cfg.model, cfg.data.seq_len)
        self.trainer = trainer = Trainer("pretrain", cfg)
        strategy = trainer.strategy
        self.first = strategy.accelerator.main_process_first
        # An FSDP config naming a layer class this architecture lacks fails now, before any data work.
        strategy.check_fsdp_layers(lambda: meta_model(cfg.model))
        # A model whose weights, gradients and optimizer state alone exceed the machine is refused before
        # any data work: built, it is the kernel's OOM killer that stops it (a 6.7B default after 148 s).
        sized = meta_model(cfg.model, cfg.tokenizer.vocab_size)
        check_fits(sized, strategy, describe_sizes(cfg.model, sized.config))

        # Data: the main process reads the corpus and trains the tokenizer into the cache; the
        # others then read them. Every rank then tokenizes and packs its share of the documents.
        data_notes: list[str] = []
        with trainer.phases("data"):
            if cfg.data.streaming:
                self.stream_data(data_notes)
            elif cfg.data.sources:
                self.mixture_data(data_notes)
            else:
                train, val, (train_docs, val_docs) = self.corpus_blocks(data_notes, Seen())
                schedule = trainer.use_data(train, val, collate, target_counts)
                trainer.print(
                    f"data: {len(train_docs)} train / {len(val_docs or [])} held-out documents -> "
                    f"{len(train)} blocks of {cfg.data.seq_len} tokens "
                    f"({schedule.steps_per_epoch} steps per epoch); vocab {len(self.tokenizer)}"
                )
        for line in data_notes:
            trainer.print(f"data: {line}")
        check_prompt_lengths(self.tokenizer, cfg.samples, cfg.model.positions())  # not a crash after training
        if (line := prompts_line(cfg)) is not None:  # the shipped config's prompts kept on the user's own data
            trainer.print(line)

        # Model: random init from the config, seeded identically on every rank.
        config = hf_config(cfg.model, len(self.tokenizer), self.tokenizer.eos_token_id, self.tokenizer.pad_token_id)
        with strategy.outside_training(), trainer.phases("model build"):
            model = build_model(cfg.model, config, cfg.seed)
        with trainer.phases("model setup"):
            assemble(trainer, model, self.tokenizer)

    def corpus_blocks(self, notes: list[str], seen: Seen) -> tuple:
        """(train blocks, held-out blocks or None, (train documents, held-out documents or None)) of data.path, and the
        tokenizer; `seen` is told what they were made of (--preview)."""
        cfg = self.cfg
        with self.first():  # the main process reads the corpus and trains the tokenizer into the cache
            corpus, source = load_corpus(cfg.data, notes, seen.dropped)
            train_docs, val_docs = split_documents(corpus, cfg.data.val_fraction, cfg.seed)
            self.tokenizer = self.tokenizer_of(train_docs, source)
        seen.text_split(corpus, train_docs, len(val_docs or []))
        train, val = packed_splits(train_docs, val_docs, self.tokenizer, cfg.data, source, cfg.seed)
        return train, val, (train_docs, val_docs)

    def preview(self, n: int) -> None:
        """--preview N: the training blocks built as setup builds them (the tokenizer trained into the cache where none
        is given), N of them shown with their loss marked, and one table of what they were made of
        (toolkit.training.preview); no model is built, no run folder is made."""
        cfg = self.cfg
        check_seq_len(cfg.model, cfg.data.seq_len)
        if cfg.data.streaming:
            raise UserError("--preview shows blocks packed ahead, and data.streaming=true packs them while training; "
                            "preview with data.streaming=false (the same documents, packed into data.cache_dir)")
        notes: list[str] = []
        if cfg.data.sources:
            seen: list[Seen] = []
            train, _, _ = self.mixture_blocks(notes, seen)
            named = [(s.name, train[s.name], one) for s, one in zip(cfg.data.sources, seen, strict=True)]
        else:
            one = Seen()
            named = [("", self.corpus_blocks(notes, one)[0], one)]
        for line in notes:
            print(f"data: {line}")
        print()
        show([(name, blocks, collate) for name, blocks, _ in named],
             [column_of(name or "text data", one, blocks, collate, self.tokenizer, "none (text data)", cfg.data.seq_len)
              for name, blocks, one in named], n, self.tokenizer, sys.stdout.isatty())

    def tokenizer_of(self, train_docs, source: str):
        """tokenizer.path, or a BPE trained on `train_docs` once into the cache."""
        cfg = self.cfg
        folder = cfg.data.resolved_cache_dir() / f"tokenizer-{source}-{cfg.tokenizer.key()}"
        return get_tokenizer(cfg.tokenizer, train_docs, folder)

    def mixture_blocks(self, notes: list[str], seen: list[Seen]) -> tuple[dict, dict, list]:
        """data.sources: each source read, split and packed on its own; one tokenizer trained on them all. (train blocks
        by source, held-out blocks by source, each source's (train, held-out) documents); `seen`: what each was made
        of (--preview)."""
        cfg, sources = self.cfg, self.cfg.data.sources
        loaded, splits = [], []
        with self.first():
            for i, one in enumerate(cfg.data.of_sources()):
                seen.append(Seen())
                with naming(i, sources):
                    loaded.append(load_corpus(one, notes, seen[-1].dropped))
                    splits.append(split_documents(loaded[-1][0], cfg.data.val_fraction, cfg.seed))
                seen[-1].read = len(loaded[-1][0]) + sum(seen[-1].dropped.values())
                seen[-1].held_out, seen[-1].documents = len(splits[-1][1] or []), splits[-1][0]
            mixed = hashlib.sha256("+".join(fingerprint for _, fingerprint in loaded).encode()).hexdigest()[:16]
            self.tokenizer = self.tokenizer_of(datasets.concatenate_datasets([t for t, _ in splits]), f"mixture-{mixed}")
        train, val = {}, {}
        for i, (source, (_, fingerprint), (train_docs, val_docs)) in enumerate(zip(sources, loaded, splits, strict=True)):
            with naming(i, sources):
                train[source.name], held = packed_splits(train_docs, val_docs, self.tokenizer, cfg.data, fingerprint,
                                                         cfg.seed)
            if held is not None:
                val[source.name] = held
        return train, val, splits

    def mixture_data(self, notes: list[str]) -> None:
        """data.sources: the sources' blocks (mixture_blocks), every step's drawn from them by weight
        (toolkit.data.mixture)."""
        cfg, trainer = self.cfg, self.trainer
        sources = cfg.data.sources
        train, val, splits = self.mixture_blocks(notes, [])
        plan = weight_plan(sources, cfg.data.stages)
        schedule = trainer.use_mixture(train, val, plan, collate, target_counts)
        passes = schedule.passes(cfg.train.max_steps)
        for i, (source, (train_docs, val_docs)) in enumerate(zip(sources, splits, strict=True)):
            blocks = train[source.name]
            trainer.print(
                f"data: {source.name}: weight {plan[0][1][i]:.3f}, {len(train_docs)} train / {len(val_docs or [])} "
                f"held-out documents -> {len(blocks)} blocks of {cfg.data.seq_len} tokens "
                f"({int(column(blocks, 'num_tokens').sum()):,} tokens); {passes[i]:.2f} passes over them in "
                f"train.max_steps={cfg.train.max_steps}"
            )
        for line in stages_said([s.name for s in sources], plan[1:], cfg.train.max_steps):
            trainer.print(f"data: {line}")
        trainer.print(f"data: vocab {len(self.tokenizer)}")

    def stream_data(self, notes: list[str]) -> None:
        """data.streaming: the held-out documents are the stream's first ones; each data rank then packs
        its part of the rest as the steps take it (of each source's stream by weight, for a mixture). A
        tokenizer to train sees the next documents."""
        cfg, trainer = self.cfg, self.trainer
        names = [s.name for s in cfg.data.sources] or [""]
        n_val = cfg.data.stream_val_documents if cfg.data.val_fraction else 0
        n_tok = 0 if cfg.tokenizer.path else cfg.tokenizer.train_documents or STREAM_DOCUMENTS
        opened = []
        with trainer.strategy.accelerator.main_process_first():
            for i, (name, data) in enumerate(zip(names, cfg.data.of_sources(), strict=True)):
                with naming(i, cfg.data.sources):
                    stream, source = stream_corpus(data, notes)
                    column = data.text_column if data.path else "text"
                    first = held_out_documents(stream, n_val + n_tok, column)
                if n_val and len(first) <= n_val:
                    of = f" of source {name}" if name else ""
                    raise UserError(
                        f"data.stream_val_documents={n_val} holds out the whole stream{of} ({len(first)} documents) and "
                        f"leaves none to train on; lower it (e.g. {max(1, len(first) // 20)}) or set data.val_fraction=0"
                    )
                opened.append((data, stream, source, column, first))
            learn_from = datasets.Dataset.from_dict({"text": [t for *_, first in opened for t in first[n_val:]]})
            key = "+".join(source for _, _, source, _, _ in opened)
            self.tokenizer = self.tokenizer_of(learn_from, f"{key}-after-{n_val}")
        world, rank = trainer.strategy.data_ranks
        streams, val = [], {}
        held_out = [t for *_, first in opened for t in first[:n_val]]  # skipped by every source's stream
        for name, (data, stream, source, column, first) in zip(names, opened, strict=True):
            if n_val:
                val[name] = packed_dataset(datasets.Dataset.from_dict({"text": first[:n_val]}), self.tokenizer,
                                           cfg.data.seq_len, cfg.data.resolved_cache_dir(), f"{source}-held-out-{n_val}",
                                           cfg.data.num_proc)
            streams.append(StreamingBlocks(stream, self.tokenizer, cfg.data.seq_len, (world, rank), held_out, column,
                                           data.path or EMBEDDED, name))
        if cfg.data.sources:
            plan = weight_plan(cfg.data.sources, cfg.data.stages)
            trainer.use_stream(MixedStreams(streams, plan, cfg.seed), val, collate)
            mixed = ", ".join(f"{n} {w:.3f}" for n, w in zip(names, plan[0][1], strict=True))
            what, stages = f"each source's stream by weight ({mixed})", plan[1:]
        else:
            trainer.use_stream(streams[0], val.get(""), collate)
            what, stages = "the stream", []
        tokenizer = "" if cfg.tokenizer.path else f"; the tokenizer trained on the next {len(learn_from)} documents"
        trainer.print(
            f"data: streaming: {world} data rank(s) each pack their part of {what} as the steps take it; "
            f"{n_val * len(opened) if n_val else 0} held-out documents (the stream's first) -> "
            f"{sum(len(v) for v in val.values())} blocks{tokenizer}; vocab {len(self.tokenizer)}"
        )
        for line in stages_said(names, stages, cfg.train.max_steps):
            trainer.print(f"data: {line}")

    def train(self) -> None:
        self.trainer.fit()

    def cleanup(self) -> None:
        cfg, trainer = self.cfg, self.trainer
        trainer.finish()
        facts = trainer.facts(cfg.model.model_type)
        with trainer.phases("final save"):
            final = save_final_model(
                trainer.strategy, trainer.model, self.tokenizer, trainer.run.final, facts, to_dict(cfg),
                cfg.checkpoint.final_dtype,
            )
        scored = trainer.metrics is not None and trainer.metrics.has(trainer.step, "phase", kind="harness")
        if trainer.harness is not None and trainer.strategy.is_main and final is not None and not scored:
            trainer.stop.all_saved()  # a signal from here skips the scoring, and ends it
            with trainer.phases("harness"):
                trainer.harness.start(trainer.step, "after", final, keep=True)  # final/ itself, before metrics.jsonl closes
                trainer.harness.wait()
        plot = trainer.close()
        if not trainer.strategy.is_main:
            return
        print(f"\nfinal model : {final}")
        print(f"metrics     : {trainer.run.metrics}")
        print(f"loss plot   : {plot or 'not written (said above); metrics.jsonl holds its numbers'}")
        if "tensorboard" in cfg.logging.trackers:
            print(f"tensorboard : tensorboard --logdir {trainer.run.tensorboard}")
        trainer.stop.all_saved()  # a signal from here on skips the samples: nothing is left to save
        prompts = cfg.samples.prompts
        if cfg.samples.max_new_tokens and prompts:
            texts = []
            # a fresh load, not one partitioned by ZeRO-3's leftover config
            with trainer.strategy.outside_training(), trainer.phases("samples after", total=len(prompts)) as bar:
                for prompt in prompts:
                    texts.append(sample_folder(final, prompt, cfg.samples.max_new_tokens, cfg.seed))
                    bar.update()
            for text in texts:  # once the bar is gone
                print(f"sample      : {text!r}")
        print(trainer.phases.said())  # last: the samples are among them


def main(argv: list[str] | None = None) -> int:
    return run("pretrain", PretrainConfig, PretrainRecipe, argv)


if __name__ == "__main__":
    exit_process(main())
