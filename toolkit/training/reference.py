"""DPO's reference: each target's log-probability under the model before training, computed once.

One forward pass over the training and held-out pairs before the first step, through the model as
the strategy prepared it (sharded under FSDP and ZeRO-3), with a LoRA adapter switched off (the
base) or, for a full fine-tune, before any weight has changed: no second model is held. The values
become the blocks' `ref_logps` column and are kept in the run folder with a fingerprint of the
blocks and the base, so that a resumed run reads them back: a full fine-tune could not compute them
again.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
from pathlib import Path

import datasets
import numpy as np
import torch

from toolkit.config.errors import UserError
from toolkit.data.preference import collate_pairs
from toolkit.models.base_model import BaseModelConfig
from toolkit.models.gguf_base import resolve_gguf
from toolkit.models.preference_loss import token_logps
from toolkit.run.folder import RunDir
from toolkit.run.writes import writing
from toolkit.training.evaluation import forwards
from toolkit.training.step import on_device


@torch.no_grad()
def reference_logps(accelerator, model, blocks: datasets.Dataset, micro_batch: int, attn: str,
                    bar=None) -> np.ndarray:
    """Collective: the model's log-probability of each position's target in every block (blocks x seq_len, float32).

    The blocks are split across ranks, every rank running the same number of forwards (a sharded model
    gathers its weights inside them), and the results gathered so that every rank holds all of them. `bar`
    (toolkit.training.phases) is updated after each micro-batch."""
    n, world, rank = len(blocks), accelerator.num_processes, accelerator.process_index
    seq_len = len(blocks[0]["input_ids"])
    per_rank = math.ceil(n / world)
    mine = list(range(rank, n, world))
    out = torch.zeros(per_rank, seq_len, dtype=torch.float32, device=accelerator.device)
    unwrapped = accelerator.unwrap_model(model)
    was_training = model.training
    model.eval()
    with unwrapped.disable_adapter() if hasattr(unwrapped, "disable_adapter") else contextlib.nullcontext():
        for start in range(0, per_rank, micro_batch):
            rows = min(micro_batch, per_rank - start)
            idx = mine[start:start + rows]
            idx = idx + [0] * (rows - len(idx))  # a rank short of blocks repeats one and drops it below
            batch = on_device(collate_pairs(blocks[idx], attn), accelerator.device)
            with accelerator.autocast():
                out[start:start + rows] = token_logps(model, batch).float().reshape(rows, seq_len)
            if bar is not None:
                bar.update()
    model.train(was_training)
    gathered = accelerator.gather(out).cpu().numpy()
    result = np.zeros((n, seq_len), dtype=np.float32)
    for r in range(world):
        count = len(range(r, n, world))
        result[r::world] = gathered[r * per_rank:r * per_rank + count]
    return result


def base_identity(cfg: BaseModelConfig) -> str:
    """The base model as the reference depends on it: its name and, where it is on this machine, its files'
    names and sizes and its config (another model written to the same folder is another base)."""
    gguf = resolve_gguf(cfg)
    local = gguf if gguf is not None else Path(cfg.path).expanduser() if cfg.path else None
    parts = [str(cfg.path), str(cfg.gguf_file), cfg.dtype]
    if local is not None and local.exists():
        files = [local] if local.is_file() else sorted(p for p in local.iterdir() if p.is_file())
        parts += [f"{p.name}:{p.stat().st_size}" for p in files]
        if local.is_dir() and (local / "config.json").is_file():
            parts.append((local / "config.json").read_text())
    return "\n".join(parts)


def _held_out(val: datasets.Dataset | dict[str, datasets.Dataset] | None) -> dict[str, datasets.Dataset]:
    """The held-out blocks by their key in the reference file: "val", or "val:<source>" for a mixture's."""
    if isinstance(val, dict):
        return {f"val:{name}": blocks for name, blocks in val.items()}
    return {} if val is None else {"val": val}


def fingerprint(train: datasets.Dataset, val: datasets.Dataset | dict[str, datasets.Dataset] | None,
                base: str) -> str:
    """What the reference values belong to: the blocks' tokens and the base model (base_identity)."""
    h = hashlib.sha256(base.encode())
    for key, blocks in {"train": train, **_held_out(val)}.items():
        if ":" in key:  # a mixture's source by name (a run of one corpus keeps the fingerprint its file has)
            h.update(key.encode())
        h.update(np.ascontiguousarray(blocks.with_format("numpy")[:]["input_ids"]).tobytes())
    return h.hexdigest()[:16]


def use_reference(trainer, base: str, lora: bool) -> None:
    """The feed's blocks get their reference log-probabilities: read from the run folder that a resumed
    checkpoint belongs to, else computed now (collective) and saved in this run's folder."""
    feed, acc, cfg = trainer.feed, trainer.accelerator, trainer.cfg
    key = fingerprint(feed.blocks, feed.val, base)
    kept = RunDir(Path(trainer.resume_from).parent.parent).reference if trainer.resumed else trainer.run.reference
    values = _read(kept, key)
    if values is None and trainer.resumed and not lora:
        raise UserError(
            f"{kept} is missing or was made for other data or another base: the reference of a full fine-tune is "
            f"the model before training, which {trainer.resume_from} no longer holds; start the run over "
            "(overwrite=true) or resume it with the data and base it was started with")
    if values is None:
        trainer.print("reference: one forward pass over the pairs with the "
                      f"{'adapter off' if lora else 'weights before training'} (DPO's reference log-probabilities)")
        scored, micro = {"train": feed.blocks, **_held_out(feed.val)}, cfg.train.micro_batch_size
        passes = sum(forwards(blocks, micro, 0, acc.num_processes) for blocks in scored.values())
        with trainer.phases("reference pass", total=passes) as bar:
            values = {name: reference_logps(acc, trainer.model, blocks, micro, cfg.model.attn_implementation, bar)
                      for name, blocks in scored.items()}
        kept = None
    if trainer.strategy.is_main and kept != trainer.run.reference:  # computed, or read from another run's folder:
        _write(trainer.run.reference, key, values)  # this run's own checkpoints resume from it
    val = values.get("val")
    if isinstance(feed.val, dict):
        val = {name: values[f"val:{name}"] for name in feed.val}
    feed.add_reference(values["train"], val)


def _read(path: Path, key: str) -> dict[str, np.ndarray] | None:
    if not path.is_file():
        return None
    with np.load(path) as saved:
        if str(saved["fingerprint"]) != key:
            return None
        return {name: saved[name] for name in saved.files if name != "fingerprint"}


def _write(path: Path, key: str, values: dict[str, np.ndarray]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with writing("preference reference", tmp), open(tmp, "wb") as f:  # a failed write: one line, the .tmp removed
        np.savez(f, fingerprint=np.array(key), **values)
    os.replace(tmp, path)
