"""A forgetting budget on a real model: SmolLM2-135M-Instruct continued on the Python documentation (the README's
fine-tune) while general English text is held out, without a budget and with one.

    python bench/forgetting.py                     # both runs, ~30 min on 2 CPU cores; prints one table
    python bench/forgetting.py --budget 0.05 --plot docs/forgetting.png
    python bench/forgetting.py --smoke             # 2 steps a run: the code path, not the figures

The general text is English prose from the fortune cookie files Debian ships (package `fortunes`, found in
/usr/share/games/fortunes or fetched with `apt-get download`), or --general FILE. Both runs are one process of
recipes/finetune.py with finetune_smollm2_lora.yaml and the same mixture: the documentation, and the general text as
a source of weight 0, so that it is held out and its share starts at 0. The unconstrained run only reports the
general loss (forgetting.general without a budget); the budgeted one holds it (forgetting.budget: replay, selection,
patience at their defaults). The table gives each run's domain and general held-out losses before and after, the step
kept, and the two verdicts of issue 66: the general loss within the budget, and at least 80 % of the unconstrained
run's domain gain kept.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
YAML = ROOT / "recipes" / "configs" / "finetune_smollm2_lora.yaml"
FORTUNES = Path("/usr/share/games/fortunes")
# fortune files that are code, ASCII art, or another domain's jargon rather than English prose
NOT_PROSE = {"computers", "linux", "linuxcookie", "knghtbrd", "debian", "perl", "art", "ascii-art", "startrek", "zippy",
             "translate-me"}
# what both runs train with: the shipped LoRA YAML as a full fine-tune at a rate that forgets (a LoRA, and a full
# fine-tune at 3e-4, moved the general loss by under 1 %); a larger held-out share, so that the domain's is not 4
# documents
SETTINGS = ["adapter.method=full", "optim.lr=1e-3", "train.global_batch_size=4", "train.max_steps=40", "eval.every=5",
            "eval.blocks=16", "data.val_fraction=0.15", "samples.max_new_tokens=0", "checkpoint.every=0",
            "logging.trackers=[]"]
SMOKE = ["train.max_steps=2", "eval.every=1", "eval.blocks=2", "data.seq_len=64"]


def english_text(folder: Path) -> Path:
    """The fortune files' prose, an entry a document (entries apart by a blank line), as one UTF-8 file."""
    source = FORTUNES
    if not source.is_dir():
        subprocess.run(["apt-get", "download", "fortunes"], cwd=folder, check=True, capture_output=True)
        deb = next(folder.glob("fortunes_*.deb"))
        subprocess.run(["dpkg-deb", "-x", str(deb), str(folder / "deb")], check=True)
        source = folder / "deb" / "usr" / "share" / "games" / "fortunes"
    entries = []
    for f in sorted(source.iterdir()):
        if f.suffix or f.is_symlink() or f.name in NOT_PROSE:
            continue
        for entry in re.split(r"^%\s*$", f.read_bytes().decode("utf-8", errors="ignore"), flags=re.M):
            body = "\n".join(line.rstrip() for line in entry.splitlines() if line.strip())
            chars = [c for c in body if not c.isspace()]
            if len(chars) >= 20 and sum(c.isalpha() for c in chars) / len(chars) >= 0.6:  # not a table or a drawing
                entries.append(body)
    path = folder / "english.txt"
    path.write_text("\n\n".join(entries) + "\n", encoding="utf-8")
    return path


def run(name: str, general: Path, budget: float | None, args, work: Path) -> dict:
    out = work / name
    mixture = f"data.sources=[{{name: python, weight: 1}}, {{name: general, path: {general}, weight: 0}}]"
    cmd = [sys.executable, "recipes/finetune.py", "--config", str(YAML), f"output_dir={out}", mixture,
           "forgetting.general=general", *SETTINGS, *(SMOKE if args.smoke else []), *args.overrides,
           *([f"forgetting.budget={budget}"] if budget is not None else [])]
    start = time.monotonic()
    with open(work / f"{name}.log", "w") as log:
        code = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
    if code:
        raise SystemExit(f"{name}: exited {code}; see {work / name}.log")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"rows": [r for r in rows if r["kind"] == "budget"], "seconds": time.monotonic() - start, "out": out}


def result(judged: list[dict]) -> dict:
    """A run's base and result from its budget rows: the kept step's where one is kept, else the last evaluation's."""
    base, last = judged[0], judged[-1]
    kept = next((r for r in judged if r["step"] == last["best_step"]), last)
    return {"domain_base": base["domain_loss"], "domain": kept["domain_loss"], "general_base": base["general_base"],
            "general": kept["general_loss"], "step": kept["step"], "steps": last["step"],
            "gain": base["domain_loss"] - kept["domain_loss"], "change": kept["general_loss"] / base["general_base"] - 1}


def table(free: dict, held: dict, budget: float) -> str:
    lines = ["| run | step kept | domain held-out loss | domain gain | general held-out loss | general change | wall |",
             "|---|---|---|---|---|---|---|"]
    for name, r, seconds in (("unconstrained", free, free["seconds"]), (f"budget {budget:.0%}", held, held["seconds"])):
        lines.append(f"| {name} | {r['step']} of {r['steps']} | {r['domain_base']:.4f} → {r['domain']:.4f} | "
                     f"{r['gain']:.4f} | {r['general_base']:.4f} → {r['general']:.4f} | {r['change']:+.2%} | "
                     f"{seconds / 60:.1f} min |")
    kept = held["gain"] / free["gain"] if free["gain"] > 0 else float("nan")
    lines += ["", f"general loss within the budget: {'yes' if held['change'] <= budget else 'no'} "
              f"({held['change']:+.2%} against {budget:+.0%}; unconstrained {free['change']:+.2%})",
              f"domain gain kept: {kept:.0%} of the unconstrained run's ({'yes' if kept >= 0.8 else 'no'}, at least 80 %)"]
    return "\n".join(lines)


def plot(free: list[dict], held: list[dict], budget: float, path: Path) -> None:
    """The general and domain held-out losses of both runs at each evaluation, and the budget's line."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.2))
    ax_general, ax_domain = fig.subplots(1, 2)
    for rows, name, color in ((free, "unconstrained", "C3"), (held, f"budget {budget:.0%}", "C2")):
        steps = [r["step"] for r in rows]
        ax_general.plot(steps, [r["general_loss"] for r in rows], marker="o", color=color, label=name)
        ax_domain.plot(steps, [r["domain_loss"] for r in rows], marker="o", color=color, label=name)
        kept = rows[-1]["best_step"]
        if kept is not None and name != "unconstrained":
            ax_domain.axvline(kept, color=color, linestyle=":", linewidth=1, label=f"kept: step {kept}")
    ax_general.axhline(held[0]["general_base"] * (1 + budget), color="C2", linestyle="--", linewidth=1,
                       label=f"budget (+{budget:.0%})")
    ax_general.set_title("general English (held out)")
    ax_domain.set_title("Python documentation (held out)")
    for ax in (ax_general, ax_domain):
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("loss (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=float, default=0.05)
    parser.add_argument("--general", type=Path, help="general English text (default: the fortune files' prose)")
    parser.add_argument("--plot", type=Path, help="write the two runs' held-out losses here (PNG)")
    parser.add_argument("--smoke", action="store_true", help="2 steps a run: the code path, not the figures")
    parser.add_argument("--keep", action="store_true", help="keep the runs' folders (printed)")
    parser.add_argument("overrides", nargs="*", help="more key=value for both runs")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="forgetting-"))
    try:
        general = args.general or english_text(work)
        free = run("unconstrained", general, None, args, work)
        held = run("budget", general, args.budget, args, work)
        print(table({**result(free["rows"]), "seconds": free["seconds"]},
                    {**result(held["rows"]), "seconds": held["seconds"]}, args.budget))
        if args.plot:
            plot(free["rows"], held["rows"], args.budget, args.plot)
            print(f"plot: {args.plot}")
    finally:
        if args.keep:
            print(f"runs: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
