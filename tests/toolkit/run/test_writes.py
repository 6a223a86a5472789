"""Every writer of toolkit.run.writes.WRITERS on a full disk: the table is complete against the source (every
write call in toolkit/ and recipes/ sits in a listed function), and each writer, failed with each type its
library raises (OSError ENOSPC and EIO, safetensors' SafetensorError, torch.save's RuntimeError, the tokenizers
library's bare Exception, a PicklingError), says its one line (error and exit code, or a warning and the run goes on) and leaves nothing
half-written that a later resume, export or run could take for complete. In one process, tiny models."""

from __future__ import annotations

import ast
import contextlib
import errno
import inspect
import json
import os
import pickle
from pathlib import Path

import datasets
import pytest
from accelerate.state import AcceleratorState
from one_process_trainer import packed_blocks, start_trainer  # tests/toolkit/training/

from toolkit.checkpoint.formats import Checkpoint
from toolkit.run.writes import NOT_WRITERS, WRITERS, WriteFailed, full_disk_errors

ROOT = Path(__file__).resolve().parents[3]
# the library calls that write a file (a method or function name), and open() with a mode that writes
WRITE_CALLS = {"save_file", "save", "savez", "savez_compressed", "save_pretrained", "save_state", "save_to_disk",
               "write_text", "write_bytes", "savefig", "export_chrome_trace", "dcp_to_torch_save", "copyfileobj",
               "dump", "to_parquet", "to_json", "write_tensors_to_file", "pwrite", "copytree", "copyfile", "copy2"}


def _writes(call: ast.Call) -> bool:
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if any(k.arg == "cache_file_name" for k in call.keywords):  # datasets' map writing its cache file
        return True
    if name in ("open", "OSFile", "fdopen"):
        modes = call.args[1:2] if isinstance(func, ast.Name) or name == "OSFile" else call.args[:1]
        modes = [*modes, *(k.value for k in call.keywords if k.arg == "mode")]
        return any(isinstance(m, ast.Constant) and isinstance(m.value, str) and set(m.value) & set("wax+") for m in modes)
    return name in WRITE_CALLS


def write_sites() -> dict[str, list[str]]:
    """module:qualname of each function of toolkit/ and recipes/ that calls a writing library call -> the calls."""
    found: dict[str, list[str]] = {}
    for path in sorted([*(ROOT / "toolkit").rglob("*.py"), *(ROOT / "recipes").glob("*.py")]):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)

        def visit(node, stack, module=module, path=path):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    visit(child, [*stack, child.name])
                    continue
                if isinstance(child, ast.Call) and _writes(child):
                    found.setdefault(f"{module}:{'.'.join(stack)}", []).append(f"{path.name}:{child.lineno}")
                visit(child, stack)

        visit(ast.parse(path.read_text()), [])
    return found


def defined_functions(module: str) -> set[str]:
    path = ROOT / (module.replace(".", "/") + ".py")
    names: set[str] = set()

    def visit(node, stack):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(".".join([*stack, child.name]))
                visit(child, [*stack, child.name])

    visit(ast.parse(path.read_text()), [])
    return names


def test_every_write_in_the_source_belongs_to_a_writer_in_the_table():
    """A new save_file / torch.save / open(..., "w") / write_text / save_pretrained ... fails here until its
    function is listed under a writer of toolkit.run.writes.WRITERS (or NOT_WRITERS, with the reason)."""
    listed = {f for w in WRITERS.values() for f in w.functions} | set(NOT_WRITERS)
    unlisted = {f: calls for f, calls in write_sites().items() if f not in listed}
    assert not unlisted, f"writers missing from toolkit.run.writes.WRITERS: {unlisted}"


def test_every_function_the_table_names_exists():
    stale = [f for w in [*WRITERS.values()] for f in w.functions if f.split(":")[1] not in defined_functions(f.split(":")[0])]
    stale += [f for f in NOT_WRITERS if f.split(":")[1] not in defined_functions(f.split(":")[0])]
    assert not stale, stale


# The writers whose case reads a training run on a full disk (the_run): walked under blocking saves and again under
# background ones (checkpoint.async_save), whose writes fail in a thread of their own and are said steps later
IN_A_RUN = {"checkpoint", "converted checkpoint", "trackers", "profile", "loss plot"}
WALK = [*(pytest.param(w, False, id=w) for w in sorted(WRITERS)),
        *(pytest.param(w, True, id=f"{w}-background") for w in sorted(IN_A_RUN))]


def test_every_writer_has_a_case_here():
    assert set(CASES) == set(WRITERS), set(WRITERS) ^ set(CASES)
    in_a_run = {w for w, case in CASES.items() if "the_run(" in inspect.getsource(case)}
    assert in_a_run == IN_A_RUN, in_a_run ^ IN_A_RUN


@pytest.mark.parametrize(("writer", "background"), WALK)
def test_each_writer_on_a_full_disk(writer, background, request):
    CASES[writer](request)


# ---------------------------------------------------------------- the cases, one per writer


def failing(exc: BaseException, partial_arg: int | None = 1):
    """A library write that fails as a full disk does: some bytes of its file written, then `exc`, raised with the
    file still open in its frame (torch.save's zip writer holds it so: its close fails too), where the room of a
    removed file stays taken for as long as anything keeps the error."""

    def write(*args, **kwargs):
        if partial_arg is not None and len(args) > partial_arg and isinstance(args[partial_arg], (str, Path)):
            Path(args[partial_arg]).parent.mkdir(parents=True, exist_ok=True)
            held = open(args[partial_arg], "wb")  # noqa: SIM115 - left open, as the library leaves it
            held.write(b"\0" * 64)
            held.flush()
        raise exc

    return write


def held_open(root: Path) -> list[str]:
    """The removed files under `root` this process still holds open: their room is not free."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, gone
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(str(root)) and target.endswith(" (deleted)"):
                found.append(target)
    return found


def _cause(exc: BaseException) -> str:
    """The words of `exc` its one line carries."""
    return exc.strerror if isinstance(exc, OSError) else str(exc).splitlines()[0][:40]


@pytest.fixture(scope="module")
def blocks(tiny_texts, tiny_tokenizer, tmp_path_factory):
    return packed_blocks(tiny_texts, tiny_tokenizer, tmp_path_factory.mktemp("packed"), held_out=False)


@pytest.fixture(scope="module")
def full_disk_run(blocks, tiny_tokenizer, tiny_model, tmp_path_factory):
    return _full_disk_run(blocks, tiny_tokenizer, tiny_model, tmp_path_factory, background=False)


@pytest.fixture(scope="module")
def full_disk_run_background(blocks, tiny_tokenizer, tiny_model, tmp_path_factory):
    return _full_disk_run(blocks, tiny_tokenizer, tiny_model, tmp_path_factory, background=True)


def the_run(request):
    """The run on a full disk this case is walked under: its saves blocking, or in the background."""
    return request.getfixturevalue("full_disk_run_background" if request.node.callspec.params["background"]
                                   else "full_disk_run")


def _full_disk_run(blocks, tiny_tokenizer, tiny_model, tmp_path_factory, background: bool):
    """One run whose every save after the first fails, each with the next exception type (on_save_error=continue),
    whose tensorboard, profile and loss plot fail once each; then a resume whose save fails under =stop. What the
    run holds open of removed files is read as each failure is said."""
    import matplotlib.figure
    from accelerate import tracking
    from accelerate.utils import other
    from torch.profiler import profile

    from toolkit.training.metrics import read_metrics

    out, errors = tmp_path_factory.mktemp("full") / "run", full_disk_errors("/run/x")
    mp = pytest.MonkeyPatch()
    real_save, calls = other.safe_save_file, []

    def save_file(obj, f, *args, **kwargs):  # accelerate's model.safetensors: the first save goes through
        calls.append(f)
        return real_save(obj, f, *args, **kwargs) if len(calls) == 1 else failing(errors[(len(calls) - 2) % len(errors)])(obj, f)

    mp.setattr(other, "safe_save_file", save_file)
    mp.setattr(tracking.TensorBoardTracker, "log", failing(errors[0], None))
    mp.setattr(profile, "export_chrome_trace", failing(errors[1], None))
    mp.setattr(matplotlib.figure.Figure, "savefig", failing(errors[2]))
    printed: list[str] = []
    held: dict[str, list[str]] = {}  # a failure said -> the removed files then held open
    saves = f"checkpoint.async_save={str(background).lower()}"

    def say(line: str) -> None:
        printed.append(line)
        if "could not be written" in line:
            held[line] = held_open(out)

    try:
        trainer = start_trainer(out, blocks, tiny_tokenizer, tiny_model, f"train.max_steps={len(errors) + 1}",
                                "checkpoint.every=1", saves,
                                "checkpoint.keep_last=10", "eval.every=0", "checkpoint.on_save_error=continue",
                                "logging.trackers=[tensorboard]", "logging.profile=[2, 3]")
        trainer.strategy.print = say
        trainer.fit()
        trainer.finish()  # as a recipe ends: its last step's save failed, and is not tried (nor said) again
        plot = trainer.close()
        rows = [r["step"] for r in read_metrics(trainer.run.metrics) if "checkpoint_error" in r]
        mp.setattr(other, "safe_save_file", failing(errors[2]))
        again = start_trainer(out, blocks, tiny_tokenizer, tiny_model, "train.max_steps=2", "checkpoint.every=1",
                              saves, "eval.every=0", "resume=auto")
        from toolkit.checkpoint.checkpointer import SaveStopped

        with pytest.raises(SaveStopped) as stopped:
            again.fit()
        again.close()
    finally:
        mp.undo()
        AcceleratorState._reset_state(True)
    return trainer, printed, plot, str(stopped.value), errors, rows, held


def case_checkpoint(request):
    from toolkit.run.manifest import check_manifest

    trainer, printed, _, stopped, errors, rows, held = the_run(request)
    run = trainer.run
    for step, exc in enumerate(errors, start=2):
        said = [p for p in printed if f"warning: checkpoint step-{step} could not be written" in p]
        assert len(said) == 1 and _cause(exc) in said[0] and "step-1 is intact" in said[0], (step, printed)
        assert said[0].endswith("training goes on (checkpoint.on_save_error=continue)")
        # its files closed by the time it is said (a background save's error is kept until then): their room is free
        assert held[said[0]] == [], (step, held[said[0]])
    # nothing of a failed save is left that a resume or an export could take for a checkpoint
    assert sorted(p.name for p in run.checkpoints.iterdir()) == ["step-1"]
    assert check_manifest(run.checkpoint(1)) is None
    assert rows == list(range(2, len(errors) + 2))  # and a checkpoint_error row each in metrics.jsonl
    # checkpoint.on_save_error=stop, with safetensors' own error (not an OSError): the run's one error line (exit 5)
    assert stopped.startswith("checkpoint step-2 could not be written: rank 0 writing into ")
    assert "Error while serializing: I/O error: No space left on device" in stopped
    assert stopped.endswith("step-1 is intact; free space, then continue with resume=auto")


def case_trackers(request):
    trainer, printed, _, _, errors, _, _ = the_run(request)
    said = [p for p in printed if "trackers could not be written" in p]
    assert len(said) == 1 and _cause(errors[0]) in said[0] and said[0].endswith("logging.trackers are not written to again in this run")


def case_profile(request):
    trainer, printed, _, _, errors, _, _ = the_run(request)
    said = [p for p in printed if "profile could not be written" in p]
    assert len(said) == 1 and said[0].startswith("[unit] warning: ") and _cause(errors[1]) in said[0]
    assert not any(p.startswith("[unit] profile: ") for p in printed)  # no "written to" for what was not


def case_loss_plot(request):
    trainer, printed, plot, _, errors, _, _ = the_run(request)
    said = [p for p in printed if "loss plot could not be written" in p]
    assert len(said) == 1 and _cause(errors[2]) in said[0]
    assert plot is None and not trainer.run.loss_plot.exists()  # the partial PNG is gone


def case_metrics(request):
    from toolkit.training.metrics import MetricsWriter, read_metrics

    tmp = request.getfixturevalue("tmp_path")

    class FullDisk:  # the file's writes fail from now on, as on a disk that just filled
        def __init__(self, exc):
            self.exc = exc

        def write(self, text):
            raise self.exc

        def flush(self):
            raise self.exc

        def close(self):  # closing flushes what did not fit: a full disk again
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    for i, exc in enumerate(full_disk_errors(str(tmp / "metrics.jsonl"))):
        said: list[str] = []
        writer = MetricsWriter(tmp / f"m{i}.jsonl", None, said.append)
        writer.write({"step": 1, "loss": 1.0})
        writer._file = FullDisk(exc)
        writer.write({"step": 2, "loss": 1.0})
        writer.write({"step": 3, "loss": 1.0})
        writer.close()
        assert len(said) == 1 and said[0].startswith("warning: metrics could not be written: "), said
        assert _cause(exc) in said[0] and said[0].endswith("free space; the rows after it are not written")
        assert read_metrics(tmp / f"m{i}.jsonl") == [{"step": 1, "loss": 1.0}]


def case_samples(request):
    from toolkit.training.samples import write_samples

    tmp, monkeypatch = request.getfixturevalue("tmp_path"), request.getfixturevalue("monkeypatch")
    for exc in full_disk_errors(str(tmp / "samples.md")):
        said: list[str] = []
        monkeypatch.setattr(Path, "write_text", failing(exc, 0))
        assert write_samples(tmp / "samples.md", ["p"], ["a"], ["b"], "h", said.append) is None
        monkeypatch.undo()
        assert len(said) == 1 and "samples could not be written" in said[0] and "final/ is complete" in said[0]
        assert not (tmp / "samples.md").exists()


def _fails(exc_type=WriteFailed):
    return pytest.raises(exc_type)


def case_final_model(request):
    from transformers import modeling_utils

    from toolkit.export.hf_folder import write_model_folder

    tmp, monkeypatch = request.getfixturevalue("tmp_path"), request.getfixturevalue("monkeypatch")
    tok, model = request.getfixturevalue("tiny_tokenizer"), request.getfixturevalue("tiny_model")("llama")
    final = tmp / "final"
    write_model_folder(model, tok, final, {}, {}, card="the previous final/")
    for exc in full_disk_errors(str(final / "model.safetensors")):
        monkeypatch.setattr(modeling_utils, "safe_save_file", failing(exc))
        with _fails() as info:
            write_model_folder(model, tok, final, {}, {}, card="new")
        monkeypatch.undo()
        assert str(info.value).startswith("final model could not be written: ") and _cause(exc) in str(info.value)
        assert "resume=auto" in str(info.value) and info.value.exit == 5
        assert sorted(p.name for p in tmp.iterdir()) == ["final"]  # no final.tmp
        assert held_open(tmp) == []  # nor its room taken: the error kept (info) holds no file open
        assert (final / "README.md").read_text() == "the previous final/"


def case_export(request):
    from transformers import modeling_utils

    from toolkit.export import destination
    from toolkit.export.hf_folder import write_model_folder

    tmp, monkeypatch = request.getfixturevalue("tmp_path"), request.getfixturevalue("monkeypatch")
    tok, model = request.getfixturevalue("tiny_tokenizer"), request.getfixturevalue("tiny_model")("llama")
    for exc in full_disk_errors(str(tmp / "out" / "model.safetensors")):
        monkeypatch.setattr(modeling_utils, "safe_save_file", failing(exc))
        with _fails() as info, destination.staging(tmp / "exports" / "out") as (staged, _):
            write_model_folder(model, tok, staged, {}, {}, card="c", writer="export")
        monkeypatch.undo()
        assert str(info.value).startswith("export could not be written: ") and _cause(exc) in str(info.value)
        assert "choose an --output on a disk with room" in str(info.value)
        assert list((tmp / "exports").iterdir()) == []  # the staging folder is gone


def case_evaluation(request):
    """recipes/evaluate.py: a checkpoint made a model folder for the harness, then the harness's results."""
    from transformers import modeling_utils

    from toolkit.export.hf_folder import write_model_folder
    from toolkit.run.writes import writing

    tmp, monkeypatch = request.getfixturevalue("tmp_path"), request.getfixturevalue("monkeypatch")
    tok, model = request.getfixturevalue("tiny_tokenizer"), request.getfixturevalue("tiny_model")("llama")
    for exc in full_disk_errors(str(tmp / "work" / "model" / "model.safetensors")):
        monkeypatch.setattr(modeling_utils, "safe_save_file", failing(exc))
        with _fails() as info:
            write_model_folder(model, tok, tmp / "work" / "model", {}, {}, card="", writer="evaluation")
        monkeypatch.undo()
        assert str(info.value).startswith("evaluation could not be written: ") and _cause(exc) in str(info.value)
        assert "choose an --output on a disk with room" in str(info.value)
        assert not (tmp / "work" / "model").exists()
    results = tmp / "harness.json"
    with _fails() as info, writing("evaluation", results):
        results.write_text("{")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(results))
    assert "No space left on device" in str(info.value) and not results.exists()


def case_harness_scoring(request):
    """eval.harness_tasks in pretraining: a step's model folder, then the log its scoring appends to; either failing
    is a warning, the folder is gone, and nothing is left running."""
    import types

    from transformers import modeling_utils

    from toolkit.training import harness_runs
    from toolkit.training.harness import HarnessConfig

    tmp, monkeypatch = request.getfixturevalue("tmp_path"), request.getfixturevalue("monkeypatch")
    tok, model = request.getfixturevalue("tiny_tokenizer"), request.getfixturevalue("tiny_model")("llama")
    said = []
    runs = object.__new__(harness_runs.HarnessRuns)  # its tasks unchecked: the harness's index is not the point
    runs.cfg, runs.root, runs.main, runs.say, runs.running = HarnessConfig(["t"]), tmp / "harness", True, said.append, None
    runs.dtype = "float32"
    strategy = types.SimpleNamespace(master_weights=lambda m: None, is_main=True, model_to_save=lambda m, sd: m,
                                     accelerator=types.SimpleNamespace(wait_for_everyone=lambda: None,
                                                                       unwrap_model=lambda m: m))
    for exc in full_disk_errors(str(tmp / "harness" / "step-2" / "model.safetensors")):
        said.clear()
        monkeypatch.setattr(modeling_utils, "safe_save_file", failing(exc))
        assert runs.write(strategy, model, tok, 2) is None
        monkeypatch.undo()
        assert len(said) == 1 and said[0].startswith("warning: harness scoring could not be written: ")
        assert _cause(exc) in said[0] and said[0].endswith("that step is not scored, and training goes on")
        assert not (tmp / "harness" / "step-2").exists()
    model.config.use_cache = False  # as training runs it
    folder = runs.write(strategy, model, tok, 4)
    assert folder == tmp / "harness" / "step-4" and (folder / "config.json").exists()
    assert model.config.use_cache is False  # the folder generates with the cache; the model training on is as it was
    for exc in full_disk_errors(str(tmp / "harness" / harness_runs.LOG)):
        said.clear()
        monkeypatch.setattr(harness_runs, "open", failing(exc, partial_arg=None), raising=False)
        runs.start(4, "train", folder, keep=True)
        monkeypatch.undo()
        assert len(said) == 1 and said[0].startswith("warning: harness scoring could not be written: ")
        assert runs.running is None and folder.exists()  # kept: final/ is never removed
    monkeypatch.setattr(harness_runs, "open", failing(OSError(28, "No space left on device"), partial_arg=None),
                        raising=False)
    runs.start(4, "train", folder)  # a step's own folder is removed with its scoring, which never started
    assert runs.running is None and not folder.exists()


def case_data_cache(request):
    from toolkit.data import packing

    tmp, monkeypatch = request.getfixturevalue("tmp_path"), request.getfixturevalue("monkeypatch")
    tok = request.getfixturevalue("tiny_tokenizer")
    docs = datasets.Dataset.from_dict({"text": request.getfixturevalue("tiny_texts")[:40]})
    for i, exc in enumerate(full_disk_errors("ids.arrow")):
        # datasets' writer fails in the tokenizing processes (num_proc=2: the 82-line traceback was theirs)
        monkeypatch.setattr(datasets.arrow_writer.ArrowWriter, "write_batch", failing(exc, None))
        with _fails() as info:
            packing.packed_dataset(docs, tok, 32, tmp / "cache", f"docs{i}", num_proc=2 if i == 0 else 1)
        monkeypatch.undo()
        line = str(info.value)
        assert line.startswith("data cache could not be written: ") and _cause(exc) in line, line
        assert line.endswith("free space there, or point data.cache_dir at a disk with room") and "\n" not in line
        assert list((tmp / "cache").iterdir()) == []  # the .packed-KEY.tmp folder and its scratch files are gone
    # the blocks' own file (arrow, in this process)
    monkeypatch.setattr(packing.pa, "OSFile", failing(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "b.arrow")))
    with _fails():
        packing.packed_dataset(docs, tok, 32, tmp / "cache", "blocks")
    assert list((tmp / "cache").iterdir()) == []


def case_tokenizer_cache(request):
    from transformers import PreTrainedTokenizerBase

    from toolkit.data.tokenizer import TokenizerConfig, get_tokenizer

    tmp, monkeypatch = request.getfixturevalue("tmp_path"), request.getfixturevalue("monkeypatch")
    docs = datasets.Dataset.from_dict({"text": request.getfixturevalue("tiny_texts")[:20]})
    for exc in full_disk_errors(str(tmp / "tok")):
        monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", failing(exc))
        with _fails() as info:
            get_tokenizer(TokenizerConfig(vocab_size=300), docs, tmp / "tok")
        monkeypatch.undo()
        assert str(info.value).startswith("tokenizer cache could not be written: ") and _cause(exc) in str(info.value)
        assert list(tmp.iterdir()) == []


def case_gguf_float_copy(request):
    from transformers import modeling_utils

    from toolkit.models.gguf_base import _write_cache

    tmp, monkeypatch = request.getfixturevalue("tmp_path"), request.getfixturevalue("monkeypatch")
    tok, model = request.getfixturevalue("tiny_tokenizer"), request.getfixturevalue("tiny_model")("llama")
    (tmp / "cache").mkdir()
    for exc in full_disk_errors(str(tmp / "model.safetensors")):
        monkeypatch.setattr(modeling_utils, "safe_save_file", failing(exc))
        with _fails() as info:
            _write_cache(model, tok, tmp / "m.gguf", tmp / "cache" / "gguf-m-0")
        monkeypatch.undo()
        assert str(info.value).startswith("gguf float copy could not be written: ") and _cause(exc) in str(info.value)
        assert list((tmp / "cache").iterdir()) == []


def case_runs_base(request):
    import os
    import shutil

    from toolkit.models.gguf_base import keep_copy

    tmp, monkeypatch = request.getfixturevalue("tmp_path"), request.getfixturevalue("monkeypatch")
    cached, run = tmp / "cache" / "gguf-m-0", tmp / "run"
    cached.mkdir(parents=True)
    run.mkdir()
    for name in ("config.json", "model.safetensors", "gguf_source.json"):
        (cached / name).write_text("{}")
    for exc in full_disk_errors(str(run / "base.tmp" / "model.safetensors")):
        monkeypatch.setattr(os, "link", failing(OSError(18, "Invalid cross-device link")))  # then copied
        monkeypatch.setattr(shutil, "copy2", failing(exc))
        with _fails() as info:
            keep_copy(cached, run / "base")
        monkeypatch.undo()
        assert str(info.value).startswith("the run's base could not be written: ") and _cause(exc) in str(info.value)
        assert list(run.iterdir()) == []
    keep_copy(cached, run / "base")
    assert sorted(p.name for p in (run / "base").iterdir()) == sorted(p.name for p in cached.iterdir())


def case_preference_reference(request):
    import numpy as np

    from toolkit.training import reference

    tmp, monkeypatch = request.getfixturevalue("tmp_path"), request.getfixturevalue("monkeypatch")
    for exc in full_disk_errors(str(tmp / "ref.npz")):
        monkeypatch.setattr(np, "savez", failing(exc, None))
        with _fails() as info:
            reference._write(tmp / "ref.npz", "key", {"a": np.zeros(3)})
        monkeypatch.undo()
        assert str(info.value).startswith("preference reference could not be written: ")
        assert list(tmp.iterdir()) == []


def case_converted_checkpoint(request):
    from toolkit.checkpoint import conversion
    from toolkit.config.errors import UserError

    trainer, *_ = the_run(request)
    folder, monkeypatch = trainer.run.checkpoint(1), request.getfixturevalue("monkeypatch")
    for exc in full_disk_errors(str(folder) + ".converted.tmp/exp_avg.safetensors"):
        monkeypatch.setattr(conversion, "save_file", failing(exc))
        with _fails(UserError) as info:
            conversion.cached_conversion(Checkpoint.read(folder))
        monkeypatch.undo()
        assert f"checkpoint {folder} could not be converted into" in str(info.value) and _cause(exc) in str(info.value)
        assert sorted(p.name for p in folder.parent.iterdir()) == ["step-1"]


def case_launch_config_copy(request):
    import yaml

    from toolkit.launch.launcher import paths_from_its_folder

    tmp, monkeypatch = request.getfixturevalue("tmp_path"), request.getfixturevalue("monkeypatch")
    (tmp / "configs").mkdir()
    (tmp / "configs" / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    config = tmp / "configs" / "zero2.yaml"
    config.write_text(yaml.safe_dump({"distributed_type": "DEEPSPEED", "deepspeed_config": {"deepspeed_config_file": "ds.json"}}))
    (tmp / "copies").mkdir()
    monkeypatch.chdir(tmp / "copies")
    for exc in full_disk_errors(str(tmp / "copies" / "zero2.yaml")):
        monkeypatch.setattr(Path, "write_text", failing(exc, 0))
        with _fails() as info:
            paths_from_its_folder(str(config), tmp / "copies")
        monkeypatch.undo()
        monkeypatch.chdir(tmp / "copies")
        assert str(info.value).startswith("launch config copy could not be written: ") and info.value.exit == 5
        assert list((tmp / "copies").iterdir()) == []


def case_run_lock(request):
    from toolkit.run.lock import OwnerLock

    tmp, monkeypatch = request.getfixturevalue("tmp_path"), request.getfixturevalue("monkeypatch")
    for i, exc in enumerate(full_disk_errors(str(tmp / ".lock"))):
        monkeypatch.setattr(os, "pwrite", failing(exc, None))
        with _fails() as info:
            OwnerLock.take(tmp / f"run{i}", "launch")
        monkeypatch.undo()
        assert str(info.value).startswith("run lock could not be written: ") and info.value.exit == 2
        assert str(info.value).endswith("free space in output_dir")


CASES = {
    "checkpoint": case_checkpoint, "converted checkpoint": case_converted_checkpoint, "final model": case_final_model,
    "data cache": case_data_cache, "tokenizer cache": case_tokenizer_cache, "gguf float copy": case_gguf_float_copy,
    "the run's base": case_runs_base, "preference reference": case_preference_reference, "export": case_export, "evaluation": case_evaluation,
    "harness scoring": case_harness_scoring, "metrics": case_metrics,
    "trackers": case_trackers, "loss plot": case_loss_plot, "profile": case_profile, "samples": case_samples,
    "launch config copy": case_launch_config_copy, "run lock": case_run_lock,
}


def test_a_failed_write_is_told_from_a_bug():
    """Only what a writer raises for a failed write becomes the one line; a bug keeps its traceback."""
    from toolkit.run.writes import failed_write

    assert all(failed_write(exc) for exc in full_disk_errors("f"))
    assert failed_write(pickle.PicklingError("x")) == "x"
    for bug in (KeyError("model"), RuntimeError("Expected all tensors to be on the same device"), ValueError("x"),
                Exception("No such file or directory (os error 2)"), Exception("vocab.json"),
                ValueError("No space left on device (os error 28)")):  # the Rust io error's type is Exception alone
        assert failed_write(bug) is None, bug
