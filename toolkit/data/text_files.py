"""What a data file holds before a reader trips on it: UTF-8 text or not (UTF-16 named as such), binary, a parquet
file or text under its name, JSON lines with a line that is not one object or holds a key twice. Each check gives one
line naming the file and what to do; the readers (toolkit.data.corpus, toolkit.data.records) call them where datasets
or arrow would raise their own error, and datasets' own log lines are kept out of the output (`datasets_quiet`)."""

from __future__ import annotations

import codecs
import contextlib
import json
import logging
from pathlib import Path

from toolkit.config.errors import UserError
from toolkit.config.files import KeyTwice, once, reencode_hint, utf16_sign


@contextlib.contextmanager
def datasets_quiet():
    """datasets' own log lines off for one read ("Failed to read schema from '...' with error ArrowInvalid" before
    our line): what it cannot read is said once, in the toolkit's one line. Its progress bars are left as they are."""
    logger = logging.getLogger("datasets")
    was = logger.level
    logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        logger.setLevel(was)


def _binary(path: Path, chunk_bytes: int = 1 << 20) -> str | None:
    """Where a file holds a NUL byte ("a NUL byte at offset 8"), or None: valid UTF-8 allows
    NUL, but no text file has one, and nearly every executable, archive or image does."""
    offset = 0
    if (sign := utf16_sign(_head(path))) is not None:
        return f"UTF-16 text ({sign}), not UTF-8"
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            if (i := chunk.find(b"\0")) >= 0:
                return f"a NUL byte at offset {offset + i}"
            offset += len(chunk)
    return None


def utf8_problem(path: Path, chunk_bytes: int = 1 << 20) -> str | None:
    """Where a file stops being UTF-8 ("byte 0xe9 at offset 325, line 4"), or None if it is UTF-8.

    Read in chunks, so that a large corpus costs no more memory than a small one."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = newlines = 0  # of the bytes before this chunk
    with open(path, "rb") as f:
        while True:
            chunk = f.read(chunk_bytes)
            pending = len(decoder.getstate()[0])  # the start of a character cut by the chunk boundary
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as exc:
                data = exc.object  # the pending bytes + this chunk
                line = newlines + data[: exc.start].count(b"\n") + 1
                return f"byte 0x{data[exc.start]:02x} at offset {offset - pending + exc.start}, line {line}"
            if not chunk:
                return None
            offset += len(chunk)
            newlines += chunk.count(b"\n")


def read_utf8(path: Path, name: str) -> str:
    """A whole file's text; when it is not UTF-8, one line naming `name` and where it breaks."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise _not_utf8_error(name, utf8_problem(path) or exc.reason, path) from None


def _head(path: Path | str, size: int = 4096) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(size)
    except OSError:
        return b""


def _not_utf8_error(name: str, where: str, path: Path | str) -> UserError:
    """`name` is not UTF-8, with what to do for the encoding its first bytes show (UTF-16 or, most likely, latin-1)."""
    return UserError(f"{name} is not UTF-8 text ({where}); {reencode_hint(_head(path))}")


def _not_utf8(source: str, files: list[str], exc: UnicodeDecodeError) -> UserError:
    """The first of `files` that is not UTF-8, named with where it breaks."""
    return _first_not_utf8(source, files) or _not_utf8_error(f"data.path={source}", exc.reason, files[0])


def _first_not_utf8(source: str, files: list[str]) -> UserError | None:
    for f in files:
        try:
            where = None if Path(f).suffix.lower() == ".parquet" else utf8_problem(Path(f))
        except OSError:  # unreadable: the caller's error says so
            continue
        if where is not None:
            name = f"data.path={source}" if len(files) == 1 else f"data.path={source}: {f}"
            return _not_utf8_error(name, where, f)
    return None


def parquet_problem(path: Path) -> str | None:
    """What `path` is instead of a parquet file (which starts and ends with PAR1), or None: empty, cut short,
    text under a .parquet name, or something else."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(4)
        f.seek(max(0, size - 4))
        tail = f.read(4)
    if head == tail == b"PAR1" and size >= 12:
        return None
    if size == 0:
        return "it is empty"
    if head == b"PAR1":
        return f"it starts as one but its footer is missing ({size:,} bytes: cut short by a copy or a download?)"
    sample = _head(path)
    if utf16_sign(sample) is not None or b"\0" not in sample and _decodes(sample):
        return "it is text, not a parquet file (those start and end with PAR1)"
    return "it does not start with PAR1, as every parquet file does"


NO_ROWS = "corresponds to no data"  # datasets' words for a file of no record (a csv's header alone, an empty table)


def parquet_rows(path: Path) -> int | None:
    """The records a parquet file holds, by its footer (None where it cannot be read): a file of columns and no row
    is valid parquet, which datasets cannot read ("corresponds to no data", a null column that casts to nothing)."""
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path).metadata.num_rows
    except Exception:  # damaged: parquet_problem or the reader says what
        return None


def _decodes(sample: bytes) -> bool:
    try:
        codecs.getincrementaldecoder("utf-8")().decode(sample)  # not final: a character cut at the end is fine
    except UnicodeDecodeError:
        return False
    return True


def not_parquet_error(name: str, why: str) -> UserError:
    return UserError(f"{name} is not a parquet file: {why}; give it the extension of what it holds (.txt, .jsonl, "
                     ".csv) or write it again, e.g. with pandas' DataFrame.to_parquet")


def _first_not_parquet(source: str, files: list[str]) -> UserError | None:
    for f in files:
        try:
            why = parquet_problem(Path(f))
        except OSError:  # unreadable: the caller's error says so
            continue
        if why is not None:
            return not_parquet_error(f"data.path={source}" if len(files) == 1 else f"data.path={source}: {f}", why)
    return None


def _only_whitespace(path: Path, chunk_bytes: int = 1 << 20) -> bool:
    try:
        with open(path, "rb") as f:
            while chunk := f.read(chunk_bytes):
                if chunk.strip():
                    return False
    except OSError:  # the caller's error says so
        return False
    return True


def _first_line_not_a_record(source: str, files: list[str]) -> UserError | None:
    """The first line of the JSON-lines `files` that is not one JSON object, named with its file and line
    number (and what is likely wrong); None where each is (or a file is one JSON document, `[...]`)."""
    for f in files:
        name = f"data.path={source}" if len(files) == 1 else f"data.path={source}: {f}"
        try:
            with open(f, encoding="utf-8-sig") as lines:
                for number, line in enumerate(lines, 1):
                    text = line.strip()
                    if not text:
                        continue  # blank lines are skipped by the reader too
                    if number == 1 and text.startswith("[") and _one_array(text, lines):
                        break  # a JSON array: datasets reads the whole file as one document
                    try:
                        record = json.loads(text, object_pairs_hook=once)
                    except json.JSONDecodeError as exc:
                        return UserError(f"{name} line {number} is not JSON ({exc.msg} at column {exc.colno}"
                                         f"{_json_hint(text)}); each line must be one JSON object, e.g. "
                                         '{"text": "..."}')
                    except KeyTwice as exc:
                        return UserError(f"{name} line {number}: {exc}; keep one")
                    if not isinstance(record, dict):
                        return UserError(f"{name} line {number} is a JSON {type(record).__name__}, not an object; "
                                         'each line must be one JSON object, e.g. {"text": "..."}')
        except (OSError, UnicodeDecodeError):  # the caller's error says so
            continue
    return None


def _one_array(first: str, rest) -> bool:
    """Whether a file whose first line is `first` (a `[`) is one JSON array (over one line or several), rather than
    JSON lines of which the first is a list: a whole array on line 1 with more lines after it is the latter."""
    try:
        json.loads(first)
    except json.JSONDecodeError:
        return True  # an array over several lines
    return not any(line.strip() for line in rest)


def _json_hint(line: str) -> str:
    """What a line that does not parse most likely has wrong."""
    if line.endswith(","):
        try:
            json.loads(line[:-1])
            return ": a trailing comma?"
        except json.JSONDecodeError:
            pass
    if line.startswith("{'"):
        return ": single quotes? JSON strings take double quotes"
    return ""


def first_utf16(source: str, files: list[str]) -> UserError | None:
    """The first of `files` that is UTF-16 text: without a byte-order mark it is valid UTF-8 (a NUL after each
    ASCII character) and would train as such."""
    for f in files:
        if Path(f).suffix.lower() != ".parquet" and utf16_sign(_head(f)) is not None:
            name = f"data.path={source}" if len(files) == 1 else f"data.path={source}: {f}"
            return _not_utf8_error(name, "NUL bytes between its characters", f)
    return None
