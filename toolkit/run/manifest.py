"""A checkpoint's manifest: every file's size and CRC-32, written with it, checked before a resume.

The sizes are checked first (a truncated file named without reading anything), then CRC-32, which finds any
truncation, burst error and flipped bit (it is not meant to resist forgery). The same manifest is written into
final/, adapter/ and every folder an export writes, where `written_by` names its writer.
Why, and what a damaged checkpoint did without it: docs/internals.md, toolkit/run/manifest.py.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from toolkit.config.files import once

MANIFEST = "manifest.json"
_CHUNK = 8 << 20


def crc32(path: Path) -> str:
    value = 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            value = zlib.crc32(chunk, value)
    return f"{value:08x}"


def _files(folder: Path, skip: set[str]) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.relative_to(folder).as_posix() not in skip)


def write_manifest(folder: Path, skip: tuple[str, ...] = (), writer: str | None = None) -> Path:
    """Record every file under `folder` (but `skip` and the manifest itself); atomically.

    `writer` names what wrote the folder, for `written_by()` to read back."""
    files = _files(folder, {MANIFEST, *skip})
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:  # zlib releases the GIL
        sums = list(pool.map(crc32, files))
    entries = {
        p.relative_to(folder).as_posix(): {"size": p.stat().st_size, "crc32": s} for p, s in zip(files, sums, strict=True)
    }
    tmp = folder / (MANIFEST + ".tmp")
    header = {"version": 1} | ({"written_by": writer} if writer else {})
    tmp.write_text(json.dumps({**header, "files": entries}, indent=1))
    tmp.rename(folder / MANIFEST)
    return folder / MANIFEST


def check_manifest(folder: Path, only: Callable[[str], bool] | None = None) -> str | None:
    """None if every recorded file is there with its size and CRC-32 (or the checkpoint predates
    manifests); otherwise one line naming the first damaged file and what is wrong with it.

    `only` picks the recorded names to check (a reader that needs some of the files)."""
    path = folder / MANIFEST
    if not path.is_file():
        return None
    entries = _entries(path)
    if isinstance(entries, str):
        return f"{path} is not a readable manifest ({entries})"
    if only is not None:
        entries = {name: entry for name, entry in entries.items() if only(name)}
    for name, entry in entries.items():  # sizes first: cheap, and they name a truncation at once
        file = folder / name
        if not file.is_file():
            return f"{file} is missing"
        size = file.stat().st_size
        if size != entry["size"]:
            return f"{file} has {size:,} bytes, {entry['size']:,} were written (truncated or replaced)"
    names = list(entries)
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        sums = list(pool.map(crc32, [folder / n for n in names]))
    for name, value in zip(names, sums, strict=True):
        if value != entries[name]["crc32"]:
            return f"{folder / name} does not match its checksum (crc32 {value}, written {entries[name]['crc32']})"
    return None


def _entries(path: Path) -> dict[str, dict] | str:
    """A manifest's {name: {"size", "crc32"}}, or what is wrong with the file (it is the toolkit's own: anything
    but what write_manifest wrote means damage)."""

    try:
        saved = json.loads(path.read_bytes().decode("utf-8"), object_pairs_hook=once)
    except json.JSONDecodeError as exc:
        return f"not JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}"
    except UnicodeDecodeError:
        return "not UTF-8 text"
    except ValueError as exc:
        return str(exc)
    entries = saved.get("files") if isinstance(saved, dict) else None
    if not isinstance(entries, dict):
        return "no object of files" if isinstance(saved, dict) else f"a JSON {type(saved).__name__}, not an object"
    for name, entry in entries.items():
        if not (isinstance(entry, dict) and isinstance(entry.get("size"), int) and isinstance(entry.get("crc32"), str)):
            return f"its entry for {name} is {entry!r:.60}, not a size and a crc32"
    return entries


def written_by(folder: Path) -> str | None:
    """What wrote `folder`, as its manifest names it; None without a readable manifest or a name."""
    try:
        value = json.loads((folder / MANIFEST).read_text()).get("written_by")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None
