"""What --overwrite may replace: an earlier export, whole, and nothing else (training's promise).

Every case lays out what a user may have at the output's path, asks check_output, and checks that
the refusal names it and that not one file changed.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from toolkit.config.errors import UserError
from toolkit.export import destination
from toolkit.run.manifest import write_manifest
from toolkit.run.writes import WriteFailed


def tree(root: Path) -> dict[str, bytes | None]:
    """Every path under `root` with its content (None for a folder; a link by its target)."""
    out = {}
    for path in sorted(root.rglob("*")):
        name = path.relative_to(root).as_posix()
        out[name] = os.readlink(path).encode() if path.is_symlink() else None if path.is_dir() else path.read_bytes()
    return out


def an_export(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"weights")
    (folder / "export_report.md").write_text("# Export report: x\n")
    destination.mark(folder, "hf")
    return folder


def a_gguf(path: Path, signed: bool) -> Path:
    import gguf

    writer = gguf.GGUFWriter(path, "llama")
    if signed:
        writer.add_quantized_by(destination.EXPORTED_BY)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def user_folder(t: Path) -> Path:
    (t / "out" / "figs").mkdir(parents=True)
    (t / "out" / "thesis.tex").write_text("\\documentclass{article}")
    (t / "out" / "figs" / "loss.pdf").write_bytes(b"%PDF")
    return t / "out"


def written(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def a_run(t: Path) -> Path:
    (t / "out" / "checkpoints" / "step-2").mkdir(parents=True)
    (t / "out" / "metrics.jsonl").write_text('{"step": 1}\n')
    return t / "out"


def export_plus_a_file(t: Path) -> Path:
    (an_export(t / "out") / "notes.txt").write_text("mine")
    return t / "out"


def a_file(t: Path) -> Path:
    (t / "out").write_text("not a folder")
    return t / "out"


def inside_a_run(t: Path) -> Path:
    a_run(t)
    return t / "out" / "final"


def a_link(t: Path) -> Path:
    an_export(t / "real")
    (t / "out").symlink_to(t / "real")
    return t / "out"


def a_dangling_link(t: Path) -> Path:
    (t / "out").symlink_to(t / "gone")
    return t / "out"


# case -> (format, lays out the output and returns its path, what --from is, the refusal)
CASES = {
    "a user's folder": ("hf", user_folder, None, "holds files that no export wrote (figs/, thesis.tex); "
                        "--overwrite replaces only an earlier export, and will not delete them"),
    "a run folder": ("hf", a_run, None, "holds a toolkit run (checkpoints/, metrics.jsonl); --overwrite replaces "
                     "only an earlier export, never a run"),
    "an export with a file added": ("hf", export_plus_a_file, None, "is an earlier export with files added to it "
                                    "(notes.txt); --overwrite would delete them"),
    "a file where a folder goes": ("hf", a_file, None, "is a file, and this export writes a folder"),
    "a run's final/": ("hf", inside_a_run, None, "is inside the toolkit run {t}/out (its final); a run holds what "
                       "training wrote and export writes nothing into it"),
    "a link to an export": ("hf", a_link, None, "is a symbolic link (to {t}/real)"),
    "a dangling link": ("hf", a_dangling_link, None, "is a symbolic link (to {t}/gone)"),
    "the source itself": ("hf", lambda t: an_export(t / "out"), "out", "is --from {t}/out, which the export reads"),
    "a folder inside the source": ("hf", lambda t: an_export(t / "src") / "sub", "src", "is inside --from {t}/src"),
    "a folder holding the source": ("hf", lambda t: an_export(t / "out").parent, "out", "holds --from {t}/out"),
    "a text file named .gguf": ("gguf", lambda t: written(t / "m.gguf", "notes"), None,
                                "is not a GGUF that an export wrote"),
    "a GGUF from elsewhere": ("gguf", lambda t: a_gguf(t / "m.gguf", signed=False), None,
                              "is not a GGUF that an export wrote"),
    "a folder named .gguf": ("gguf", lambda t: an_export(t / "m.gguf"), None, "is a folder; give a file name"),
    "a user's Modelfile beside": ("gguf", lambda t: written(t / "m.Modelfile", "FROM llama3\n").with_suffix(".gguf"),
                                  None, "m.Modelfile is in the way and was not written by an export"),
}


@pytest.mark.parametrize("case", CASES)
def test_overwrite_refuses_what_no_export_wrote(case, tmp_path):
    fmt, lay_out, source, expected = CASES[case]
    output = lay_out(tmp_path)
    before = tree(tmp_path)
    reads = {"--from": tmp_path / source if source else None}
    with pytest.raises(UserError) as refused:
        destination.check_output(output, fmt, overwrite=True, reads=reads)
    assert expected.format(t=tmp_path) in str(refused.value)
    assert tree(tmp_path) == before


@pytest.mark.parametrize("case", CASES)
def test_without_overwrite_what_it_would_refuse_is_refused_alike(case, tmp_path):
    """Without --overwrite the same line, never a hint to pass --overwrite: a user's file or folder as --output was
    'exists; choose another path or pass --overwrite to replace it', and with --overwrite then refused (issue 44)."""
    fmt, lay_out, source, expected = CASES[case]
    output = lay_out(tmp_path)
    before = tree(tmp_path)
    with pytest.raises(UserError) as refused:
        destination.check_output(output, fmt, overwrite=False, reads={"--from": tmp_path / source if source else None})
    assert expected.format(t=tmp_path) in str(refused.value)
    assert "pass --overwrite" not in str(refused.value)
    assert tree(tmp_path) == before


def test_an_earlier_export_is_replaced_whole(tmp_path):
    out = an_export(tmp_path / "out")
    (out / "model-00002.safetensors").write_bytes(b"a shard the new export does not have")
    destination.mark(out, "hf")
    destination.check_output(out, "hf", overwrite=True, reads={})
    with destination.staging(out) as (staged, _):
        an_export(staged)
        (staged / "model.safetensors").write_bytes(b"new weights")
        destination.put_in_place(staged, out, "hf", overwrite=True, reads={})
    assert (out / "model.safetensors").read_bytes() == b"new weights"
    assert not (out / "model-00002.safetensors").exists()  # the earlier export went whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging folder left


def test_a_gguf_and_its_companions_are_replaced_when_an_export_wrote_them(tmp_path):
    out = a_gguf(tmp_path / "m.gguf", signed=True)
    destination.modelfile_path(out).write_text(f"{destination.MODELFILE_FIRST_LINE}m -f m.Modelfile\n")
    destination.report_path(out, "gguf").write_text("# Export report: m.gguf\n")
    destination.check_output(out, "gguf", overwrite=True, reads={})
    with pytest.raises(UserError, match="m.gguf exists; choose another path or pass --overwrite"):
        destination.check_output(out, "gguf", overwrite=False, reads={})


def test_an_empty_folder_is_no_loss(tmp_path):
    (tmp_path / "out").mkdir()
    destination.check_output(tmp_path / "out", "hf", overwrite=True, reads={})


def test_a_failed_export_leaves_the_earlier_one_as_it_was(tmp_path):
    out = an_export(tmp_path / "out")
    before = tree(tmp_path)
    with pytest.raises(WriteFailed, match="disk full"), destination.staging(out) as (staged, _):
        an_export(staged)
        raise OSError("disk full (simulated)")
    assert tree(tmp_path) == before


def test_a_file_that_appears_during_the_export_is_not_replaced(tmp_path):
    out = an_export(tmp_path / "out")
    with destination.staging(out) as (staged, _):
        an_export(staged)
        (out / "notes.txt").write_text("written while the export ran")
        with pytest.raises(UserError, match=r"files added to it \(notes.txt\)"):
            destination.put_in_place(staged, out, "hf", overwrite=True, reads={})
    assert (out / "notes.txt").read_text() == "written while the export ran"


def test_the_mark_is_the_manifest_naming_the_export(tmp_path):
    out = an_export(tmp_path / "out")
    write_manifest(out)  # a folder with a manifest written by something else (a run's final/)
    with pytest.raises(UserError, match="holds files that no export wrote"):
        destination.check_output(out, "hf", overwrite=True, reads={})


def test_a_report_or_modelfile_in_the_way_is_not_overwritten_unasked(tmp_path):
    """The report beside a GGUF was written over without --overwrite."""
    out = tmp_path / "m.gguf"
    destination.report_path(out, "gguf").write_text("my notes")
    with pytest.raises(UserError, match=r"m.gguf.export_report.md is in the way and was not written by an export"):
        destination.check_output(out, "gguf", overwrite=False, reads={})
