"""Data preparation at corpus scale: time, peak memory and disk as the corpus grows.

    python bench/data_scale.py                         # 10M and 100M tokens, synthetic and real
    python bench/data_scale.py --sizes 10M 100M 1B     # the 1B row takes ~20 min and ~20 GB of disk

Each corpus is a folder of jsonl files on disk, as a user's would be:

- synthetic: documents of about 500 tokens of words drawn at random from the CPython docs' vocabulary;
- real: the CPython docs (`pydoc_data.topics`) repeated, each copy perturbed (one word in eight
  replaced by a random one), so no two copies tokenize alike.

Every size runs in a fresh interpreter, the toolkit's data path as a recipe runs it:
`load_corpus` (jsonl -> datasets' arrow cache), then `packed_dataset` (tokenize with `num_proc`
processes into a scratch file, pack chunk by chunk into the memory-mapped block file), into an
empty cache. Memory is reported three ways, each less what the interpreter held after its
imports and the tokenizer: the anonymous memory of the main process (sampled every 50 ms; RSS
less file-backed pages), the largest tokenizing worker's (whole; a forked worker starts with the
parent's pages, shared until written), and the main process's peak RSS, which also counts the pages of memory-mapped arrow files it has read (the
kernel drops those under pressure). The workers' own peak RSS is given apart. Throughput is corpus tokens (EOS excluded) per second of wall time, per core
used (`num_proc`). At the smallest size the run_clm pipeline (bench/data_prep.py) runs on the
same documents for the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pyarrow.compute as pc

SIZES = {"10M": 10_000_000, "100M": 100_000_000, "1B": 1_000_000_000}
FILE_TOKENS = 20_000_000  # tokens per jsonl file of a corpus
# --mixture: three sources of a corpus size, by weight (synthetic, real, synthetic of another seed)
MIXTURE = (0.5, 0.3, 0.2)


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def peak_mb(who=resource.RUSAGE_SELF) -> float:
    return resource.getrusage(who).ru_maxrss / 1024


class AnonPeak(threading.Thread):
    """Samples the anonymous memory (RSS less file-backed pages) of this process and of its largest child.

    RSS also counts the pages of memory-mapped arrow files that were read, which the kernel drops
    under pressure; the anonymous part is what preparation needs."""

    def __init__(self, every_s: float = 0.05):
        super().__init__(daemon=True)
        self.every_s, self.main_mb, self.worker_mb, self.stop = every_s, 0.0, 0.0, threading.Event()

    def run(self) -> None:
        me = psutil.Process()
        while not self.stop.is_set():
            try:
                procs = [me, *me.children(recursive=True)]
                anon = [(m.rss - m.shared) / 2**20 for m in (p.memory_info() for p in procs)]
            except psutil.Error:  # a worker ended between listing and reading it
                continue
            self.main_mb, self.worker_mb = max(self.main_mb, anon[0]), max([self.worker_mb, *anon[1:]])
            self.stop.wait(self.every_s)


def start_measuring(work: Path) -> tuple[object, float, float, AnonPeak]:
    """(tokenizer, RSS MB and anonymous MB after the imports and the tokenizer, a started AnonPeak)."""
    tokenizer = tokenizer_for(work)
    base_rss = rss_mb()
    base_anon = (lambda m: (m.rss - m.shared) / 2**20)(psutil.Process().memory_info())
    sampler = AnonPeak()
    sampler.start()
    return tokenizer, base_rss, base_anon, sampler


def tokenizer_for(work: Path):
    """One byte-level BPE (vocab 4096, trained on the CPython docs) shared by every run, saved once."""
    from transformers import AutoTokenizer

    path = work / "tokenizer"
    if not path.is_dir():
        from toolkit.data.corpus import DataConfig, load_corpus
        from toolkit.data.tokenizer import train_bpe

        base, _ = load_corpus(DataConfig())
        train_bpe(base, 4096).save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def make_corpus(kind: str, tokens: int, folder: Path, tokenizer, seed: int = 0) -> None:
    """A folder of jsonl files holding about `tokens` tokens of `kind` documents (kept between runs)."""
    if (folder / "done").is_file():
        return
    from pydoc_data.topics import topics

    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    texts = [topics[k] for k in sorted(topics)]
    words = np.array(sorted({w for t in texts for w in t.split()}))
    sample = " ".join(texts)
    rng = np.random.default_rng(seed)
    per_char = len(tokenizer(sample[:200_000])["input_ids"]) / 200_000
    per_word = len(tokenizer(" ".join(words[rng.integers(0, len(words), 50_000)]))["input_ids"]) / 50_000
    made, part = 0, 0
    while made < tokens:
        docs = []
        file_made = 0
        while file_made < min(FILE_TOKENS, tokens - made):
            if kind == "synthetic":
                n = int(rng.integers(300, 700) / per_word)  # words, for 300-700 tokens
                text = " ".join(words[rng.integers(0, len(words), n)])
                file_made += int(n * per_word)
            else:
                text = texts[int(rng.integers(0, len(texts)))].split(" ")
                swap = rng.random(len(text)) < 0.125
                text = " ".join(np.where(swap, words[rng.integers(0, len(words), len(text))], text))
                file_made += int(len(text) * per_char)
            docs.append(text)
        with open(folder / f"part-{part:04d}.jsonl", "w") as f:
            for text in docs:
                f.write(json.dumps({"text": text}) + "\n")
        made += file_made
        part += 1
    (folder / "done").touch()


def one(args) -> None:
    """A single preparation in this (fresh) interpreter; prints one JSON line."""
    import datasets

    from toolkit.data.corpus import DataConfig, load_corpus
    from toolkit.data.mixture import MixtureSchedule, SourceConfig, weight_plan
    from toolkit.data.packing import packed_dataset

    datasets.disable_progress_bars()
    tokenizer, base_rss, base_anon, sampler = start_measuring(Path(args.work))
    cache = Path(args.cache)  # HF_DATASETS_CACHE points under it (set by the parent), so all of it is ours
    t0, cpu0 = time.perf_counter(), time.process_time()
    corpora = args.corpus.split(",")  # several: a mixture's sources, each loaded and packed as the recipe does
    loaded = [load_corpus(DataConfig(path=corpus)) for corpus in corpora]
    t1 = time.perf_counter()
    packed = [packed_dataset(docs, tokenizer, args.seq_len, cache / "blocks", source, num_proc=args.num_proc)
              for docs, source in loaded]
    t2 = time.perf_counter()
    schedule_us = 0.0
    if len(packed) > 1:  # what drawing a step's blocks by weight costs the loop (global batch 512, 200 steps)
        names = [f"s{i}" for i in range(len(packed))]
        plan = weight_plan([SourceConfig(n, weight=w) for n, w in zip(names, MIXTURE, strict=True)], [])
        schedule = MixtureSchedule([len(b) for b in packed], plan, names, 512, 8, 1, 0, 0)
        t_s = time.perf_counter()
        for step in range(200):
            schedule.global_indices(step)
        schedule_us = (time.perf_counter() - t_s) / 200 * 1e6
    sampler.stop.set()
    sampler.join()
    num_tokens = sum(int(np.asarray(b.data.column("num_tokens")).sum()) for b in packed)
    docs = sum(len(d) for d, _ in loaded)
    print(json.dumps({
        "docs": docs, "tokens": num_tokens - docs, "blocks": sum(len(b) for b in packed), "schedule_us": schedule_us,
        "load_s": t1 - t0, "pack_s": t2 - t1, "cpu_s": time.process_time() - cpu0,
        "base_mb": base_rss, "peak_mb": peak_mb(), "base_anon_mb": base_anon,
        "anon_main_mb": sampler.main_mb, "anon_worker_mb": sampler.worker_mb, "worker_peak_mb": peak_mb(resource.RUSAGE_CHILDREN),
        "blocks_gb": du(cache / "blocks") / 1e9, "arrow_gb": du(cache / "hf") / 1e9,
    }))


def run_clm_tokens_per_s(corpus: str, work: Path, seq_len: int, num_proc: int) -> float:
    import datasets

    sys.path.insert(0, str(Path(__file__).parent))
    from data_prep import run_clm_pipeline

    from toolkit.data.corpus import DataConfig, load_corpus

    datasets.disable_progress_bars()
    datasets.disable_caching()
    datasets.config.HF_DATASETS_CACHE = work / "cache" / "hf"  # the jsonl's arrow, deleted after the row
    docs, _ = load_corpus(DataConfig(path=corpus))
    tokenizer = tokenizer_for(work)
    t0 = time.perf_counter()
    _, _, tokenized = run_clm_pipeline(docs, tokenizer, seq_len, num_proc)
    wall = time.perf_counter() - t0
    return pc.sum(pc.list_value_length(tokenized.data.column("input_ids"))).as_py() / wall


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", nargs="+", default=["10M", "100M"], choices=list(SIZES))
    p.add_argument("--kinds", nargs="+", default=["synthetic", "real"], choices=["synthetic", "real"])
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--num-proc", type=int, default=2)
    p.add_argument("--work", default="/tmp/data_scale", help="corpora, tokenizer and caches live here")
    p.add_argument("--mixture", action="store_true", help="a 3-source mixture of each size (data.sources) "
                   "instead of the --kinds")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--corpus", help=argparse.SUPPRESS)
    p.add_argument("--cache", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        one(args)
        return 0

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    tokenizer = tokenizer_for(work)
    rows = []
    for kind in ["mixture"] if args.mixture else args.kinds:
        for size in args.sizes:
            corpus = work / f"{kind}-{size}"
            if kind == "mixture":
                parts = [("synthetic", 0), ("real", 0), ("synthetic", 1)]
                folders = [work / f"mixture-{size}-{i}-{k}" for i, (k, _) in enumerate(parts)]
                for (k, seed), share, folder in zip(parts, MIXTURE, folders, strict=True):
                    make_corpus(k, int(SIZES[size] * share), folder, tokenizer, seed)
                corpus = ",".join(str(f) for f in folders)
            else:
                make_corpus(kind, SIZES[size], corpus, tokenizer)
            cmd = [sys.executable, __file__, "--one", "--work", str(work), "--corpus", str(corpus),
                   "--cache", str(work / "cache"), "--seq-len", str(args.seq_len), "--num-proc", str(args.num_proc)]
            env = dict(os.environ, HF_DATASETS_CACHE=str(work / "cache" / "hf"))
            shutil.rmtree(work / "cache", ignore_errors=True)
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
            r = json.loads(out.strip().splitlines()[-1])
            r.update(kind=kind, size=size, corpus_gb=sum(du(Path(c)) for c in str(corpus).split(",")) / 1e9)
            print(f"  {kind} {size}: {r}", file=sys.stderr)
            if size == args.sizes[0] and kind != "mixture":  # tokenize + group against the toolkit's tokenize + pack
                r["run_clm"] = run_clm_tokens_per_s(str(corpus), work, args.seq_len, args.num_proc)
            rows.append(r)
            shutil.rmtree(work / "cache", ignore_errors=True)

    print("\n`" + " ".join(["python", "bench/data_scale.py", *sys.argv[1:]]) + "`")
    print(f"\nseq_len {args.seq_len}, num_proc {args.num_proc}, BPE vocab 4096; time = load (jsonl -> arrow) + "
          "tokenize and pack; RSS growth = peak less the interpreter after imports\n")
    print("| corpus | tokens | docs | load s | tokenize+pack s | tokens/s per core | vs run_clm | anon growth MB "
          "| worker anon MB | peak RSS growth MB | worker peak RSS MB | jsonl GB | arrow GB | blocks GB "
          "| µs a step to draw 512 blocks by weight |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        wall = r["load_s"] + r["pack_s"]
        per_core = r["tokens"] / wall / args.num_proc
        ratio = f"{r['tokens'] / r['pack_s'] / r['run_clm']:.2f}x" if "run_clm" in r else ""
        draw = f"{r['schedule_us']:,.0f}" if r["schedule_us"] else ""
        print(f"| {r['kind']} {r['size']} | {r['tokens']:,} | {r['docs']:,} | {r['load_s']:.1f} | {r['pack_s']:.1f} | "
              f"{per_core:,.0f} | {ratio} | {r['anon_main_mb'] - r['base_anon_mb']:,.0f} | {r['anon_worker_mb']:,.0f} | "
              f"{r['peak_mb'] - r['base_mb']:,.0f} | {r['worker_peak_mb']:,.0f} | "
              f"{r['corpus_gb']:.2f} | {r['arrow_gb']:.2f} | {r['blocks_gb']:.2f} | {draw} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
