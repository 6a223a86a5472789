"""Export what training produced for inference: a Hugging Face folder, GGUF, or int8/int4.

    python recipes/export.py --from runs/tiny --format gguf --quant q8_0 --output exports/tiny-q8_0.gguf
    python recipes/export.py --from runs/ft --checkpoint step-300 --format hf --dtype bf16 --merge-lora --output exports/ft-hf

One process, no launcher, no GPU. `--from` takes a run folder (its final/, or --checkpoint
step-N / latest), any Hugging Face model folder, a checkpoint folder of any strategy (DDP,
FSDP, ZeRO-1/2/3: gathered with the strategy's own tools), or a LoRA adapter folder (merged
into its base, found from the adapter or given with --base).

Formats
- hf: safetensors (sharded above --max-shard-size), config, tokenizer, generation config and a
  model card with the source, step, dtype and eval loss; --dtype fp32 / bf16 / fp16.
- gguf: for llama.cpp and Ollama, written with the `gguf` package; --quant f16, q8_0, q4_0, ...;
  the tokenizer and chat template inside, and an Ollama Modelfile beside it.
- int8 / int4: weight-only quantised HF folders through transformers' quantization configs.

Every export is reloaded and measured: export_report.md (format, size, held-out perplexity and
its change against the fp32 source, generation tokens/s) is printed and written beside it, with
its stops: on the run's sample prompts, greedy tokens of the source and of the export (a GGUF
run by llama.cpp where llama-cpp-python is installed) up to the same stop, and the Modelfile's
template and stops against the chat template's (toolkit.export.stops). A GGUF or Modelfile that
would stop elsewhere than the source fails the export.
Errors (one line, exit code 2): a missing or unrecognised --from, an incomplete, unknown or
damaged source (its manifest, as resume checks a checkpoint's; a missing weight or tokenizer
file), an unsupported architecture or quant type, an existing output without --overwrite, an
output that cannot be created, a flag of another format, --base for a source that is not an
adapter, an --eval-text that is not UTF-8 or too short; argparse's own refusals too.
Nothing is lost (toolkit.export.destination): --overwrite replaces only an earlier export, never a
folder or file the export did not write, a run, or what the export reads. An export is made
beside the output and moved into place once complete, so one that fails midway leaves nothing
under the output's name and an earlier export as it was.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch

from toolkit import quiet_weight_bars
from toolkit.config.errors import UserError
from toolkit.data.text_files import read_utf8
from toolkit.export import destination
from toolkit.export.consolidate import adapter_base, load_model, resolve_source
from toolkit.export.hf_folder import write_model_folder
from toolkit.export.report import ExportReport, held_out_ids, perplexity, size_on_disk, tokens_per_second
from toolkit.export.run_base import add_base_option, take_run_base
from toolkit.export.stops import check_stops, run_prompts, source_reference
from toolkit.launch.cli import OneLineParser
from toolkit.models.adapter import leave_out_bitsandbytes
from toolkit.run.writes import WriteFailed

FORMATS = ("hf", "gguf", "int8", "int4")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

HF_CARD = """---
library_name: transformers
pipeline_tag: text-generation
tags: [llm-toolkit]
---
# {name}

Exported by llm-toolkit's `recipes/export.py`.

| | |
|---|---|
| source | {source} |
| step | {step} |
| dtype | {dtype} |
| eval loss at training time | {eval_loss} |
| held-out perplexity (this export) | {ppl} |
"""


def parser() -> OneLineParser:
    """The command line; every option's wrong values are refused in one line (tests/recipes/test_export.py walks them)."""
    parser = OneLineParser("python recipes/export.py", description=__doc__.split("\n")[0])
    parser.add_argument("--from", dest="source", required=True, help="run, model, checkpoint or adapter folder")
    parser.add_argument("--checkpoint", help="with a run folder: step-N or latest (default: its final/)")
    parser.add_argument("--format", choices=FORMATS, default="hf")
    parser.add_argument("--quant", default="f16", help="gguf: the tensor type (f16, q8_0, q4_0, ...)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), help="hf: the weights' dtype (default fp32)")
    parser.add_argument("--merge-lora", action="store_true", help="merge a LoRA adapter into its base (needed for adapters)")
    add_base_option(parser)
    parser.add_argument("--max-shard-size", default="2GB", help="hf: split safetensors above this size")
    parser.add_argument("--output", required=True, help="the folder (hf, int8, int4) or .gguf file to write")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output")
    parser.add_argument("--eval-text", help="a text file for the perplexity check (default: held-out CPython docs)")
    return parser


# the options that name a path: `~` and environment variables expanded as in a config's paths (toolkit.config.user_paths.expand_path)
PATH_OPTIONS = ("--from", "--base", "--output", "--eval-text")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    options = parser()
    args = options.parse_paths(options.parse_args(argv), PATH_OPTIONS)
    take_run_base(args)
    return args


def check_args(args: argparse.Namespace) -> Path:
    """Everything about the flags that can be refused before any work is done (what the output
    may replace is checked once the source, and so everything the export reads, is known)."""
    output = Path(args.output)
    if args.format == "gguf":
        from toolkit.export.gguf import GGUF_TYPES

        if args.quant not in GGUF_TYPES:
            raise UserError(f"--quant {args.quant!r} is not offered for gguf; choose one of {', '.join(GGUF_TYPES)}")
        if output.suffix != ".gguf":
            raise UserError(f"--output {output} must end in .gguf for --format gguf")
    elif args.quant != "f16":
        raise UserError(f"--quant applies to --format gguf only; for {args.format} leave it out")
    if args.dtype is not None and args.format != "hf":
        raise UserError(f"--dtype applies to --format hf only; for {args.format} leave it out")
    args.dtype = args.dtype or "fp32"
    if not re.fullmatch(r"\d+(\.\d*)?\s*[KMGT]B", args.max_shard_size, re.IGNORECASE):
        raise UserError(f"--max-shard-size {args.max_shard_size!r} is not a size; write it like 500MB or 2GB")
    if not float(re.match(r"[\d.]+", args.max_shard_size).group()):
        raise UserError(f"--max-shard-size {args.max_shard_size} would put no weight in a shard; write it like 500MB or 2GB")
    destination.check_base(args.base)
    if args.eval_text and Path(args.eval_text).is_dir():
        raise UserError(f"--eval-text {args.eval_text} is a folder; give a UTF-8 text file")
    if args.eval_text and not Path(args.eval_text).is_file():
        raise UserError(f"--eval-text {args.eval_text} does not exist")
    destination.check_creatable(output)
    return output


def main(argv: list[str] | None = None) -> int:
    leave_out_bitsandbytes()  # an export never loads a 4-bit base; a LoRA merge imports peft, which imports it
    quiet_weight_bars()
    try:
        args = parse_args(argv)
        output = check_args(args)
        source = resolve_source(args.source, args.checkpoint)
        destination.check_base(args.base, source)
        # everything the export reads stays apart from what it writes
        reads = {"--from": Path(args.source), "the source": source.path, "its run": source.run_dir,
                 "the LoRA's base": adapter_base(source, args.base),
                 "--eval-text": Path(args.eval_text) if args.eval_text else None}
        destination.check_output(output, args.format, args.overwrite, reads)
        model, tokenizer, notes = load_model(source, args.base, args.merge_lora)
        if args.format == "gguf":  # an architecture llama.cpp cannot run is refused before any work
            from toolkit.export.gguf import gguf_architecture

            gguf_architecture(model.config, source.describe())
        if args.merge_lora and source.kind == "hf":
            notes.append(f"--merge-lora: {source.describe()} is a full model; there was nothing to merge")
        for line in notes:
            print(f"[export] {line}")

        # The fp32 source's perplexity: the reference for every format.
        eval_text = read_utf8(Path(args.eval_text), f"--eval-text {args.eval_text}") if args.eval_text else None
        try:
            blocks = held_out_ids(tokenizer, eval_text)
        except ValueError as exc:  # too short to measure a perplexity on
            raise UserError(f"--eval-text {args.eval_text}: {exc}; give a longer text") from None
        source_ppl = perplexity(model, blocks)
        reference = source_reference(model, tokenizer, *run_prompts(source.path, source.run_dir))
        facts = {"source": source.describe(), "step": source.facts.get("step", "n/a"),
                 "eval_loss": _fmt(source.facts.get("eval_loss"))}

        # Write, measure and sign the export beside the output; then move it into place.
        with destination.staging(output) as (staged, work):
            if args.format == "hf":
                model = model.to(DTYPES[args.dtype])
                card = HF_CARD.format(name=output.name, dtype=args.dtype, ppl="see export_report.md", **facts)
                write_model_folder(model, tokenizer, staged, {}, {}, card=card, max_shard_size=args.max_shard_size,
                                   writer="export")
                exported = _load_hf(staged)
            else:
                hf_folder = write_model_folder(model, tokenizer, work / "model", {}, {}, card="", writer="export")
                if args.format == "gguf":
                    from toolkit.export.gguf import write_gguf
                    from toolkit.export.modelfile import write_modelfile

                    write_gguf(hf_folder, staged, args.quant, notes)
                    write_modelfile(staged, hf_folder)
                    notes.append(f"Ollama: ollama create NAME -f {destination.modelfile_path(output)}")
                    exported = _load_gguf(staged)
                else:
                    from toolkit.export.quantize import quantize_folder

                    _, quant_notes = quantize_folder(hf_folder, staged, args.format)
                    notes += quant_notes
                    exported = _load_hf(staged)

            # the export stops where the source stops, or it is not put in place (toolkit.export.stops)
            gguf = args.format == "gguf"
            stops = check_stops(reference, exported, f"the export ({output.name})", staged if gguf else None,
                                destination.modelfile_path(staged) if gguf else None, lossy=not (args.format == "hf" and args.dtype == "fp32" or gguf and args.quant == "f32"))
            if stops.problems:
                raise UserError(f"the export would not stop where its source does: {stops.problems[0]}"
                                + (f" (and {len(stops.problems) - 1} more)" if len(stops.problems) > 1 else "")
                                + "; nothing was written: export from a folder whose tokenizer holds the run's chat "
                                "template (a run's final/ or adapter/), or report it as a bug of the exporter")
            # what the notes say of the staged copy is true of the output once it is moved into place
            notes = [note.replace(str(staged), str(output)) for note in notes]
            report = ExportReport(
                output=output, fmt=args.format + (f" {args.quant}" if args.format == "gguf" else f" {args.dtype}" if args.format == "hf" else ""),
                source=source.describe(), size_bytes=size_on_disk(staged), source_ppl=source_ppl,
                export_ppl=perplexity(exported, blocks), tokens_per_s=tokens_per_second(exported, tokenizer), notes=notes,
                text=f"--eval-text {args.eval_text}" if args.eval_text else "the CPython docs' held-out documents",
                trained_ppl=source.facts.get("eval_ppl") if isinstance(source.facts.get("eval_ppl"), float) else None,
                stops=stops.markdown().replace(str(staged), str(output)),
            )
            destination.report_path(staged, args.format).write_text(report.markdown())
            destination.mark(staged, args.format)
            destination.put_in_place(staged, output, args.format, args.overwrite, reads)
        print(report.markdown())
        print(f"[export] wrote {output} and {destination.report_path(output, args.format)}")
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except WriteFailed as exc:  # a full disk, an I/O error: one line, the staging folder removed
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit
    return 0


def _load_hf(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder).eval()


def _load_gguf(file: Path):
    """Through transformers' GGUF loader (dequantising, so the perplexity shows the quantisation
    error), with the file's metadata parsed once and no cached copy kept."""
    from toolkit.models.base_model import BaseModelConfig, load_base_model

    model, _, _ = load_base_model(BaseModelConfig(path=str(file), gguf_cache=False))
    return model.eval()


def _fmt(value) -> str:
    return f"{value:.4f}" if isinstance(value, float) else "n/a"


if __name__ == "__main__":
    sys.exit(main())
