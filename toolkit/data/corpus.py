"""Where training text comes from: local files, a folder, a glob, a hub id, or the embedded default.

The embedded default is the Python language documentation that ships inside every CPython
(`pydoc_data.topics`, ~465 KB of English technical prose), so a first run needs no network.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import hashlib
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from toolkit.config.declarations import ALWAYS, OWN_CHECK, TOKENS, Need, free, refused
from toolkit.config.errors import UserError
from toolkit.config.load import field
from toolkit.config.user_paths import cache_dir
from toolkit.config.values import name_problems, path_problems
from toolkit.data.hub import hub_unreachable
from toolkit.data.mixture import SourceConfig, StageConfig, mixture_problems
from toolkit.data.packing import column_windows
from toolkit.data.text_files import (
    NO_ROWS,
    _binary,
    _first_line_not_a_record,
    _first_not_parquet,
    _first_not_utf8,
    _not_utf8,
    _only_whitespace,
    datasets_quiet,
    first_utf16,
    parquet_rows,
    utf8_problem,
)
from toolkit.run.paths import CACHE, READ

EMBEDDED = "embedded:python-docs"
_BUILDERS = {".txt": "text", ".text": "text", ".md": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


# used_when= of data.name and data.split, and of data.val_fraction: why the key has no effect (None where it has)
def _sources_name_their_own(cfg) -> str | None:
    return "data.sources name their own" if cfg.data.sources else None


def _held_out_of_its_own(cfg) -> str | None:
    return f"data.val_path={cfg.data.val_path} is the held-out data" if getattr(cfg.data, "val_path", None) else None


TEXT_DATA = Need("data.format", ("text",), "text data's")  # a recipe without data.format reads text


@dataclass
class DataConfig:
    path: str | None = field(
        None, help="text/jsonl/parquet file, folder, glob or hub dataset id; empty = embedded Python docs. A folder "
        "with none of those reads its files without an extension (LICENSE-style) as text, skipping binary ones",
        resume=refused(TOKENS), used_when=ALWAYS, path=READ,
        accepts={"unset": "the embedded corpus, as documented (data.path=)"},
    )
    text_column: str = field("text", help="column holding the text in jsonl/parquet/hub data", resume=refused(TOKENS),
                             used_when=TEXT_DATA, path=None, accepts={
                                 "long": "a column is looked up by name: a missing one is refused when the data is read"})
    sample_by: Literal["document", "paragraph", "line"] = field(
        "paragraph", help="how plain-text files split into documents", resume=refused(TOKENS), used_when=TEXT_DATA
    )
    name: str | None = field(
        None, help="hub dataset config name, e.g. wikitext-103-raw-v1", resume=refused(TOKENS),
        used_when=_sources_name_their_own, path=None, accepts={
            "unset": "no hub config: the default",
            "long": "a hub config is looked up by name: a missing one is refused when the data is read"},
    )
    split: str = field(
        "train", help="split to read from a hub dataset", resume=refused(TOKENS), used_when=_sources_name_their_own,
        path=None, accepts={"long": "a split is looked up by name: a missing one is refused when the data is read"},
    )
    val_fraction: float = field(
        0.05, help="fraction of documents held out for evaluation (0 = no eval)", resume=refused(TOKENS),
        used_when=_held_out_of_its_own, accepts={"0": "no held-out data, as documented"},
    )
    seq_len: int = field(256, help="tokens per packed block", resume=refused(TOKENS), used_when=ALWAYS, accepts={
        "2**31": "finetune: refused once the base model is loaded, before any data work (more than its positions)"})
    num_proc: int = field(
        2, help="processes for tokenization on each node, shared by its ranks", resume=free("tokenization processes"),
        used_when=ALWAYS,
        accepts={"2**31": "datasets forks only where the corpus has 2 x num_proc documents: here, none"},
    )
    cache_dir: str | None = field(
        None, help="where tokenized blocks are cached; default ~/.cache/llm-toolkit",
        resume=free("where the same blocks are cached"), used_when=ALWAYS, path=CACHE,
        accepts={"unset": "~/.cache/llm-toolkit"},
    )
    streaming: bool = field(
        False, help="read, tokenize and pack the documents while training (pretraining; needs train.max_steps): "
        "training starts at once, nothing is prepared ahead; the blocks then depend on the number of data ranks",
        resume=OWN_CHECK, used_when=ALWAYS,
    )
    stream_val_documents: int = field(
        100, help="with streaming: the stream's first N documents are held out for evaluation (when val_fraction > 0)",
        resume=refused(TOKENS), used_when=Need("data.streaming", (True,), "streaming's"), accepts={
            "2**31": "a stream of fewer documents is refused once read, before training (recipes/pretrain.py: it "
                     "leaves none to train on); fine-tuning does not stream, and the note says the key is ignored",
            "0": "finetune: it does not stream, and the note says the key is ignored",
            "-1": "finetune: it does not stream, and the note says the key is ignored"},
    )
    sources: list[SourceConfig] = field(
        default_factory=list, help="corpora mixed by weight, each {name, path, weight, text_column, sample_by, "
        "subset, split; chat: record_format, columns}, instead of data.path (docs/data.md)",
        resume=OWN_CHECK, used_when=ALWAYS, unique=False, accepts={"[]": "one corpus, data.path: the default"},
    )
    stages: list[StageConfig] = field(
        default_factory=list, help="from a step on, other weights for data.sources: [{start_step, weights: {name: w}}]",
        resume=OWN_CHECK, used_when=ALWAYS, unique=False,
        accepts={"[]": "the sources' weights all along: the default"},
    )

    def validate(self) -> list[str]:
        problems = path_problems(self, ("path", "cache_dir")) + name_problems(self, ("text_column", "name", "split"))
        if not 0 <= self.val_fraction < 1:
            problems.append(f"val_fraction={self.val_fraction} must be in [0, 1)")
        if self.seq_len < 8:
            problems.append(f"seq_len={self.seq_len} is too short; use at least 8 tokens")
        if self.num_proc < 1:
            problems.append(f"num_proc={self.num_proc} must be at least 1")
        if self.streaming and self.val_fraction > 0 and self.stream_val_documents < 1:
            problems.append(f"stream_val_documents={self.stream_val_documents} must be at least 1 (or set val_fraction=0)")
        if self.sources and self.path:
            problems.append(f"path={self.path} and sources are both set; list it in data.sources as one more source "
                            "and leave data.path empty (data.path=), or drop data.sources")
        return problems + mixture_problems(self.sources, self.stages) + self.source_problems()

    def source_problems(self) -> list[str]:
        """A source's settings that this section does not read: pretraining reads text, not chat records."""
        return [f"sources[{i}].{key} maps chat records; pretraining reads text: drop it" for i, s in
                enumerate(self.sources) if s is not None for key in ("record_format", "columns") if getattr(s, key)]

    def of_sources(self) -> list[DataConfig]:
        """Each of data.sources as a data section of its own (the one corpus of data.path is the only one)."""
        if not self.sources:
            return [self]
        return [dataclasses.replace(self, path=s.path, text_column=s.text_column, sample_by=s.sample_by,
                                    name=s.subset, split=s.split, sources=[], stages=[]) for s in self.sources]

    def resolved_cache_dir(self) -> Path:
        return cache_dir(self.cache_dir)


NO_TEXT = "no text (the text column null, empty or only whitespace)"


def load_held_out(cfg: DataConfig, notes: list[str] | None = None) -> datasets.Dataset:
    """The documents of data.val_path (a fine-tune's held-out text of its own), read as data.path is; its errors
    name data.val_path."""
    try:
        # its own file, folder or hub dataset: a hub id's train split, as chat and preference held-out data are read
        return load_corpus(dataclasses.replace(cfg, path=cfg.val_path, name=None, split="train"), notes)[0]
    except UserError as exc:
        raise UserError(str(exc).replace("data.path", "data.val_path")) from None


def load_corpus(cfg: DataConfig, notes: list[str] | None = None,
                dropped: Counter | None = None) -> tuple[datasets.Dataset, str]:
    """Return (dataset with one `text` column of non-empty documents, fingerprint of the source).

    `notes` (when given) gets a line when files without an extension were read as plain text,
    saying how many were skipped as binary; `dropped` (a preview's table) counts the records skipped with no text."""
    if not cfg.path:
        from pydoc_data.topics import topics

        texts = [topics[k] for k in sorted(topics)]
        ds = datasets.Dataset.from_dict({"text": texts})
        return _non_empty(ds, EMBEDDED), _hash(EMBEDDED, *texts)

    files, builder, kwargs = _file_source(cfg, notes)
    if files is not None:
        try:
            with datasets_quiet():
                ds = datasets.load_dataset(builder, data_files=files, split="train", **kwargs)
        except Exception as exc:  # datasets' own error, or a binary file's failed gzip/zip extraction (zlib.error)
            cause = (exc.__cause__ or exc) if isinstance(exc, datasets.exceptions.DatasetGenerationError) else exc
            if isinstance(cause, UnicodeDecodeError):  # the text builder decodes as it reads
                raise _not_utf8(cfg.path, files, cause) from None
            if builder == "parquet" and (error := _first_not_parquet(cfg.path, files)) is not None:
                raise error from None  # arrow's "magic bytes not found in footer" says neither what nor what to do
            if builder != "parquet" and (error := _first_not_utf8(cfg.path, files)) is not None:
                raise error from None  # what is wrong with the file, rather than where datasets tripped on it
            if builder == "text" and all(_only_whitespace(Path(f)) for f in files):  # datasets: "corresponds to no data"
                raise UserError(f"data.path={cfg.path} holds no text (all {len(files)} file(s) are empty or whitespace)") from None
            if builder == "json" and (error := _first_line_not_a_record(cfg.path, files)) is not None:
                raise error from None  # arrow's "The document is empty" names neither the file nor the line
            if NO_ROWS in str(cause):  # blank lines only, or a table of no row
                raise UserError(f"data.path={cfg.path} holds no text: no record in its {len(files)} file(s)") from None
            raise UserError(f"could not read data.path={cfg.path} as {builder}: {cause}") from None
        stats = [(f, os.path.getsize(f), os.path.getmtime(f)) for f in files]
        fingerprint = _hash(builder, cfg.sample_by, cfg.text_column, repr(stats))
    else:
        ds = _hub_dataset(cfg, streaming=False)
        fingerprint = _hash(cfg.path, str(cfg.name), cfg.split, cfg.text_column, ds._fingerprint)

    if cfg.text_column not in ds.column_names:
        raise UserError(
            f"data.text_column={cfg.text_column} is not in {cfg.path}; its columns are {ds.column_names}"
        )
    try:
        before = len(ds)
        ds = _non_empty(ds, cfg.path, cfg.text_column)
        if dropped is not None and len(ds) < before and (files is None or builder != "text"):
            dropped[NO_TEXT] += before - len(ds)
        if notes is not None and len(ds) < before and (files is None or builder != "text"):
            # records (jsonl, parquet, a hub set) whose text is null or blank; plain text has no empty documents
            notes.append(f"data.path={cfg.path}: skipped {before - len(ds)} of {before} records with no text "
                         f"({cfg.text_column} null, empty or only whitespace)")
    except UnicodeDecodeError as exc:  # the json builder stores the bytes unchecked; the first read decodes them
        if files is None:
            raise
        raise _not_utf8(cfg.path, files, exc) from None
    ds = ds.select_columns([cfg.text_column])
    if cfg.text_column != "text":
        ds = ds.rename_column(cfg.text_column, "text")
    return ds, fingerprint


def _file_source(cfg: DataConfig, notes: list[str] | None) -> tuple[list[str] | None, str, dict]:
    """(files, datasets builder, its arguments) of a local data.path; (None, "", {}) for a hub id."""
    try:
        files = _local_files(cfg.path, notes if notes is not None else [])
    except PermissionError as exc:  # a folder on the way that this user may not enter
        raise UserError(f"data.path={cfg.path} cannot be read: {exc.strerror}: {exc.filename}; check its permissions") from None
    if files is None:
        local = Path(cfg.path).expanduser()
        if os.path.lexists(local):  # there, but neither a file nor a folder: reading a pipe would wait for ever
            what = "a broken symlink" if local.is_symlink() and not local.exists() else "a pipe, socket or device"
            raise UserError(f"data.path={cfg.path} is {what}, not a file or folder; give a file, a folder or a glob")
        if local_only(cfg.path):
            raise UserError(
                f"data.path={cfg.path} does not exist; give a file, a folder, a glob, or a hub id like org/name"
            )
        return None, "", {}
    exts = {Path(f).suffix.lower() for f in files}
    builders = {_BUILDERS.get(e, "text" if e == "" else None) for e in exts}  # no extension: plain text
    if None in builders or len(builders) != 1:
        kinds = sorted(e or "(no extension)" for e in exts)
        if None not in builders:  # each readable, read differently (a model folder's .json and .md: not a corpus)
            raise UserError(f"data.path={cfg.path} mixes files of types {kinds}, each read its own way; give files of "
                            f"one kind, e.g. a glob such as {Path(cfg.path) / ('*' + kinds[-1])}")
        raise UserError(f"data.path={cfg.path} holds files of types {kinds}; use one of {sorted(_BUILDERS)} (all of one kind)")
    builder = builders.pop()
    if (error := first_utf16(cfg.path, files)) is not None:
        raise error
    if all(os.path.getsize(f) == 0 for f in files):
        raise UserError(f"data.path={cfg.path} holds no text (all {len(files)} file(s) are empty)")
    if builder == "parquet":  # a file of columns and no row: valid parquet, which datasets refuses to read
        files = [f for f in files if parquet_rows(Path(f)) != 0] or _no_rows(cfg.path, files)
    return files, builder, {"sample_by": cfg.sample_by} if builder == "text" else {}


def _no_rows(path: str, files: list[str]):
    what = "its parquet file has" if len(files) == 1 else f"its {len(files)} parquet files have"
    raise UserError(f"data.path={path} holds no records: {what} columns and no row; give a file with records")


def _hub_dataset(cfg: DataConfig, streaming: bool) -> datasets.Dataset | datasets.IterableDataset:
    """data.path as a hub dataset id: loaded (cached by datasets), or opened as a stream."""
    return hub_dataset(cfg.path, cfg.name, cfg.split, "data.path", streaming)


@contextlib.contextmanager
def _offline(offline: bool):
    """datasets and the hub client as HF_HUB_OFFLINE=1 sets them at start-up, for one load."""
    import huggingface_hub

    was = datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE
    if offline:
        datasets.config.HF_HUB_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE = was


def hub_dataset(name: str, subset: str | None, split: str, key: str, streaming: bool = False
                ) -> datasets.Dataset | datasets.IterableDataset:
    """`name` (what `key` holds) as a hub dataset, or a local folder laid out as the hub lays one out: its `split`,
    loaded (cached by datasets) or opened as a stream; what goes wrong in one line."""
    local = Path(name).expanduser().exists()
    where = f"{key}={name}" + ("" if local else " (no local file or folder has that name)")
    # where the Hub cannot be reached, only the cache is read: the hub client would retry for ~30 s, printing each
    # retry, before it says so
    unreachable = None if local or streaming else hub_unreachable()
    try:
        with _offline(unreachable is not None), datasets_quiet():
            return datasets.load_dataset(name, subset, split=split, streaming=streaming)
    except ConnectionError as exc:  # offline and never cached, or HF_HUB_OFFLINE=1
        exc = unreachable or exc  # what the connection said, rather than the offline mode set for it
        fix = ("streaming needs the network for a hub id; give a local file, folder or glob" if streaming else
               "give a local file, folder or glob, or load it once with a network (it is then cached)")
        raise UserError(f"{where} is read as a hub dataset id, but the Hub cannot be reached ({exc}); {fix}") from None
    except Exception as exc:  # the hub client and datasets raise many types, often around the cause: say both
        said = " ".join(str(e).splitlines()[0][:200] for e in (exc, exc.__cause__) if e is not None and str(e))
        raise UserError(f"{where} could not be {'streamed' if streaming else 'read'} as a hub dataset (split={split}): "
                        f"{said or type(exc).__name__}") from None


def stream_corpus(cfg: DataConfig, notes: list[str] | None = None) -> tuple[datasets.IterableDataset, str]:
    """The corpus as a stream of documents (data.streaming=true), read as training asks for them:
    nothing is converted to arrow or tokenized ahead. Its `text` column is checked as it is read
    (`toolkit.data.streaming`). Returns (stream, fingerprint of the source)."""
    if not cfg.path:
        ds, source = load_corpus(cfg, notes)
        return ds.to_iterable_dataset(), source
    files, builder, kwargs = _file_source(cfg, notes)
    if files is not None:
        with datasets_quiet():
            ds = datasets.load_dataset(builder, data_files=files, split="train", streaming=True, **kwargs)
        stats = [(f, os.path.getsize(f), os.path.getmtime(f)) for f in files]
        source = _hash("stream", builder, cfg.sample_by, cfg.text_column, repr(stats))
    else:
        ds = _hub_dataset(cfg, streaming=True)
        source = _hash("stream", cfg.path, str(cfg.name), cfg.split, cfg.text_column)
    columns = ds.column_names  # None where the format does not say before reading (json)
    if columns is not None and cfg.text_column not in columns:
        raise UserError(f"data.text_column={cfg.text_column} is not in {cfg.path}; its columns are {columns}")
    return ds, source


def split_documents(ds: datasets.Dataset, val_fraction: float, seed: int) -> tuple[datasets.Dataset, datasets.Dataset | None]:
    """Hold out whole documents (never half a document) for evaluation, deterministically."""
    if val_fraction == 0:
        return ds, None
    n = len(ds)
    n_val = max(1, round(n * val_fraction))
    if n - n_val < 1:
        raise UserError(
            f"the corpus has {n} document(s); cannot hold out {val_fraction:.0%} for validation "
            "and still train; add text or set data.val_fraction=0"
        )
    order = np.random.default_rng(seed).permutation(n)
    return ds.select(np.sort(order[n_val:])), ds.select(np.sort(order[:n_val]))


def local_only(path: str) -> bool:
    """Whether a data path that is not on this machine can only be a missing local one: a hub id is `org/name`, with no
    extension, not starting like a path."""
    return bool(Path(path).suffix) or "/" not in path or path.startswith((".", "/", "~"))


def _local_files(path: str, notes: list[str]) -> list[str] | None:
    p = Path(path).expanduser()
    if p.is_file():
        try:
            why = None if p.suffix else _binary(p)
        except OSError as exc:
            raise UserError(f"data.path={path} cannot be read ({exc.strerror or exc}); check its permissions") from None
        if why is not None:
            raise UserError(f"data.path={path} is a binary file ({why}), not text; give a text, jsonl or parquet file")
        return [str(p)]
    if p.is_dir():
        if not os.access(p, os.R_OK | os.X_OK):  # rglob would find nothing and say nothing
            raise PermissionError(13, "Permission denied", str(p))
        found = sorted(f for f in p.rglob("*") if f.is_file())
        files = [str(f) for f in found if f.suffix.lower() in _BUILDERS]
        if files:
            return files
        # LICENSE-style files are read only from a folder with no corpus files, so that a README
        # beside .jsonl data never changes what a run reads. Hidden ones (.git/config) never are.
        bare = [f for f in found if not f.suffix and not any(s.startswith(".") for s in f.relative_to(p).parts)]
        kinds = "/".join(sorted(_BUILDERS))
        if not bare:
            raise UserError(f"data.path={path} is a folder with no {kinds} files and no text files without an extension")
        files, skipped = _plain_text(bare)
        if not files:
            raise UserError(
                f"data.path={path} is a folder with no {kinds} files, and none of its {len(bare)} file(s) without "
                f"an extension is UTF-8 text ({skipped[0]}); give a folder of text, jsonl or parquet files"
            )
        notes.append(_plain_text_note(path, files, skipped))
        return files
    if any(ch in path for ch in "*?["):
        matched = sorted(Path(f) for f in glob.glob(os.path.expanduser(path), recursive=True) if os.path.isfile(f))
        bare = [f for f in matched if not f.suffix]
        files, skipped = _plain_text(bare) if bare else ([], [])
        if bare:
            notes.append(_plain_text_note(path, files, skipped))
        if bare and not files and len(bare) == len(matched):
            raise UserError(
                f"data.path={path} matches {len(bare)} file(s) without an extension and none is UTF-8 text "
                f"({skipped[0]}); give text, jsonl or parquet files"
            )
        files = sorted([str(f) for f in matched if f.suffix] + files)
        if not files:
            raise UserError(f"data.path={path} matches no files")
        return files
    return None


def _plain_text(candidates: list[Path]) -> tuple[list[str], list[str]]:
    """Files without an extension split into (those that are UTF-8 text, "file: why" for the others)."""
    text, skipped = [], []
    for f in candidates:
        try:
            why = _binary(f) or utf8_problem(f)
        except OSError as exc:  # unreadable: skipped and named, like a binary file
            why = exc.strerror or str(exc)
        if why is None:
            text.append(str(f))
        else:
            skipped.append(f"{f}: {why}")
    return text, skipped


def _plain_text_note(path: str, files: list[str], skipped: list[str]) -> str:
    note = f"data.path={path}: read {len(files)} file(s) without an extension as plain text"
    if skipped:
        note += f"; skipped {len(skipped)} that are binary or not UTF-8 (first: {skipped[0]})"
    return note


def _non_empty(ds: datasets.Dataset, source: str, column: str = "text") -> datasets.Dataset:
    """The documents whose `column` holds more than whitespace; a value that is not text is refused."""
    keep = _non_empty_rows(ds, column)
    if keep is not None:
        if not keep.any():
            raise UserError(f"data.path={source} holds no text (0 non-empty documents)")
        return ds if keep.all() else ds.select(np.flatnonzero(keep))

    def check(batch: dict, indices: list[int]) -> list[bool]:
        for text, i in zip(batch[column], indices, strict=True):
            if text is not None and not isinstance(text, str):  # a number, list or mapping: json keeps its type
                raise not_text(source, f"record {i}", column, text)
        return [bool(t and t.strip()) for t in batch[column]]

    ds = ds.filter(check, batched=True, with_indices=True)
    if len(ds) == 0:
        raise UserError(f"data.path={source} holds no text (0 non-empty documents)")
    return ds


def not_text(source: str, record: str, column: str, value) -> UserError:
    return UserError(
        f"data.path={source}: {record} has {column}={value!r:.60} ({type(value).__name__}), not text; "
        "set data.text_column to a column of strings"
    )


def _non_empty_rows(ds: datasets.Dataset, column: str) -> np.ndarray | None:
    """Which rows hold more than whitespace, computed by arrow over plain reads of the files, so that
    the corpus's text does not stay in this process's RSS (datasets' filter reads it through the
    memory map: 4 GB of resident pages for 1B tokens). None when `column` is not valid UTF-8 strings:
    datasets' per-record read then says which record is wrong."""
    if ds.features.get(column) not in (datasets.Value("string"), datasets.Value("large_string")):
        return None
    masks = []
    try:
        for texts in column_windows(ds, column):
            texts.validate(full=True)  # UTF-8
            length = pc.utf8_length(pc.utf8_trim_whitespace(texts))
            masks.append(pc.fill_null(pc.greater(length, 0), False).to_numpy(zero_copy_only=False))
    except pa.ArrowInvalid:
        return None
    return np.concatenate(masks) if masks else np.zeros(0, dtype=bool)


def _hash(*parts: str) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    return h.hexdigest()[:16]
