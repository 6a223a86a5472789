"""Streaming (data.streaming=true) as the corpus grows: time to the first batch, tokens/s, memory.

    python bench/data_stream.py                          # 10M and 100M tokens
    python bench/data_stream.py --sizes 10M 100M 1B      # the corpora of bench/data_scale.py (made if missing)

Each size runs in a fresh interpreter, as one data rank of a recipe does: `stream_corpus` over the
corpus folder of jsonl files, then `StreamingBlocks.take` of one rank's share of a global batch
(`--blocks` blocks of `--seq-len` tokens) until `--tokens` tokens have been streamed (or the corpus
ends). Nothing is prepared ahead: the first batch's time is the wait before training starts,
against bench/data_scale.py's tokenize+pack of the whole corpus. Memory is the main process's
peak RSS (all pages, file-backed too) and its anonymous memory, each less the interpreter after
its imports and the tokenizer. Tokens/s is for the one process (the Rust tokenizer may use more
than one thread; TOKENIZERS_PARALLELISM=false keeps it to one, as the recipes' test launches do).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from data_scale import SIZES, du, make_corpus, peak_mb, start_measuring, tokenizer_for


def one(args) -> None:
    import datasets

    from toolkit.data.corpus import DataConfig, stream_corpus
    from toolkit.data.streaming import StreamingBlocks

    datasets.disable_progress_bars()
    tokenizer, base_rss, base_anon, sampler = start_measuring(Path(args.work))
    t0 = time.perf_counter()
    stream, _ = stream_corpus(DataConfig(path=args.corpus))
    blocks = StreamingBlocks(stream, tokenizer, args.seq_len)
    first_s, tokens, batches = None, 0, 0
    while tokens < args.tokens and blocks.epoch == 0:
        batch = blocks.take(args.blocks)
        tokens += int(batch["num_tokens"].sum())
        batches += 1
        if first_s is None:
            first_s = time.perf_counter() - t0
    wall = time.perf_counter() - t0
    sampler.stop.set()
    sampler.join()
    print(json.dumps({"first_s": first_s, "tokens": tokens, "wall_s": wall, "batches": batches,
                      "peak_mb": peak_mb() - base_rss, "anon_mb": sampler.main_mb - base_anon}))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", nargs="+", default=["10M", "100M"], choices=list(SIZES))
    p.add_argument("--kind", default="synthetic", choices=["synthetic", "real"])
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--blocks", type=int, default=64, help="blocks a step takes on this rank")
    p.add_argument("--tokens", type=int, default=20_000_000, help="tokens streamed per size")
    p.add_argument("--work", default="/tmp/data_scale", help="corpora and tokenizer (shared with data_scale.py)")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--corpus", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        one(args)
        return 0

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    tokenizer = tokenizer_for(work)
    rows = []
    for size in args.sizes:
        corpus = work / f"{args.kind}-{size}"
        make_corpus(args.kind, SIZES[size], corpus, tokenizer)
        cmd = [sys.executable, __file__, "--one", "--work", str(work), "--corpus", str(corpus), "--seq-len",
               str(args.seq_len), "--blocks", str(args.blocks), "--tokens", str(args.tokens)]
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_DATASETS_CACHE=str(work / "stream-hf"))
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
        r = json.loads(out.strip().splitlines()[-1])
        r.update(size=size, corpus_gb=du(corpus) / 1e9)
        print(f"  {size}: {r}", file=sys.stderr)
        rows.append(r)

    print("\n`" + " ".join(["python", "bench/data_stream.py", *sys.argv[1:]]) + "`")
    print(f"\n{args.kind} corpus, seq_len {args.seq_len}, {args.blocks} blocks a step, one process, one tokenizer "
          "thread; growth = less the interpreter after imports\n")
    print("| corpus | jsonl GB | first batch s | tokens streamed | tokens/s | peak RSS growth MB | anon growth MB |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {args.kind} {r['size']} | {r['corpus_gb']:.2f} | {r['first_s']:.2f} | {r['tokens']:,} | "
              f"{r['tokens'] / r['wall_s']:,.0f} | {r['peak_mb']:,.0f} | {r['anon_mb']:,.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
