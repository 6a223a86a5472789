"""The shared loop built in this process as a recipe builds it, for test_trainer.py and
test_nonfinite.py: a tiny LLaMA on packed CPython-docs blocks, one process, fp32."""

from __future__ import annotations

from pathlib import Path

import datasets
from accelerate.state import AcceleratorState

from toolkit.config.load import load_config
from toolkit.data.packing import collate, packed_dataset, target_counts
from toolkit.training.assembly import assemble
from toolkit.training.recipe_config import PretrainConfig
from toolkit.training.trainer import Trainer

SEQ_LEN = 64
SETTINGS = [
    f"data.seq_len={SEQ_LEN}", "train.global_batch_size=4", "train.micro_batch_size=2", "train.mixed_precision=no",
    "optim.warmup_steps=1", "logging.every=1", "logging.trackers=[]", "eval.blocks=4",
]


def packed_blocks(texts: list[str], tokenizer, cache: Path, held_out: bool):
    """(train blocks from 12 documents, held-out blocks from 2 more or None)."""
    def pack(docs, split):
        return packed_dataset(datasets.Dataset.from_dict({"text": docs}), tokenizer, SEQ_LEN, cache, split)

    return pack(texts[:12], "train"), pack(texts[12:14], "val") if held_out else None


def start_trainer(out, blocks, tokenizer, tiny_model, *overrides) -> Trainer:
    """A fresh Trainer, as a new launch builds one (a test may start several in turn)."""
    AcceleratorState._reset_state(True)
    cfg = load_config(PretrainConfig, None, [*SETTINGS, f"output_dir={out}", *overrides])
    trainer = Trainer("unit", cfg)
    trainer.use_data(*blocks, collate, target_counts)
    assemble(trainer, tiny_model("llama", seed=0, tokenizer=tokenizer), tokenizer)  # as recipes/pretrain.py does
    return trainer
