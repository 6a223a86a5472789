"""Bad input to the pretraining recipe: one clear line on stderr, exit code 2, nothing lost."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
from pathlib import Path

import pytest
from recipe_runner import ROOT, TINY, run_recipe

from toolkit.run.folder import RunDir
from toolkit.training.metrics import read_metrics


@pytest.fixture(scope="module")
def pretrain():
    spec = importlib.util.spec_from_file_location("pretrain_recipe", ROOT / "recipes" / "pretrain.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_main(pretrain, capsys, monkeypatch, tmp_path, *overrides) -> str:
    monkeypatch.setenv("LLM_TOOLKIT_CACHE", str(tmp_path / "cache"))
    argv = ["--config", str(ROOT / "recipes/configs/pretrain_tiny.yaml"), *TINY, *overrides]
    if not any(o.startswith("output_dir=") for o in overrides):
        argv.append(f"output_dir={tmp_path / 'out'}")
    assert pretrain.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, err  # progress bars of datasets may come before it
    return errors[0]


CASES = {
    "misspelled key": (["train.max_stepz=3"], "unknown key train.max_stepz; did you mean train.max_steps?"),
    "unknown section": (["optimizer.lr=1"], "unknown key optimizer; did you mean optim?"),
    "wrong type": (["train.max_steps=many"], "train.max_steps must be an integer, found 'many'"),
    "bad choice": (["optim.schedule=cosin"], "optim.schedule='cosin' is not one of cosine, linear, constant; did you mean cosine?"),
    "unknown architecture key": (["model.config.hidden_sise=8"], "model.config.hidden_sise is not a llama config key; did you mean hidden_size?"),
    "missing data path": (["data.path=/nonexistent/corpus.txt"], "data.path=/nonexistent/corpus.txt does not exist"),
    "seq_len over max positions": (["data.seq_len=512", "model.config.max_position_embeddings=256"], "data.seq_len=512 is larger than the model's max positions (256)"),
    "batch sizes do not divide": (["train.global_batch_size=10", "train.micro_batch_size=4"], "train.global_batch_size=10 is not divisible by train.micro_batch_size=4"),
    "attention that cannot keep packed documents apart": (["model.attn_implementation=sdpa_paged"],
                                                          "cannot keep packed documents apart"),
    "fp16 on a CPU": (["train.mixed_precision=fp16"], "train.mixed_precision=fp16 needs a GPU"),
    # model.compile=none too: the machine is said first (was "slower than bf16 without torch.compile", then the CPU)
    "fp8 on a CPU": (["train.mixed_precision=fp8", "model.compile=none"],
                     "train.mixed_precision=fp8 needs an NVIDIA GPU of compute capability 8.9 or newer (Ada, Hopper); "
                     "this run is on cpu: use bf16"),
    "tracker not installed": (["logging.trackers=[tensorboard,wandb]"], "logging.trackers has wandb, but the wandb package is not installed"),
    "out of range": (["train.max_steps=-1"], "train.max_steps=-1 must be at least 1"),
    "profile: one step": (["logging.profile=[3]"], "logging.profile=[3]: give two step numbers, [FIRST, LAST]"),
    "profile: backwards": (["logging.profile=[4, 2]"], "logging.profile=[4, 2]: use 1 <= FIRST <= LAST"),
    "profile: past the run": (["train.max_steps=4", "logging.profile=[3, 5]"],
                              "logging.profile=[3, 5] ends after train.max_steps=4: trace steps the run takes"),
    "non-finite number": (["optim.lr=nan"], "optim.lr must be a finite number, found 'nan'"),
    "mixture: a negative weight": (["data.sources=[{name: web, weight: -0.2}, {name: docs}]"],
                                   "data.sources[0].weight=-0.2 (web) must be at least 0"),
    "mixture: weights summing to 0": (["data.sources=[{name: web, weight: 0}, {name: docs, weight: 0}]"],
                                      "data.sources: the weights sum to 0; give at least one source a positive weight"),
    "mixture: two sources of one name": (["data.sources=[{name: web}, {name: web, path: x.txt}]"],
                                         "data.sources: 2 sources are named web; give each its own name"),
    "mixture: a stage naming no source": (["data.sources=[{name: web}]", "data.stages=[{start_step: 9, weights: {cod: 1}}]"],
                                          "data.stages[0].weights names cod, which is not a source (the sources: web)"),
    "mixture: stages out of order": (["data.sources=[{name: web}, {name: code}]",
                                      "data.stages=[{start_step: 50, weights: {code: 1}}, {start_step: 20, weights: {web: 1}}]"],
                                     "data.stages[1].start_step=20 is not after the stage before it (start_step=50); list "
                                     "the stages in the order they start"),
    "mixture: a stage turning every source off": (["data.sources=[{name: web}]", "data.stages=[{start_step: 5, weights: {web: 0}}]"],
                                                  "data.stages[0]: the weights from step 5 on sum to 0"),
    "mixture: a name that cannot be a metric key": (["data.sources=[{name: web/en}]"],
                                                    "data.sources[0].name='web/en' must be letters, digits, '_', '.' or '-'"),
    "mixture: a stage at step 0": (["data.sources=[{name: web}]", "data.stages=[{start_step: 0, weights: {web: 2}}]"],
                                   "data.stages[0].start_step=0 must be at least 1 (steps count from 1, as the logs do)"),
    "mixture: a source's path that is not there": (["data.sources=[{name: docs}, {name: web, path: /nonexistent/web.txt}]"],
                                                   "data.sources[1].path=/nonexistent/web.txt does not exist"),
    "mixture and data.path": (["data.path=corpus.txt", "data.sources=[{name: web}]"],
                              "data.path=corpus.txt and sources are both set; list it in data.sources as one more source "
                              "and leave data.path empty (data.path=), or drop data.sources"),
    "architecture without a causal LM": (["model.model_type=t5"], "model.model_type=t5 has no causal LM in transformers (it "
                                         "is not a text decoder); use one that has, e.g. llama, gpt2, qwen2, mistral"),
}


@pytest.mark.parametrize("name", CASES)
def test_bad_config_gives_one_line(pretrain, capsys, monkeypatch, tmp_path, name):
    overrides, message = CASES[name]
    if name == "tracker not installed":  # wandb is absent here whether or not this machine has it
        import accelerate.tracking

        available = [t for t in accelerate.tracking.get_available_trackers() if str(t) != "wandb"]
        monkeypatch.setattr(accelerate.tracking, "_available_trackers", available)
    err = run_main(pretrain, capsys, monkeypatch, tmp_path, *overrides)
    assert message in err


LAUNCHED_PRECISION = {  # ACCELERATE_MIXED_PRECISION: what `accelerate launch` sets from its config or --mixed_precision
    "fp16 on a CPU": ("fp16", [], "error: the accelerate launch's mixed_precision=fp16 needs a GPU; this machine has "
                      "none (use auto or no for fp32, or bf16)"),
    "against the recipe": ("bf16", ["train.mixed_precision=no"], "error: the accelerate launch's mixed_precision is "
                           "bf16 (its config file or --mixed_precision) and train.mixed_precision=no: they contradict "
                           "each other; keep one (the shipped accelerate configs say \"no\" so that "
                           "train.mixed_precision decides)"),
    "fp8": ("fp8", [], "error: the accelerate launch's mixed_precision is fp8; the toolkit trains in bf16, fp16, fp8 "
            "or fp32 as train.mixed_precision says: set mixed_precision \"no\" in the accelerate config (and drop "
            "--mixed_precision), then choose with train.mixed_precision (fp8: train.mixed_precision=fp8)"),
    # mixed_precision: bf16 in zero3.yaml: Accelerate refused it in 5 lines of a ValueError traceback
    "beside a DeepSpeed JSON": ("bf16", [], "error: the accelerate config sets mixed_precision beside "
                                "deepspeed_config_file, which decides them: remove them from the accelerate config "
                                "(precision: train.mixed_precision; the DeepSpeed JSON's \"auto\" values follow the "
                                "recipe)"),
}


@pytest.mark.parametrize("name", LAUNCHED_PRECISION)
def test_a_precision_the_launch_asks_for_is_honoured_or_refused(pretrain, capsys, monkeypatch, tmp_path, name):
    """`mixed_precision: fp16` in the accelerate config (or --mixed_precision fp16) trained in fp32 and
    said precision=fp32: Accelerate takes the Accelerator's argument over the launcher's."""
    launched, overrides, line = LAUNCHED_PRECISION[name]
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", launched)
    if name == "beside a DeepSpeed JSON":  # what accelerate launch sets for it (one process: no process group)
        monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
        monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(ROOT / "ds_configs/zero3.json"))
        monkeypatch.setenv("ACCELERATE_CONFIG_DS_FIELDS", "deepspeed_config_file,zero3_init_flag,mixed_precision")
    assert run_main(pretrain, capsys, monkeypatch, tmp_path, *overrides) == line
    assert not (tmp_path / "out").exists()


def test_bf16_from_the_launch_trains_in_bf16_and_says_so(pretrain, capsys, monkeypatch, tmp_path, data_cache):
    from accelerate.state import AcceleratorState

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    monkeypatch.setenv("LLM_TOOLKIT_CACHE", str(data_cache))
    argv = ["--config", str(ROOT / "recipes/configs/pretrain_tiny.yaml"), *TINY, "train.max_steps=1",
            "eval.every=0", "checkpoint.every=0", f"output_dir={tmp_path / 'out'}"]
    AcceleratorState._reset_state(True)  # a new launch: this process's earlier runs were fp32
    try:
        assert pretrain.main(argv) == 0
    finally:
        AcceleratorState._reset_state(True)
        # it outlived monkeypatch's undo: later tests in this worker then built bf16 accelerators and failed
        os.environ.pop("ACCELERATE_MIXED_PRECISION", None)
    out = capsys.readouterr()
    assert "precision=bf16 (the accelerate launch's mixed_precision) device=cpu" in out.out + out.err


def test_all_problems_are_reported_at_once(pretrain, capsys, monkeypatch, tmp_path):
    argv = ["--config", str(ROOT / "recipes/configs/pretrain_tiny.yaml"), "train.max_stepz=3", "optim.lr=-1",
            "data.val_fraction=2"]
    assert pretrain.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: 3 problems in the config:"), err
    assert "train.max_stepz" in err and "optim.lr=-1.0 must be positive" in err and "data.val_fraction=2.0" in err


def test_empty_corpus(pretrain, capsys, monkeypatch, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    err = run_main(pretrain, capsys, monkeypatch, tmp_path, f"data.path={empty}")
    assert "holds no text" in err
    blank = tmp_path / "blank.jsonl"
    blank.write_text(json.dumps({"text": "   "}) + "\n")
    err = run_main(pretrain, capsys, monkeypatch, tmp_path, f"data.path={blank}")
    assert "holds no text (0 non-empty documents)" in err


def test_a_stream_held_out_whole_is_refused(pretrain, capsys, monkeypatch, tmp_path):
    """data.streaming cannot count the documents ahead: holding out more than there are says so."""
    err = run_main(pretrain, capsys, monkeypatch, tmp_path, "data.streaming=true", "data.stream_val_documents=100")
    assert err == ("error: data.stream_val_documents=100 holds out the whole stream (79 documents) and leaves none "
                   "to train on; lower it (e.g. 3) or set data.val_fraction=0")


def test_text_data_that_is_not_utf8(pretrain, capsys, monkeypatch, tmp_path):
    data = tmp_path / "corpus.txt"
    data.write_bytes("A first paragraph.\n\nA caf\u00e9 paragraph.\n".encode("latin-1"))  # é is byte 0xe9
    err = run_main(pretrain, capsys, monkeypatch, tmp_path, f"data.path={data}")
    assert err == (
        f"error: data.path={data} is not UTF-8 text (byte 0xe9 at offset 25, line 3); re-encode it as UTF-8, "
        "e.g. iconv -f latin1 -t utf-8"
    )


def bad_data(tmp_path: Path, kind: str) -> tuple[str, str]:
    """(data.path, the error line) for data the recipe cannot train on."""
    if kind == "binary file":
        path = tmp_path / "corpus.txt"
        path.write_bytes(b"\x1f\x8b\x08\x00" + bytes(range(256)))  # a gzip archive named .txt
        return str(path), f"{path} is not UTF-8 text (byte 0x8b at offset 1, line 1)"
    if kind == "jsonl with a wrong schema":
        path = tmp_path / "docs.jsonl"
        path.write_text("".join(json.dumps({"text": i}) + "\n" for i in range(4)))  # used to end in AttributeError
        return str(path), f"data.path={path}: record 0 has text=0 (int), not text; set data.text_column to a column of strings"
    if kind == "jsonl without the text column":
        path = tmp_path / "docs.jsonl"
        path.write_text(json.dumps({"body": "a document"}) + "\n")
        return str(path), f"data.text_column=text is not in {path}; its columns are ['body']"
    if kind == "one 10 MB document":
        path = tmp_path / "book.jsonl"
        path.write_text(json.dumps({"text": "word " * 2_000_000}) + "\n")
        return str(path), "the corpus has 1 document(s); cannot hold out 5% for validation and still train; add text or set data.val_fraction=0"
    if kind == "a pipe":  # would block a reader for ever; root reads past permission bits, so this stands for unreadable
        path = tmp_path / "corpus.txt"
        os.mkfifo(path)
        return str(path), f"data.path={path} is a pipe, socket or device, not a file or folder; give a file, a folder or a glob"
    if kind == "a broken symlink":
        path = tmp_path / "corpus.txt"
        path.symlink_to(tmp_path / "moved-away.txt")
        return str(path), f"data.path={path} is a broken symlink, not a file or folder; give a file, a folder or a glob"
    if kind == "a folder of binary files":
        (tmp_path / "data").mkdir()
        (tmp_path / "data" / "weights").write_bytes(b"\x00\x01\x02")
        return str(tmp_path / "data"), "and none of its 1 file(s) without an extension is UTF-8 text"
    assert kind == "a hub id while offline"
    return "org/corpus", "data.path=org/corpus (no local file or folder has that name) is read as a hub dataset id, but the Hub cannot be reached"


DATA = ["binary file", "jsonl with a wrong schema", "jsonl without the text column", "one 10 MB document", "a pipe",
        "a broken symlink", "a folder of binary files", "a hub id while offline"]


@pytest.mark.parametrize("kind", DATA)
def test_data_it_cannot_train_on(pretrain, capsys, monkeypatch, tmp_path, kind):
    if kind == "a hub id while offline":  # what a machine without network meets, without waiting for retries
        import datasets.config
        import huggingface_hub.constants

        monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    path, message = bad_data(tmp_path, kind)
    err = run_main(pretrain, capsys, monkeypatch, tmp_path, f"data.path={path}")
    assert message in err, err


def test_a_folder_of_license_style_files_trains(pretrain, capsys, monkeypatch, tmp_path):
    """Files without an extension are read as plain text; the binary ones are skipped and counted."""
    from pydoc_data.topics import topics

    folder = tmp_path / "texts"
    folder.mkdir()
    for i, key in enumerate(sorted(topics)[:40]):
        (folder / f"TOPIC{i:02d}").write_text(topics[key])
    (folder / "core").write_bytes(b"\x7fELF\x02\x01\x01\x00")  # a core dump beside them
    monkeypatch.setenv("LLM_TOOLKIT_CACHE", str(tmp_path / "cache"))
    argv = ["--config", str(ROOT / "recipes/configs/pretrain_tiny.yaml"), *TINY, "train.max_steps=2",
            "checkpoint.every=0", "eval.every=0", f"data.path={folder}", f"output_dir={tmp_path / 'run'}"]
    assert pretrain.main(argv) == 0, capsys.readouterr().err[-3000:]
    out = capsys.readouterr()
    assert (f"data: data.path={folder}: read 40 file(s) without an extension as plain text; skipped 1 that are "
            f"binary or not UTF-8 (first: {folder / 'core'}: a NUL byte at offset 7)") in out.out + out.err
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r] == [1, 2]


@pytest.mark.parametrize("kind", ["a file", "a missing path", "a folder that is not a checkpoint"])
def test_resume_from_something_that_is_not_a_checkpoint(pretrain, capsys, monkeypatch, tmp_path, kind):
    path = {"a file": tmp_path / "notes.txt", "a missing path": tmp_path / "gone" / "step-3",
            "a folder that is not a checkpoint": tmp_path / "figures"}[kind]
    if kind == "a file":
        path.write_text("mine")
    elif kind == "a folder that is not a checkpoint":
        path.mkdir()
        (path / "plot.pdf").write_bytes(b"%PDF")
    err = run_main(pretrain, capsys, monkeypatch, tmp_path, f"resume={path}")
    if kind == "a folder that is not a checkpoint":
        assert err.startswith(f"error: resume={path} is not a training checkpoint (no optimizer or RNG state)"), err
    elif kind == "a file":
        assert err == f"error: resume={path} is not a folder; give a checkpoints/step-N folder or resume=auto"
    else:
        assert err == f"error: resume={path} does not exist; give a checkpoints/step-N folder or resume=auto"



@pytest.mark.parametrize("where", ["/proc", "a file"])
def test_output_dir_that_cannot_be_created(pretrain, capsys, monkeypatch, tmp_path, where):
    if where == "/proc":  # the OS refuses; root passes permission bits, so /proc stands for any unwritable place
        out, reason = "/proc/x", "/proc does not accept new entries (No such file or directory); choose a writable output_dir"
    else:
        (tmp_path / "notes.txt").write_text("mine")
        out, reason = tmp_path / "notes.txt" / "run", f"{tmp_path / 'notes.txt'} is a file, not a folder; choose another output_dir"
    err = run_main(pretrain, capsys, monkeypatch, tmp_path, f"output_dir={out}")
    assert err == f"error: output_dir={out} cannot be created: {reason}"
    assert not (tmp_path / "cache").exists()  # refused before any data work


def test_output_dir_of_another_run_is_not_overwritten(pretrain, capsys, monkeypatch, tmp_path):
    out = tmp_path / "previous"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    err = run_main(pretrain, capsys, monkeypatch, tmp_path, f"output_dir={out}")
    assert "already holds a run (metrics.jsonl)" in err and "overwrite=true" in err
    assert "resume=auto" not in err  # no complete checkpoint: it would be refused too
    assert (out / "metrics.jsonl").read_text() == '{"step": 1, "loss": 3.0}\n'


def test_a_run_placed_where_another_run_deletes_is_refused(pretrain, capsys, monkeypatch, tmp_path):
    """Inside another run's checkpoints/, which its rotation and overwrite=true delete (toolkit.run.paths)."""
    other = tmp_path / "a"
    (other / "checkpoints" / "step-2").mkdir(parents=True)
    (other / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    out = other / "checkpoints" / "b"
    err = run_main(pretrain, capsys, monkeypatch, tmp_path, f"output_dir={out}")
    assert err == (f"error: output_dir={out} is inside the toolkit run {other} (its checkpoints/), which that run "
                   "deletes or replaces (rotation, overwrite=true); choose an output_dir outside it")
    assert not out.exists() and not (tmp_path / "cache").exists()  # refused before anything is written


def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished_run(pretrain, data_cache, tmp_path_factory) -> Path:
    """A finished 4-step run with its tensorboard logs, checkpointed only at the end."""
    out = tmp_path_factory.mktemp("finished") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LLM_TOOLKIT_CACHE", str(data_cache))
        argv = ["--config", str(ROOT / "recipes/configs/pretrain_tiny.yaml"), *TINY, "train.max_steps=4",
                "checkpoint.every=0", "logging.trackers=[tensorboard]", f"output_dir={out}"]
        assert pretrain.main(argv) == 0
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r] == [1, 2, 3, 4]
    return out


def test_a_finished_run_launched_again_is_kept_and_says_what_trains_more(pretrain, capsys, monkeypatch, tmp_path,
                                                                         finished_run):
    """The README's command run a second time: refused, the option that keeps the run told apart from the one that
    deletes it; with resume=auto (a changed learning rate too), the run is finished: it says so, what would train
    more, exits 0 and touches nothing (it said "taken from step 5 on" and trained nothing)."""
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    before = files(out)
    err = run_main(pretrain, capsys, monkeypatch, tmp_path, f"output_dir={out}", "train.max_steps=4")
    assert err == (f"error: output_dir={out} already holds a finished run of 4 steps (final/, checkpoints/, "
                   "metrics.jsonl and 2 more); to keep it and train on, raise train.max_steps with resume=auto; to "
                   "start over, overwrite=true (deletes it); or choose another output_dir")
    monkeypatch.setenv("LLM_TOOLKIT_CACHE", str(tmp_path / "cache"))
    argv = ["--config", str(ROOT / "recipes/configs/pretrain_tiny.yaml"), *TINY, "train.max_steps=4",
            f"output_dir={out}", "resume=auto", "optim.lr=1e-4"]
    assert pretrain.main(argv) == 0
    said = capsys.readouterr().err.strip().splitlines()
    assert said[-1] == (f"[pretrain] {out} is finished: it trained its 4 steps and wrote final/; nothing is left to "
                        "train, so nothing ran. To train on, raise train.max_steps (e.g. train.max_steps=8) with "
                        "resume=auto; to start over from the base, overwrite=true (deletes the run) or another output_dir")
    assert files(out) == before
    assert not (tmp_path / "cache").exists()  # said before any data work
    shutil.rmtree(out / "final")  # an output gone: resume=auto makes it again from the last checkpoint
    assert pretrain.main(argv[:-1]) == 0
    assert "is finished" not in capsys.readouterr().err and (out / "final" / "training_summary.json").is_file()


def test_resume_auto_does_not_restart_a_finished_run_without_checkpoints(pretrain, capsys, monkeypatch, tmp_path,
                                                                          finished_run):
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    shutil.rmtree(out / "checkpoints")
    before = files(out)
    err = run_main(pretrain, capsys, monkeypatch, tmp_path, f"output_dir={out}", "train.max_steps=3", "resume=auto")
    assert err.startswith(f"error: output_dir={out} holds a run (final/, metrics.jsonl, tensorboard/ and 1 more)")
    assert "no complete checkpoint" in err and "overwrite=true" in err, err
    assert files(out) == before  # final/ and metrics.jsonl byte for byte


def test_resume_with_another_model_shape(pretrain, capsys, monkeypatch, tmp_path, finished_run):
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    err = run_main(pretrain, capsys, monkeypatch, tmp_path, f"output_dir={out}", "train.max_steps=6", "resume=auto",
                   "model.config.hidden_size=128")
    assert err == (
        f"error: checkpoint {out / 'checkpoints' / 'step-4'} was trained with model.config.hidden_size=64 (this run has "
        "128: it decides the model's shape and which weights train); a resume cannot take the change: resume with the "
        "checkpoint's value, or start a new output_dir (model.path= its final/ or a checkpoint's weights for a fine-tune)"
    )


def test_overwrite_never_deletes_files_that_are_not_a_run(pretrain, capsys, monkeypatch, tmp_path):
    out = tmp_path / "thesis"
    (out / "figures").mkdir(parents=True)
    (out / "figures" / "plot.pdf").write_bytes(b"%PDF")
    (out / "thesis.tex").write_text("\\documentclass{article}")
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    before = files(out)
    err = run_main(pretrain, capsys, monkeypatch, tmp_path, f"output_dir={out}", "overwrite=true")
    assert err == (
        f"error: output_dir={out} holds files that are not a toolkit run (figures/, thesis.tex); the toolkit "
        "will not delete them or start a run among them; choose another output_dir"
    )
    assert files(out) == before and sorted(p.name for p in out.iterdir()) == ["figures", "metrics.jsonl", "thesis.tex"]


def test_overwrite_starts_a_finished_run_over(pretrain, capsys, monkeypatch, tmp_path, data_cache, finished_run):
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    # everything a finished run leaves is the toolkit's own, so overwrite=true may delete it
    assert RunDir(out).entries() == (["final/", "checkpoints/", "metrics.jsonl", "tensorboard/", "loss.png"], [])
    monkeypatch.setenv("LLM_TOOLKIT_CACHE", str(data_cache))
    argv = ["--config", str(ROOT / "recipes/configs/pretrain_tiny.yaml"), *TINY, "train.max_steps=2",
            "checkpoint.every=0", f"output_dir={out}", "overwrite=true"]
    assert pretrain.main(argv) == 0, capsys.readouterr().err[-3000:]
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r] == [1, 2]
    assert json.loads((out / "final" / "training_summary.json").read_text())["step"] == 2
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-2"]
    assert not (out / "tensorboard").exists()  # the old run's logs went with it (no tracker this time)


def test_incomplete_checkpoint_is_refused(pretrain, capsys, monkeypatch, tmp_path):
    partial = tmp_path / "run" / "checkpoints" / "step-4"
    partial.mkdir(parents=True)
    (partial / "model.safetensors").write_bytes(b"truncated")
    err = run_main(pretrain, capsys, monkeypatch, tmp_path, f"output_dir={tmp_path / 'new'}", f"resume={partial}")
    assert "is an incomplete checkpoint" in err
    # resume=auto skips it: an interrupted save is never resumed from

    assert RunDir(tmp_path / "run").resolve_resume("auto") is None


@pytest.mark.distributed
def test_two_process_launch_prints_the_error_first(tmp_path, data_cache):
    proc = run_recipe("pretrain", [*TINY, "train.max_stepz=3", f"output_dir={tmp_path}"], nproc=2,
                      cache=data_cache, check=False, launcher=True)
    assert proc.returncode != 0
    first = proc.stderr.strip().splitlines()[0]
    assert first == "error: unknown key train.max_stepz; did you mean train.max_steps?"
    assert "[rank0]: Traceback" not in proc.stderr and "[rank1]: Traceback" not in proc.stderr


# ---------------------------------------------------------------- sizes (issue 26)
HUGE = ["model.config.hidden_size=16384", "model.config.intermediate_size=53248", "model.config.num_hidden_layers=64",
        "model.config.num_attention_heads=128", "model.config.num_key_value_heads=8"]


def test_a_model_far_larger_than_the_machine_is_refused_before_it_is_built(pretrain, capsys, monkeypatch, tmp_path):
    """~200B parameters (an empty YAML gives transformers' 6.5B LLaMA): refused from its meta-device size,
    before any data work or allocation; built, the kernel's OOM killer stopped it after minutes."""
    def built(*args, **kwargs):
        raise AssertionError("the model was built")

    monkeypatch.setattr(pretrain, "build_model", built)
    line = run_main(pretrain, capsys, monkeypatch, tmp_path, *HUGE)
    assert line.startswith("error: model.config (llama, hidden_size=16384, intermediate_size=53248, ")
    assert re.search(r"\) has 20\d\.\dB parameters; training it needs ~3\d\d\d GB per process under single process "
                     r"\(weights, gradients and AdamW state, before activations\) and this machine has [\d.]+ GB available", line)
    assert line.endswith("or see python recipes/plan.py")
    assert not list((tmp_path / "cache").glob("packed-*"))  # no data was prepared


def test_a_model_with_no_layers_is_refused(pretrain, capsys, monkeypatch, tmp_path):
    """It trained and was saved; every degenerate size, of every architecture: tests/toolkit/models/test_scratch.py."""
    line = run_main(pretrain, capsys, monkeypatch, tmp_path, "model.config.num_hidden_layers=0")
    assert line == ("error: model.config.num_hidden_layers=0 must be at least 1 (with 0 the model has nothing to "
                    "train, or cannot be built)")
