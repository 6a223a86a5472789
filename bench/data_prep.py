"""Tokenize + pack throughput: the toolkit versus the Hugging Face `run_clm.py` recipe.

    python bench/data_prep.py                      # CPython docs x20, num_proc 2, 3 timed runs
    python bench/data_prep.py --copies 40 --repeats 5 --seq-len 1024

Both sides get the same documents (the embedded CPython docs repeated `--copies` times, as
extra documents), the same byte-level BPE (toolkit.data.tokenizer.train_bpe, vocab 4096) and the
same `num_proc`, with datasets caching disabled so neither side reads a cache:

- toolkit: `tokenize_documents` (batched multi-process map, EOS after each document) then
  `pack_documents` (vectorized numpy; keeps every token, pads the last block).
- run_clm: `tokenize_function` (tokenizer(examples["text"])) then `group_texts` (concatenate
  and chunk inside `datasets.map(batched=True)`, dropping the remainder of every map batch),
  written as in transformers' examples/pytorch/language-modeling/run_clm.py.

Runs alternate (toolkit, run_clm, toolkit, ...) after one untimed warm-up each, so machine
noise hits both alike; the table gives medians. Throughput is corpus tokens (the tokenizer's
count, no EOS, identical for both) per second of wall time, so the speedup is a time ratio.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from itertools import chain

import datasets
import numpy as np

from toolkit.data.corpus import DataConfig, load_corpus
from toolkit.data.packing import pack_documents, tokenize_documents
from toolkit.data.tokenizer import train_bpe


def cpu_seconds() -> float:
    """CPU time of this process (all threads) plus reaped children (the datasets.map workers)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def toolkit_pipeline(docs, tokenizer, seq_len, num_proc):
    t0 = time.perf_counter()
    tokenized = tokenize_documents(docs, tokenizer, num_proc)
    t1 = time.perf_counter()
    blocks = pack_documents(tokenized, seq_len, tokenizer.pad_token_id)
    t2 = time.perf_counter()
    kept = int(np.asarray(blocks.data.column("num_tokens")).sum())  # real tokens, padding excluded
    return (t1 - t0, t2 - t1), kept, blocks


def run_clm_pipeline(docs, tokenizer, block_size, num_proc):
    """transformers/examples/pytorch/language-modeling/run_clm.py, data part (no cache)."""
    column_names = docs.column_names
    text_column_name = "text" if "text" in column_names else column_names[0]

    def tokenize_function(examples):
        return tokenizer(examples[text_column_name])

    def group_texts(examples):
        # Concatenate all texts.
        concatenated_examples = {k: list(chain(*examples[k])) for k in examples.keys()}
        total_length = len(concatenated_examples[list(examples.keys())[0]])
        # Drop the small remainder of this batch.
        total_length = (total_length // block_size) * block_size
        # Split by chunks of block_size.
        result = {
            k: [t[i : i + block_size] for i in range(0, total_length, block_size)]
            for k, t in concatenated_examples.items()
        }
        result["labels"] = result["input_ids"].copy()
        return result

    t0 = time.perf_counter()
    tokenized = docs.map(
        tokenize_function,
        batched=True,
        num_proc=num_proc,
        remove_columns=column_names,
        desc="Running tokenizer on dataset",
    )
    t1 = time.perf_counter()
    lm_datasets = tokenized.map(
        group_texts, batched=True, num_proc=num_proc, desc=f"Grouping texts in chunks of {block_size}"
    )
    t2 = time.perf_counter()
    return (t1 - t0, t2 - t1), len(lm_datasets) * block_size, tokenized


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--copies", type=int, default=20, help="times the CPython docs are repeated, as documents")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per block (run_clm's block_size)")
    p.add_argument("--num-proc", type=int, default=2, help="datasets.map processes, both sides")
    p.add_argument("--vocab", type=int, default=4096, help="BPE vocabulary size")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per side (median reported)")
    args = p.parse_args()

    datasets.disable_caching()
    datasets.disable_progress_bars()
    base, _ = load_corpus(DataConfig())
    tokenizer = train_bpe(base, args.vocab)
    docs = datasets.concatenate_datasets([base] * args.copies)

    sides = {"toolkit": toolkit_pipeline, "run_clm": run_clm_pipeline}
    runs = {name: [] for name in sides}  # (tokenize s, pack s, CPU s) per timed run
    kept, outputs = {}, {}
    for rep in range(args.repeats + 1):  # rep 0 is the untimed warm-up
        for name, fn in sides.items():
            cpu0 = cpu_seconds()
            (tok_s, pack_s), kept[name], outputs[name] = fn(docs, tokenizer, args.seq_len, args.num_proc)
            cpu = cpu_seconds() - cpu0
            if rep:
                runs[name].append((tok_s, pack_s, cpu))
            label = f"run {rep}{' (warm-up)' if not rep else ''} {name}"
            print(f"  {label}: tokenize {tok_s:.2f}s + pack {pack_s:.2f}s, CPU {cpu:.2f}s", file=sys.stderr)

    # Same tokens? The toolkit's blocks minus EOS/padding must be run_clm's tokenized stream.
    corpus_ids = np.asarray(outputs["run_clm"].data.column("input_ids").combine_chunks().flatten())
    flat = np.asarray(outputs["toolkit"].data.column("input_ids").combine_chunks().flatten())[: kept["toolkit"]]
    same = np.array_equal(flat[flat != tokenizer.eos_token_id], corpus_ids)
    n_corpus, n_docs = corpus_ids.size, len(docs)
    assert same and kept["toolkit"] == n_corpus + n_docs, "toolkit blocks are not the corpus tokens + one EOS per doc"

    def med(name, i):  # i: 0 tokenize, 1 pack, 2 CPU, 3 wall total
        return statistics.median((r[0] + r[1]) if i == 3 else r[i] for r in runs[name])

    print("\n`" + " ".join(["python", "bench/data_prep.py", *sys.argv[1:]]) + "`")
    print(f"\n{n_docs} documents, {n_corpus:,} corpus tokens, vocab {args.vocab}, seq_len {args.seq_len}, "
          f"num_proc {args.num_proc}, medians of {args.repeats} alternating runs\n")
    print("| pipeline | tokenize s | pack/group s | total s | corpus tokens/s | speedup | CPU s | speedup (CPU) | tokens kept |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for k in sides:
        extra = f"(+{n_docs} EOS, last block padded)" if k == "toolkit" else f"({n_corpus - kept[k]:,} dropped)"
        print(f"| {k} | {med(k, 0):.2f} | {med(k, 1):.2f} | {med(k, 3):.2f} | {n_corpus / med(k, 3):,.0f} | "
              f"{med('run_clm', 3) / med(k, 3):.2f}x | {med(k, 2):.2f} | {med('run_clm', 2) / med(k, 2):.2f}x | "
              f"{kept[k]:,} {extra} |")
    print(f"\ntoolkit tokens == corpus tokens + one EOS per document: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
