"""recipes/export.py: every kind of training output becomes one model, and bad input is refused.

Checkpoints of 2-process runs under DDP, FSDP2 and ZeRO-1/2/3 consolidate offline, in this
process, to the model the run held when it saved them (its final/ folder, gathered from the live
model at the same step); a LoRA run's checkpoint and a LoRA adapter merge into their base.
"""

from __future__ import annotations

import re
import shutil
import warnings
from pathlib import Path

import installed
import pytest
import torch
import wrong_arguments
from recipe_runner import FT_TINY, assert_generates_with_the_cache, recipe_module, run_recipe, saved_lora
from transformers import AutoModelForCausalLM, AutoTokenizer

from toolkit.export.consolidate import load_model, resolve_source

STRATEGIES = ["ddp", "fsdp", "zero1", "zero2", "zero3"]
KIND = {"ddp": "ddp", "fsdp": "fsdp", "zero1": "deepspeed", "zero2": "deepspeed", "zero3": "deepspeed"}


@pytest.fixture(scope="module")
def export():
    return recipe_module("export")


@pytest.fixture(scope="module")
def runs(strategy_runs) -> dict:
    """The strategy matrix's runs (conftest.strategy_runs): 6 steps on 2 processes, checkpoints at 3 and 6."""
    return {s: strategy_runs(s)[0] for s in STRATEGIES}


def logits(model, seed: int = 0) -> torch.Tensor:
    ids = torch.randint(0, model.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_checkpoint_consolidates_to_the_model_it_saved(strategy, runs):
    source = resolve_source(runs[strategy], "step-6")
    assert source.kind == KIND[strategy] and source.step == 6
    model, tokenizer, _ = load_model(source)
    assert_generates_with_the_cache(runs[strategy] / "final")
    live = AutoModelForCausalLM.from_pretrained(runs[strategy] / "final")  # gathered from the live model at step 6
    torch.testing.assert_close(logits(model), logits(live), atol=1e-5, rtol=0)
    assert tokenizer("def f(x):")["input_ids"] == source_tokenizer(runs[strategy])("def f(x):")["input_ids"]


def source_tokenizer(run):

    return AutoTokenizer.from_pretrained(run / "final")


@pytest.mark.distributed
def test_hf_export_of_a_zero3_checkpoint(export, runs, tmp_path, capsys):
    out = tmp_path / "z3-hf"
    code = export.main(["--from", str(runs["zero3"]), "--checkpoint", "step-6", "--format", "hf", "--dtype", "bf16",
                        "--output", str(out)])
    said = capsys.readouterr()
    assert code == 0, said.err
    for line in ("Processing zero checkpoint", "Parsing checkpoint created by deepspeed", "Detected checkpoint of type",
                 "Reconstructed", "Saving checkpoint shards"):  # zero_to_fp32's, not the export's
        assert line not in said.out + said.err, line
    assert_generates_with_the_cache(out)  # an export of a checkpoint: training's use_cache=false was kept
    model = AutoModelForCausalLM.from_pretrained(out)
    assert next(model.parameters()).dtype == torch.bfloat16
    card = (out / "README.md").read_text()
    assert "DeepSpeed ZeRO checkpoint" in card and "| step | 6 |" in card and "| dtype | bf16 |" in card
    report = (out / "export_report.md").read_text()
    assert "perplexity on the CPython docs' held-out documents: the export" in report and "tokens/s" in report
    assert "at training time (the run's own held-out blocks)" in report  # the checkpoint's evaluation, named apart


def test_lora_run_checkpoint_merges_to_its_final_model(tiny_base, chatml_file, data_cache, tmp_path, export, capsys):
    """A ChatML fine-tune of a base whose tokenizer lacks ChatML's markers (model.new_tokens=[template]): its checkpoint
    and its adapter merge to final/, the adapter loads by peft alone, and the GGUF carries the tokens."""
    from peft import PeftModel

    out = tmp_path / "lora"
    said = run_recipe("finetune", [*FT_TINY, f"model.path={tiny_base}", "data.format=chat",
                                   f"data.chat_template={chatml_file}", "model.new_tokens=[template]",
                                   "train.max_steps=2", "checkpoint.every=2", f"output_dir={out}"],
                      nproc=1, cache=data_cache, config="finetune_smollm2_lora.yaml").stdout
    assert ("model.new_tokens: added 2 tokens (<|im_start|>, <|im_end|>), their embedding (tied to the head) rows set "
            "to the mean of the existing") in said and "the rows of model.new_tokens on embed_tokens" in said
    tokenizer = AutoTokenizer.from_pretrained(out / "adapter")
    ids = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert ids == [len(tokenizer) - 2, len(tokenizer) - 1]
    assert AutoTokenizer.from_pretrained(out / "final").get_vocab() == tokenizer.get_vocab()
    assert_generates_with_the_cache(out / "final")
    final = AutoModelForCausalLM.from_pretrained(out / "final")
    assert final.config.vocab_size == len(tokenizer)
    # what a user does with adapter/ and peft alone: the base resized to the adapter's tokenizer, then the adapter
    base = AutoModelForCausalLM.from_pretrained(tiny_base)
    base.resize_token_embeddings(len(tokenizer))
    alone = PeftModel.from_pretrained(base, out / "adapter")
    torch.testing.assert_close(logits(alone), logits(final), atol=1e-4, rtol=0)
    for saved in ("final", "adapter"):  # the template the run trained with, which every export then carries
        assert AutoTokenizer.from_pretrained(out / saved).chat_template == chatml_file.read_text(), saved
    source = resolve_source(out, "step-2")
    with warnings.catch_warnings(record=True) as said:  # no library noise (peft's "base was renamed")
        warnings.simplefilter("always")
        # as toolkit/__init__ drops it (pytest's own filters replace the toolkit's)
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing`", category=FutureWarning)
        model, _, notes = load_model(source, merge_lora=True)
    assert [str(w.message) for w in said] == []
    assert any("merged its" in n for n in notes)
    torch.testing.assert_close(logits(model), logits(AutoModelForCausalLM.from_pretrained(out / "final")), atol=1e-4, rtol=0)
    # the adapter folder on the same base gives the same merged model
    merged, _, _ = load_model(resolve_source(out / "adapter"), merge_lora=True)
    torch.testing.assert_close(logits(merged), logits(model), atol=1e-4, rtol=0)
    # the GGUF of final/ holds the new tokens, as control tokens (special)
    import gguf

    code = export.main(["--from", str(out / "final"), "--format", "gguf", "--output", str(tmp_path / "t.gguf")])
    assert code == 0, capsys.readouterr().err
    reader = gguf.GGUFReader(tmp_path / "t.gguf")
    tokens, types = reader.get_field("tokenizer.ggml.tokens"), reader.get_field("tokenizer.ggml.token_type")
    for i in ids:
        assert tokens.contents(i) in ("<|im_start|>", "<|im_end|>") and types.contents(i) == gguf.TokenType.CONTROL

    assert "holds a LoRA model; export it with --merge-lora" in error_line(
        export, capsys, "--from", str(out), "--checkpoint", "step-2", "--output", str(tmp_path / "x"))
    # one flipped bit in the checkpoint's weights, or in the adapter's: its manifest names the file
    for damaged, weights in [(out / "checkpoints" / "step-2", "model.safetensors"),
                             (out / "adapter", "adapter_model.safetensors")]:
        flip_a_bit(damaged / weights)
        err = error_line(export, capsys, "--from", str(damaged), "--merge-lora", "--output", str(tmp_path / "x"))
        assert f"{damaged / weights} does not match its checksum" in err
    assert not (tmp_path / "x").exists()


def flip_a_bit(path: Path, offset: int = -100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(data)


def tree(root: Path) -> dict[str, bytes | None]:
    return {p.relative_to(root).as_posix(): None if p.is_dir() else p.read_bytes() for p in sorted(root.rglob("*"))}


def test_lora_adapter_merge_equals_base_plus_adapter(tiny_base, tmp_path, export, capsys):
    from peft import PeftModel

    saved_lora(tiny_base, tmp_path / "adapter", std=0.05)
    expected = logits(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_base), tmp_path / "adapter"))
    out = tmp_path / "merged"
    code = export.main(["--from", str(tmp_path / "adapter"), "--base", str(tiny_base), "--merge-lora", "--format", "hf",
                        "--output", str(out)])
    assert code == 0, capsys.readouterr().err
    assert_generates_with_the_cache(out)
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    base = shutil.copytree(tiny_base, tmp_path / "base")
    assert f"--output {base} is the LoRA's base {base}, which the export reads" in error_line(
        export, capsys, "--from", str(tmp_path / "adapter"), "--base", str(base), "--merge-lora", "--output",
        str(base), "--overwrite")
    torch.testing.assert_close(logits(merged), expected, atol=1e-4, rtol=0)


def error_line(export, capsys, *args) -> str:
    code = export.main(list(args))
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_bad_input_is_one_line(export, capsys, tmp_path, tiny_base):
    out = str(tmp_path / "out")
    assert "--from /nowhere does not exist" in error_line(export, capsys, "--from", "/nowhere", "--output", out)
    (tmp_path / "junk").mkdir()
    assert "is not a model, run, checkpoint or adapter folder" in error_line(
        export, capsys, "--from", str(tmp_path / "junk"), "--output", out)
    step = tmp_path / "run" / "checkpoints" / "step-4"
    step.mkdir(parents=True)
    (step / "random_states_0.pkl").write_bytes(b"")
    assert "incomplete checkpoint" in error_line(export, capsys, "--from", str(step), "--output", out)
    (step / "trainer_state.json").write_text('{"step": 4}')
    assert "checkpoint from an unknown save" in error_line(export, capsys, "--from", str(step), "--output", out)
    assert "--checkpoint step-9 is not in" in error_line(
        export, capsys, "--from", str(tmp_path / "run"), "--checkpoint", "step-9", "--output", out)
    assert "is not offered for gguf; choose one of" in error_line(
        export, capsys, "--from", str(tiny_base), "--format", "gguf", "--quant", "q3_zz", "--output", out + ".gguf")
    (tmp_path / "exists").mkdir()
    assert "exists; choose another path or pass --overwrite" in error_line(
        export, capsys, "--from", str(tiny_base), "--output", str(tmp_path / "exists"))
    (tmp_path / "model.Modelfile").write_text("FROM ./model.gguf\n")  # from an export whose .gguf was moved
    assert "model.Modelfile is in the way and was not written by an export" in error_line(
        export, capsys, "--from", str(tiny_base), "--format", "gguf", "--output", str(tmp_path / "model.gguf"))


# every wrong flag: argv after --from MODEL (or the whole argv when it starts with no --from), and the line
FLAGS = {
    "unknown format": (["--format", "onnx", "--output", "{out}"],
                       "argument --format: invalid choice: 'onnx' (choose from 'hf', 'gguf', 'int8', 'int4'); "
                       "see python recipes/export.py --help"),
    "unknown dtype": (["--dtype", "int3", "--output", "{out}"], "argument --dtype: invalid choice: 'int3'"),
    "no --from": ([None, "--output", "{out}"], "the following arguments are required: --from; see python recipes/export.py --help"),
    "no --output": ([], "the following arguments are required: --output"),
    "gguf output without .gguf": (["--format", "gguf", "--output", "{out}"], "--output {out} must end in .gguf for --format gguf"),
    "quant without gguf": (["--quant", "q8_0", "--output", "{out}"], "--quant applies to --format gguf only; for hf leave it out"),
    "dtype without hf": (["--format", "gguf", "--dtype", "bf16", "--output", "{out}.gguf"],
                         "--dtype applies to --format hf only; for gguf leave it out"),
    "shard size that is not a size": (["--max-shard-size", "lots", "--output", "{out}"],
                                      "--max-shard-size 'lots' is not a size; write it like 500MB or 2GB"),
    "base that does not exist": (["--merge-lora", "--base", "/nowhere", "--output", "{out}"],
                                 "--base /nowhere is not a folder; give the base model folder of the LoRA adapter"),
    "base of a model that is not an adapter": (["--base", "{model}", "--output", "{out}"],
                                               "--base applies to a LoRA adapter folder; Hugging Face model folder {model} "
                                               "is not one, leave --base out"),
    "eval text missing": (["--eval-text", "/nowhere.txt", "--output", "{out}"], "--eval-text /nowhere.txt does not exist"),
    "eval text not UTF-8": (["--eval-text", "{tmp}/latin1.txt", "--output", "{out}"],
                            "--eval-text {tmp}/latin1.txt is not UTF-8 text (byte 0xe9 at offset 3, line 1); re-encode it "
                            "as UTF-8, e.g. iconv -f latin1 -t utf-8"),
    "eval text too short": (["--eval-text", "{tmp}/short.txt", "--output", "{out}"],
                            "--eval-text {tmp}/short.txt: the held-out text has 2 tokens; it needs at least 256; give a "
                            "longer text"),
    "output under /proc": (["--output", "/proc/x/model"],
                           "--output /proc/x/model cannot be created: /proc does not accept new entries (No such file or "
                           "directory)"),
    "output under a file": (["--output", "{tmp}/latin1.txt/model"],
                            "--output {tmp}/latin1.txt/model cannot be created: {tmp}/latin1.txt is a file, not a folder"),
}


@pytest.mark.parametrize("case", FLAGS)
def test_every_wrong_flag_is_one_line(export, capsys, tmp_path, model_folder, case):
    """argparse's own refusals included: one `error:` line and exit code 2, not its usage block."""
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9\n".encode("latin-1"))
    (tmp_path / "short.txt").write_text("hi")
    args, expected = FLAGS[case]
    fill = {"out": str(tmp_path / "out"), "model": str(model_folder), "tmp": str(tmp_path)}
    argv = args[1:] if args[:1] == [None] else ["--from", str(model_folder), *args]
    err = error_line(export, capsys, *(a.format(**fill) for a in argv))
    assert err.startswith("error: " + expected.format(**fill)), err
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.gguf").exists()


# every option of export.py by kind (tests/support/wrong_arguments.py lists each kind's wrong values), and the other options
# its wrong values are refused with (--quant names a tensor type under --format gguf)
KINDS = {"--from": "folder", "--checkpoint": "name", "--format": "choice", "--quant": "name", "--dtype": "choice",
         "--merge-lora": "switch", "--base": "folder", "--max-shard-size": "size", "--output": "output",
         "--overwrite": "switch", "--eval-text": "file", "-h": "help"}
WITH = {"--quant": ["--format", "gguf", "--output", "{tmp}/out.gguf"]}


def test_every_option_of_export_has_a_kind(export):
    """A new option fails here until KINDS says what it takes; every option naming a path expands ~ and $VAR."""
    found = {action.option_strings[0] for action in export.parser()._actions}
    assert found == set(KINDS)
    assert set(export.PATH_OPTIONS) == {o for o, kind in KINDS.items() if kind in ("file", "folder", "output")}


@pytest.mark.parametrize("option, case", wrong_arguments.cases(KINDS))
def test_every_wrong_value_of_every_option_is_one_line(export, capsys, tmp_path, model_folder, monkeypatch, option, case):
    monkeypatch.delenv(wrong_arguments.UNSET, raising=False)
    (tmp_path / "file.txt").write_text("x")
    fill = {"tmp": str(tmp_path), "file": str(tmp_path / "file.txt")}
    argv, value = wrong_arguments.argv_of(option, KINDS[option], case, fill)
    base = {"--from": str(model_folder), "--output": str(tmp_path / "out")}
    context = [a.format(**fill) for a in WITH.get(option, [])]
    base = [a for o, v in base.items() if o != option and o not in context for a in (o, v)]
    code = export.main([*base, *context, *argv])
    out, err = capsys.readouterr()
    wrong_arguments.assert_one_line(code, out, err, option, value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt"]  # nothing written


def test_paths_are_taken_as_users_write_them(export, tmp_path, monkeypatch):
    """~ and $VAR in the path options, as a shell leaves them in quotes or after `=`: expanded once, as config paths."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("EXPORTS", str(tmp_path / "exports"))
    args = export.parse_args(["--from=~/run", "--output", "${EXPORTS}/m", "--eval-text", "$EXPORTS/t.txt", "--base", "~"])
    assert (args.source, args.output, args.eval_text, args.base) == (
        f"{tmp_path}/run", f"{tmp_path}/exports/m", f"{tmp_path}/exports/t.txt", str(tmp_path))


def test_merge_lora_on_a_full_model_says_there_was_nothing_to_merge(export, capsys, tmp_path, model_folder):
    assert export.main(["--from", str(model_folder), "--merge-lora", "--output", str(tmp_path / "out")]) == 0
    assert f"--merge-lora: Hugging Face model folder {model_folder} is a full model; there was nothing to merge" in (
        capsys.readouterr().out
    )


def test_a_failed_export_leaves_nothing_under_the_output_name(export, capsys, tiny_base, tmp_path, monkeypatch):
    from transformers import PreTrainedTokenizerBase

    def broken(*args, **kwargs):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", broken)
    out = tmp_path / "out"
    assert export.main(["--from", str(tiny_base), "--format", "hf", "--output", str(out)]) == 5
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: export could not be written: disk full (simulated)"), err
    assert not out.exists() and list(tmp_path.iterdir()) == []  # nor the hidden folder it was made in


def test_overwrite_replaces_an_earlier_export_and_nothing_else(export, capsys, tmp_path, model_folder):
    """Issue 26: --overwrite onto a folder of the user's own deleted it (thesis.tex, figs/)."""
    from toolkit.export.destination import EXPORTED_BY
    from toolkit.run.manifest import written_by

    thesis = tmp_path / "thesis"
    (thesis / "figs").mkdir(parents=True)
    (thesis / "thesis.tex").write_text("\\documentclass{article}")
    (thesis / "figs" / "loss.pdf").write_bytes(b"%PDF")
    before = tree(thesis)
    err = error_line(export, capsys, "--from", str(model_folder), "--output", str(thesis), "--overwrite")
    assert err == (f"error: --output {thesis} holds files that no export wrote (figs/, thesis.tex); --overwrite "
                   "replaces only an earlier export, and will not delete them; choose another --output")
    assert tree(thesis) == before

    # an export's own folder and GGUF are replaced by the next export, whole; the user's
    # hf.tmp and hf.old beside it are not touched (the folder writer's own temporary names)
    for kept in ("hf.tmp", "hf.old"):
        (tmp_path / kept).mkdir()
        (tmp_path / kept / "mine.txt").write_text("mine")
    for out, fmt in [(tmp_path / "hf", "hf"), (tmp_path / "m.gguf", "gguf")]:
        for _ in range(2):
            code = export.main(["--from", str(model_folder), "--format", fmt, "--output", str(out), "--overwrite"])
            assert code == 0, capsys.readouterr().err
    assert written_by(tmp_path / "hf") == EXPORTED_BY
    assert sorted(p.name for p in tmp_path.iterdir()) == [  # no staging folder left behind
        "hf", "hf.old", "hf.tmp", "m.Modelfile", "m.gguf", "m.gguf.export_report.md", "thesis"]
    assert (tmp_path / "hf.old" / "mine.txt").is_file() and (tmp_path / "hf.tmp" / "mine.txt").is_file()

    # never what it reads, nor a file that no export wrote
    (tmp_path / "notes.gguf").write_text("mine")
    assert f"--output {tmp_path}/notes.gguf is not a GGUF that an export wrote" in error_line(
        export, capsys, "--from", str(model_folder), "--format", "gguf", "--output", str(tmp_path / "notes.gguf"),
        "--overwrite")
    assert (tmp_path / "notes.gguf").read_text() == "mine"
    hf = tmp_path / "hf"
    assert f"--output {hf} is --from {hf}, which the export reads" in error_line(
        export, capsys, "--from", str(hf), "--output", str(hf), "--overwrite")
    assert f"--output {hf}/sub is inside --from {hf}" in error_line(
        export, capsys, "--from", str(hf), "--output", str(hf / "sub"))


def a_checkpoint(model_folder: Path, folder: Path) -> Path:
    """A one-process checkpoint as training saves it: weights, model_files/, manifest, state last."""
    from toolkit.checkpoint.trainer_state import TrainerState
    from toolkit.run.folder import checkpoint_step
    from toolkit.run.manifest import crc32, write_manifest

    (folder / "model_files").mkdir(parents=True)
    for f in model_folder.iterdir():
        shutil.copy(f, folder / ("" if f.name == "model.safetensors" else "model_files") / f.name)
    (folder / "optimizer.bin").write_bytes(b"adam state")
    TrainerState(step=checkpoint_step(folder), manifest_crc32=crc32(write_manifest(folder))).write(folder)
    return folder


def test_a_checkpoint_with_a_flipped_bit_is_refused_naming_the_file(export, capsys, tmp_path, model_folder):
    """Issue 26: exit 0 and no warning; resume checks the manifest, export did not."""
    run = tmp_path / "run"
    a_checkpoint(model_folder, run / "checkpoints" / "step-2")
    step4 = a_checkpoint(model_folder, run / "checkpoints" / "step-4")
    flip_a_bit(step4 / "model.safetensors")
    for args in (["--from", str(run), "--checkpoint", "step-4"], ["--from", str(run)], ["--from", str(step4)]):
        err = error_line(export, capsys, *args, "--output", str(tmp_path / "out"))
        assert f"{step4}/model.safetensors does not match its checksum" in err
        assert err.endswith(f"export an earlier checkpoint (--from {run} --checkpoint step-2)")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("manifest", ["with its manifest", "without a manifest (older runs)"])
@pytest.mark.parametrize("lost", ["model.safetensors", "tokenizer.json"])
def test_a_final_folder_that_lost_a_file_is_one_line(lost, manifest, export, capsys, tiny_base, tmp_path):
    """Issue 26: a traceback each (the lost tokenizer one blamed sentencepiece)."""
    run = shutil.copytree(tiny_base.parent, tmp_path / "run")
    assert (run / "final" / "manifest.json").is_file()  # final/ is written with one
    (run / "final" / lost).unlink()
    if manifest.startswith("without"):
        (run / "final" / "manifest.json").unlink()
    err = error_line(export, capsys, "--from", str(run), "--output", str(tmp_path / "out"))
    named = {"model.safetensors": f"{run}/final has a config.json but no weights",
             "tokenizer.json": f"{run}/final/tokenizer.json is missing (the folder has no tokenizer)"}
    assert (f"{run}/final/{lost} is missing" if manifest.startswith("with ") else named[lost]) in err, err


@pytest.mark.distributed
def test_gguf_export_of_a_run_with_report_and_modelfile(export, runs, tmp_path, capsys):
    import gguf

    out = tmp_path / "tiny-q8_0.gguf"
    code = export.main(["--from", str(runs["zero2"]), "--format", "gguf", "--quant", "q8_0", "--output", str(out)])
    assert code == 0, capsys.readouterr().err
    reader = gguf.GGUFReader(out)
    assert reader.get_field("general.architecture").contents() == "llama"
    assert "\nFROM ./tiny-q8_0.gguf\n" in (tmp_path / "tiny-q8_0.Modelfile").read_text()
    report = (tmp_path / "tiny-q8_0.gguf.export_report.md").read_text()
    change = float(report.split("| change | ")[1].split("%")[0])
    assert abs(change) < 2.0, report  # q8_0 within 2% of the fp32 source


def test_gguf_of_an_architecture_the_writer_does_not_support(export, capsys, tmp_path, tiny_tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=len(tiny_tokenizer))).save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    err = error_line(export, capsys, "--from", str(folder), "--format", "gguf", "--output", str(tmp_path / "g.gguf"))
    # the user's folder, not the staged copy it used to name (export-XXXX/model), before any work
    assert err == (f"error: Hugging Face model folder {folder} holds a GPT2LMHeadModel; GGUF export supports "
                   "LlamaForCausalLM, Qwen2ForCausalLM")
    assert not (tmp_path / "g.gguf").exists() and not list(tmp_path.glob("export-*"))


def test_a_modelfile_that_would_stop_elsewhere_fails_the_export(export, capsys, tiny_base, tmp_path, monkeypatch):
    from toolkit.export import modelfile

    written = modelfile.write_modelfile

    def wrong_stop(gguf_file, folder):
        path = written(gguf_file, folder)
        path.write_text(path.read_text().replace('PARAMETER stop "<|endoftext|>"', 'PARAMETER stop "</s>"'))
        return path

    monkeypatch.setattr(modelfile, "write_modelfile", wrong_stop)
    out = tmp_path / "tiny.gguf"
    err = error_line(export, capsys, "--from", str(tiny_base), "--format", "gguf", "--output", str(out))
    assert err.startswith('error: the export would not stop where its source does: tiny.Modelfile lacks PARAMETER '
                          'stop "<|endoftext|>", where the source stops; nothing was written'), err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_weight_only_export_loads_and_generates(scheme, export, tiny_base, tmp_path, capsys):
    installed.module("torchao", "quant")
    out = tmp_path / scheme
    code = export.main(["--from", str(tiny_base), "--format", scheme, "--output", str(out)])
    assert code == 0, capsys.readouterr().err
    assert_generates_with_the_cache(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.quantization_config is not None
    ids = torch.tensor([[1, 2, 3]])
    assert model.generate(ids, max_new_tokens=4, do_sample=False).shape[1] == 7
    report = (out / "export_report.md").read_text()
    change = float(report.split("| change | ")[1].split("%")[0])
    assert abs(change) < (2.0 if scheme == "int8" else 15.0), report
    # it names where the export is, never the staging folder it was made in (gone once moved into place)
    assert f"wrote {out} (" in report, report
    named = re.findall(rf"{re.escape(str(tmp_path))}[^\s,;()]*", report + capsys.readouterr().out)
    assert named and all(Path(path).exists() for path in named), named


def test_hf_export_shards_above_the_size_limit(export, tiny_base, tmp_path, capsys):
    out = tmp_path / "sharded"
    code = export.main(["--from", str(tiny_base), "--format", "hf", "--max-shard-size", "100KB", "--output", str(out)])
    assert code == 0, capsys.readouterr().err
    assert len(list(out.glob("model-*.safetensors"))) > 1 and (out / "model.safetensors.index.json").is_file()
    report = (out / "export_report.md").read_text()  # the stops: on the run's own prompts, the same tokens
    assert "## Stops" in report and f"samples.prompts of the run ({tiny_base / 'README.md'})" in report, report
    assert "| The for statement | 32 tokens, no stop within 32 | same 32 tokens, neither stopped within 32 |" in report, report
    torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(out)),
                               logits(AutoModelForCausalLM.from_pretrained(tiny_base)), atol=0, rtol=0)
