"""Where an export goes, and the one thing --overwrite may replace there: an earlier export.

Export keeps training's promise that nothing it did not write is deleted: everything it writes says so, and
--overwrite replaces such an export, whole, and refuses anything else. The export is made in a hidden folder
beside the output (`staging`) and moved into place by renames once complete (`put_in_place`).
What counts as an export, and what is refused: docs/internals.md, toolkit/export/destination.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from toolkit.config.errors import UserError
from toolkit.run.folder import RunDir, nearest_folder
from toolkit.run.manifest import MANIFEST, write_manifest, written_by
from toolkit.run.paths import COMMAND_OPTIONS, run_around
from toolkit.run.writes import writing

EXPORTED_BY = "llm-toolkit recipes/export.py"
MODELFILE_FIRST_LINE = "# Ollama: ollama create "  # the first line of every Modelfile write_modelfile writes
REPORT_FIRST_LINE = "# Export report: "  # ... and of every export_report.md (ExportReport.markdown)
REPORT = "export_report.md"

# Every flag of recipes/export.py (argparse's dest) and what it is: toolkit.run.paths.COMMAND_OPTIONS; its "read"
# ones are check_output's `reads`, which --output never lies in.
EXPORT_FLAGS = COMMAND_OPTIONS["export"]


def check_creatable(output: Path) -> None:
    """--output can be made (recipes/export.py's and recipes/evaluate.py's)."""
    probe, refused = nearest_folder(output.absolute())
    if isinstance(refused, NotADirectoryError):
        raise UserError(f"--output {output} cannot be created: {probe} is a file, not a folder")
    if refused is not None:
        raise UserError(f"--output {output} cannot be created: {probe} does not accept new entries ({refused.strerror})")


def check_base(base: str | None, source=None) -> None:
    """--base names a folder, and only for a LoRA adapter (`source`, once resolved, a consolidate.Source)."""
    if base and not Path(base).is_dir():
        raise UserError(f"--base {base} is not a folder; give the base model folder of the LoRA adapter")
    if base and source is not None and source.kind != "adapter":
        raise UserError(f"--base applies to a LoRA adapter folder; {source.describe()} is not one, leave --base out")


def outputs(output: Path, fmt: str) -> list[Path]:
    """Every path an export of `fmt` to `output` writes: a folder, or a GGUF with its Modelfile and report."""
    if fmt != "gguf":
        return [output]
    return [output, modelfile_path(output), report_path(output, fmt)]


def modelfile_path(gguf_file: Path) -> Path:
    return gguf_file.with_name(gguf_file.stem + ".Modelfile")  # after the stem: two exports in a folder keep one each


def report_path(output: Path, fmt: str) -> Path:
    return output.with_name(f"{output.name}.{REPORT}") if fmt == "gguf" else output / REPORT


def check_output(output: Path, fmt: str, overwrite: bool, reads: dict[str, Path | None]) -> None:
    """Refuse an output that would lose or mix anything, before any work.

    `reads` names what the export reads (e.g. {"--from": ..., "the LoRA's base": ...})."""
    for path in outputs(output, fmt):
        _apart(path, reads)
        around = run_around(path)
        if around is not None:
            run, entry = around
            slash = "/" if (run / entry).is_dir() else ""
            raise UserError(
                f"--output {path} is inside the toolkit run {run} (its {entry}{slash}); "
                "a run holds what training wrote and export writes nothing into it; choose a path outside the run"
            )
        if path.is_symlink():
            raise UserError(
                f"--output {path} is a symbolic link (to {os.readlink(path)}); export replaces only what it wrote "
                "itself; give the path the link points to, or another path"
            )
        if not path.exists():
            continue
        # what --overwrite would refuse is refused as such without it too: its hint would only lead there
        problem = not_an_export(path, folder=path == output and fmt != "gguf")
        if problem:
            raise UserError(problem)
        if not overwrite:
            if path == output:
                raise UserError(f"--output {output} exists; choose another path or pass --overwrite to replace it")
            raise UserError(f"{path} exists; choose another --output or pass --overwrite to replace it")


def not_an_export(path: Path, folder: bool) -> str | None:
    """None if `path` (which exists) is an earlier export of this kind, which --overwrite replaces
    whole; otherwise the line that refuses it."""
    only = "--overwrite replaces only an earlier export"
    if folder:
        if not path.is_dir():
            return f"--output {path} is a file, and this export writes a folder; {only}; choose another --output"
        names = sorted(entry.name + ("/" if entry.is_dir() else "") for entry in path.iterdir())
        if not names:
            return None  # an empty folder: nothing to lose
        if written_by(path) != EXPORTED_BY:
            run_entries, _ = RunDir(path).entries()
            if run_entries:
                return f"--output {path} holds a toolkit run ({_few(run_entries)}); {only}, never a run; choose another --output"
            return (
                f"--output {path} holds files that no export wrote ({_few(names)}); {only}, and will not delete "
                "them; choose another --output"
            )
        recorded = {name.split("/")[0] for name in json.loads((path / MANIFEST).read_text()).get("files", {})} | {MANIFEST}
        added = [name for name in names if name.rstrip("/") not in recorded]
        if added:
            return (
                f"--output {path} is an earlier export with files added to it ({_few(added)}); --overwrite would "
                "delete them; move them out of it, or choose another --output"
            )
        return None
    if path.is_dir():
        return f"--output {path} is a folder; give a file name such as {path / 'model.gguf'}"
    if path.suffix == ".gguf":
        if _gguf_writer(path) == EXPORTED_BY:
            return None
        return f"--output {path} is not a GGUF that an export wrote; {only}; choose another --output"
    if path.read_bytes()[:200].decode("utf-8", "replace").startswith((MODELFILE_FIRST_LINE, REPORT_FIRST_LINE)):
        return None
    return f"{path} is in the way and was not written by an export; {only}; choose another --output or move it"


def mark(output: Path, fmt: str) -> None:
    """Sign a staged folder export as the export's own (a GGUF is signed by write_gguf)."""
    if fmt != "gguf":
        write_manifest(output, writer=EXPORTED_BY)


@contextlib.contextmanager
def staging(output: Path) -> Iterator[tuple[Path, Path]]:
    """(where to write the export under its own name, a folder for intermediate files): both in a
    hidden folder beside `output` (the same file system, so the export moves into place by
    renames), deleted on the way out with whatever is left in it."""
    output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{output.name}.export-", dir=output.parent) as tmp:
        with writing("export"):  # a write that fails inside: WriteFailed, one line (toolkit.run.writes.WRITERS)
            (Path(tmp) / "out").mkdir()
            (Path(tmp) / "work").mkdir()
            yield Path(tmp) / "out" / output.name, Path(tmp) / "work"


def put_in_place(staged: Path, output: Path, fmt: str, overwrite: bool, reads: dict[str, Path | None]) -> None:
    """Move the finished export `staged` (and its companions beside it) into place: a GGUF and its
    files each by an atomic replace; a folder by two renames, the earlier export going into the
    staging folder, deleted with it. Checked once more first, so that nothing that appeared during
    the export is replaced."""
    check_output(output, fmt, overwrite, reads)
    if fmt == "gguf":
        for path in outputs(output, fmt)[1:] + [output]:  # the GGUF last: its Modelfile names it
            os.replace(staged.with_name(path.name), path)
        return
    if output.exists():
        output.rename(staged.parent.parent / "replaced")
    staged.rename(output)


def _apart(path: Path, reads: dict[str, Path | None]) -> None:
    where = path.resolve()
    for what, read in reads.items():
        if read is None:
            continue
        source = read.resolve()
        if where == source or where.is_relative_to(source) or source.is_relative_to(where):
            relation = "is" if where == source else "is inside" if where.is_relative_to(source) else "holds"
            raise UserError(
                f"--output {path} {relation} {what} {read}, which the export reads; an export never writes into "
                "what it reads; choose an --output outside it"
            )


def _gguf_writer(path: Path) -> str | None:
    """A GGUF's `general.quantized_by`, or None when it is not a GGUF or names no writer."""
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            return None
    import gguf

    from toolkit.models.gguf_base import read_gguf  # torch and transformers: only for a GGUF it would replace

    try:
        field = read_gguf(path).get_field(gguf.Keys.General.QUANTIZED_BY)
    except (ValueError, OSError, IndexError, KeyError):  # a damaged GGUF: not one to replace unasked
        return None
    return field.contents() if field is not None else None


def _few(names: list[str], shown: int = 3) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more
