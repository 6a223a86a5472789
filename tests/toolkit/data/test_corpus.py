"""Where training text comes from: the embedded default, local files, folders and globs, and the
held-out split. Every wrong path must end in one clear UserError, never a datasets traceback."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from unittest import mock

import datasets
import pytest
from unprivileged import error_as_nobody

from toolkit.config.errors import UserError
from toolkit.data.corpus import EMBEDDED, DataConfig, load_corpus, split_documents, utf8_problem

TEXT = "first para line1\nline2\n\nsecond para\n\n\n\nthird\n"


def corpus(path, **kwargs) -> tuple[list[str], str]:
    ds, fingerprint = load_corpus(DataConfig(path=str(path), **kwargs))
    assert ds.column_names == ["text"]
    return list(ds["text"]), fingerprint


# the embedded default


def test_the_default_is_the_pydoc_topics(tiny_texts):
    ds, fingerprint = load_corpus(DataConfig())
    assert ds.column_names == ["text"]
    assert list(ds["text"]) == [t for t in tiny_texts if t.strip()]
    assert len(ds) > 50
    assert load_corpus(DataConfig(path=""))[1] == fingerprint  # empty = the default too
    assert len(fingerprint) == 16 and fingerprint != EMBEDDED


# local files


def test_a_text_file_split_by_paragraph_line_or_document(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text(TEXT)
    by_paragraph, fp_paragraph = corpus(f)
    assert [t.strip() for t in by_paragraph] == ["first para line1\nline2", "second para", "third"]
    by_line, fp_line = corpus(f, sample_by="line")
    assert by_line == ["first para line1", "line2", "second para", "third"]  # blank lines dropped
    by_document, fp_document = corpus(f, sample_by="document")
    assert by_document == [TEXT]
    assert len({fp_paragraph, fp_line, fp_document}) == 3  # the split is part of the cache key


def test_the_fingerprint_is_stable_and_follows_the_file(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text(TEXT)
    _, first = corpus(f)
    assert corpus(f)[1] == first
    f.write_text(TEXT + "\nfourth, longer paragraph\n")
    texts, changed = corpus(f)
    assert changed != first
    assert texts[-1].strip() == "fourth, longer paragraph"


def test_a_folder_reads_its_text_files_recursively_and_ignores_others(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_text("from b\n")
    (tmp_path / "a.md").write_text("from a\n")
    (tmp_path / "sub" / "c.txt").write_text("from c\n")
    (tmp_path / "notes.csv").write_text("x,y\n")  # not a corpus type: skipped
    texts, _ = corpus(tmp_path)
    assert [t.strip() for t in texts] == ["from a", "from b", "from c"]  # sorted by path


def test_a_glob_reads_only_what_it_matches(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("from a\n")
    (tmp_path / "b.txt").write_text("from b\n")
    (tmp_path / "sub" / "c.txt").write_text("from c\n")
    assert [t.strip() for t in corpus(tmp_path / "*.txt")[0]] == ["from a", "from b"]
    assert [t.strip() for t in corpus(f"{tmp_path}/**/*.txt")[0]] == ["from a", "from b", "from c"]
    assert [t.strip() for t in corpus(tmp_path / "sub" / "?.txt")[0]] == ["from c"]


def license_folder(root):
    """LICENSE-style files, and files without an extension that are not text."""
    (root / "sub").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / "LICENSE").write_text("MIT License\n\nPermission is granted.\n")
    (root / "sub" / "NOTICE").write_text("Notice paragraph\n")
    (root / ".git" / "config").write_text("[core]\n")  # hidden: never corpus text
    (root / "blob").write_bytes(b"\x7fELF\x02\x01\x00\x00")  # valid UTF-8, but a NUL byte
    (root / "LATIN1").write_bytes("caf\u00e9\n".encode("latin-1"))
    return root


def test_a_folder_of_files_without_an_extension_is_read_and_packed_as_plain_text(tmp_path, tiny_tokenizer):
    from toolkit.data.packing import packed_splits

    folder = license_folder(tmp_path / "licenses")
    notes = []
    ds, source = load_corpus(DataConfig(path=str(folder)), notes)
    assert [t.strip() for t in ds["text"]] == ["MIT License", "Permission is granted.", "Notice paragraph"]
    assert notes == [
        f"data.path={folder}: read 2 file(s) without an extension as plain text; skipped 2 that are binary or "
        f"not UTF-8 (first: {folder / 'LATIN1'}: byte 0xe9 at offset 3, line 1)"
    ]
    cfg = DataConfig(path=str(folder), seq_len=16, val_fraction=0, cache_dir=str(tmp_path / "cache"))
    train, _ = packed_splits(ds, None, tiny_tokenizer, cfg, source, seed=0)
    packed = tiny_tokenizer.decode([i for row in train["input_ids"] for i in row])
    assert "MIT License" in packed and "Notice paragraph" in packed and "[core]" not in packed


def test_files_without_an_extension_beside_corpus_files_are_ignored(tmp_path):
    (tmp_path / "docs.jsonl").write_text('{"text": "a record"}\n')
    (tmp_path / "README").write_text("about this data set\n")  # read before, it would mix kinds
    notes = []
    assert load_corpus(DataConfig(path=str(tmp_path)), notes)[0]["text"] == ["a record"]
    assert notes == []


def test_a_glob_skips_the_binary_files_without_an_extension_it_matches(tmp_path):
    license_folder(tmp_path)
    (tmp_path / "a.txt").write_text("from a\n")
    notes = []
    texts = [t.strip() for t in load_corpus(DataConfig(path=str(tmp_path / "*")), notes)[0]["text"]]
    assert texts == ["MIT License", "Permission is granted.", "from a"]  # sorted by path
    assert "read 1 file(s) without an extension as plain text; skipped 2" in notes[0]


def test_one_file_without_an_extension(tmp_path):
    (tmp_path / "LICENSE").write_text("MIT License\n")
    assert corpus(tmp_path / "LICENSE")[0] == ["MIT License\n"]
    (tmp_path / "blob").write_bytes(b"MZ\x90\x00")
    with pytest.raises(UserError) as info:
        load_corpus(DataConfig(path=str(tmp_path / "blob")))
    assert str(info.value) == (
        f"data.path={tmp_path / 'blob'} is a binary file (a NUL byte at offset 3), not text; give a text, jsonl or "
        "parquet file"
    )


def test_a_folder_of_only_binary_files_without_an_extension(tmp_path):
    (tmp_path / "a").write_bytes(b"\x00\x01")
    (tmp_path / "b").write_bytes(b"\xff\xfe")
    with pytest.raises(UserError) as info:
        load_corpus(DataConfig(path=str(tmp_path)))
    assert str(info.value) == (
        f"data.path={tmp_path} is a folder with no .json/.jsonl/.md/.parquet/.text/.txt files, and none of its 2 "
        f"file(s) without an extension is UTF-8 text ({tmp_path / 'a'}: a NUL byte at offset 0); give a folder of "
        "text, jsonl or parquet files"
    )
    with pytest.raises(UserError, match=r"matches 2 file\(s\) without an extension and none is UTF-8 text"):
        load_corpus(DataConfig(path=str(tmp_path / "*")))


def test_jsonl_with_another_text_column_is_renamed(tmp_path):
    rows = [{"body": "doc one", "id": 1}, {"body": "  ", "id": 2}, {"body": "doc three", "id": 3}]
    f = tmp_path / "docs.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    texts, _ = corpus(f, text_column="body")
    assert texts == ["doc one", "doc three"]  # the blank document is dropped, other columns too


# mistakes


@pytest.mark.parametrize("path", ["./no/such/dir", "missing.txt", "nohubid", "~/no-such-file-here.txt"])
def test_a_missing_path_says_what_to_give(path):
    with pytest.raises(UserError, match=rf"data.path={path} does not exist; give a file, a folder, a glob"):
        load_corpus(DataConfig(path=path))


def test_an_absolute_missing_path(tmp_path):
    path = str(tmp_path / "gone" / "corpus")
    with pytest.raises(UserError, match="does not exist"):
        load_corpus(DataConfig(path=path))


def test_a_glob_matching_nothing(tmp_path):
    with pytest.raises(UserError, match=r"matches no files"):
        load_corpus(DataConfig(path=str(tmp_path / "*.txt")))


def test_a_folder_without_corpus_files(tmp_path):
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(UserError, match=r"is a folder with no .*\.txt.* files"):
        load_corpus(DataConfig(path=str(tmp_path)))


def test_files_of_mixed_kinds(tmp_path):
    (tmp_path / "a.txt").write_text("x\n")
    (tmp_path / "b.jsonl").write_text('{"text": "y"}\n')
    with pytest.raises(UserError) as refused:  # was "holds files of types ['.jsonl', '.txt']; use one of [..., '.jsonl',
        load_corpus(DataConfig(path=str(tmp_path)))  # ..., '.txt'] (all of one kind)", naming both as the fix
    assert str(refused.value) == (f"data.path={tmp_path} mixes files of types ['.jsonl', '.txt'], each read its own way; "
                                  f"give files of one kind, e.g. a glob such as {tmp_path / '*.txt'}")


def test_an_unsupported_file_type(tmp_path):
    f = tmp_path / "table.csv"
    f.write_text("text\nhello\n")
    with pytest.raises(UserError, match=r"holds files of types \['.csv'\]"):
        load_corpus(DataConfig(path=str(f)))


def test_all_files_empty(tmp_path):
    (tmp_path / "a.txt").write_text("")
    (tmp_path / "b.txt").write_text("")
    with pytest.raises(UserError, match=r"holds no text \(all 2 file\(s\) are empty\)"):
        load_corpus(DataConfig(path=str(tmp_path)))


def test_only_whitespace_is_an_empty_corpus(tmp_path):
    f = tmp_path / "blank.txt"
    f.write_text("   \n\n \n\t\n")
    with pytest.raises(UserError, match=r"holds no text \(0 non-empty documents\)"):
        load_corpus(DataConfig(path=str(f)))


def load_error_as_nobody(path, cache: Path) -> str:
    """load_corpus's error for `path` as a user without root's pass through permission bits, who
    keeps datasets' cache in `cache` (root's own is closed to it)."""

    def load():
        with mock.patch.object(datasets.config, "HF_DATASETS_CACHE", cache):
            load_corpus(DataConfig(path=str(path)))

    return error_as_nobody(load)


def test_a_folder_this_user_may_not_read(tmp_path):
    """Before: a folder it may not list was 'a folder with no ... files', a file in a folder it may not
    enter a PermissionError traceback."""
    shared = Path(tempfile.mkdtemp(prefix="corpus-permissions-", dir="/tmp"))  # others may enter /tmp, not tmp_path
    try:
        shared.chmod(0o755)
        cache = shared / "cache"
        cache.mkdir(mode=0o777)
        cache.chmod(0o777)
        locked = shared / "locked"
        locked.mkdir()
        (locked / "a.txt").write_text("a document\n")
        locked.chmod(0o700 if os.geteuid() == 0 else 0o000)  # root owns it: nobody may not read it
        assert load_error_as_nobody(locked, cache) == (
            f"UserError: data.path={locked} cannot be read: Permission denied: {locked}; check its permissions"
        )
        assert load_error_as_nobody(locked / "a.txt", cache) == (
            f"UserError: data.path={locked / 'a.txt'} cannot be read: Permission denied: {locked / 'a.txt'}; check its "
            "permissions"
        )
        private = shared / "private.txt"  # in a folder anyone may read
        private.write_text("a document\n")
        private.chmod(0o600 if os.geteuid() == 0 else 0o000)
        assert load_error_as_nobody(private, cache) == (
            f"UserError: could not read data.path={private} as text: [Errno 13] Permission denied: '{private}'"
        )
    finally:
        (shared / "locked").chmod(0o700)
        shutil.rmtree(shared)


def test_a_pipe_or_a_broken_symlink_is_not_a_missing_path(tmp_path):
    os.mkfifo(tmp_path / "pipe.txt")  # opening it would wait for a writer for ever
    with pytest.raises(UserError, match=r"pipe.txt is a pipe, socket or device, not a file or folder"):
        load_corpus(DataConfig(path=str(tmp_path / "pipe.txt")))
    (tmp_path / "link.txt").symlink_to(tmp_path / "moved.txt")
    with pytest.raises(UserError, match=r"link.txt is a broken symlink, not a file or folder"):
        load_corpus(DataConfig(path=str(tmp_path / "link.txt")))


@pytest.mark.parametrize("value", [3, ["a", "b"], {"a": "b"}])
def test_a_text_column_that_is_not_strings(tmp_path, value):
    """Before: an AttributeError traceback from the empty-document filter."""
    f = tmp_path / "docs.jsonl"
    f.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": value}) + "\n")
    with pytest.raises(UserError) as info:
        load_corpus(DataConfig(path=str(f)))
    assert str(info.value) == (
        f"data.path={f}: record 1 has text={value!r} ({type(value).__name__}), not text; set data.text_column to a "
        "column of strings"
    )


def test_a_binary_file_named_txt_that_looks_compressed(tmp_path):
    """datasets unpacks gzip by its magic bytes; a broken one used to end in a zlib.error traceback."""
    f = tmp_path / "corpus.txt"
    f.write_bytes(b"\x1f\x8b\x08\x00" + bytes(range(256)))
    with pytest.raises(UserError, match=r"corpus.txt is not UTF-8 text \(byte 0x8b at offset 1, line 1\)"):
        load_corpus(DataConfig(path=str(f)))


def test_a_hub_id_while_offline_says_so(monkeypatch):
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UserError) as info:
        load_corpus(DataConfig(path="org/corpus"))
    assert str(info.value).startswith("data.path=org/corpus (no local file or folder has that name) is read as a hub dataset id, but the Hub cannot be reached (")
    assert str(info.value).endswith("give a local file, folder or glob, or load it once with a network (it is then cached)")


def test_a_missing_text_column_lists_the_columns(tmp_path):
    f = tmp_path / "docs.jsonl"
    f.write_text('{"content": "x", "id": 1}\n')
    with pytest.raises(
        UserError, match=r"data.text_column=text is not in .*; its columns are \['content', 'id'\]"
    ):
        load_corpus(DataConfig(path=str(f)))


def test_unreadable_json_is_a_user_error(tmp_path):
    f = tmp_path / "docs.jsonl"
    f.write_text('{"text": "ok"}\nnot json at all\n')
    with pytest.raises(UserError, match=rf"data.path={f} line 2 is not JSON \(Expecting value at column 1\); each line"):
        load_corpus(DataConfig(path=str(f)))


JSON_LINES = {  # (the file, what the error says after "data.path=docs.jsonl ")
    "trailing comma": ('{"text": "hello world"},\n{"text": "more"},\n',
                       "line 1 is not JSON (Extra data at column 24: a trailing comma?); each line must be one JSON "
                       'object, e.g. {"text": "..."}'),
    "a missing brace": ('{"text": "a"}\n\n{"text": "b"\n', "line 3 is not JSON (Expecting ',' delimiter at column 13)"),
    "single quotes": ("{'text': 'a'}\n", "line 1 is not JSON (Expecting property name enclosed in double quotes at "
                                         "column 2: single quotes? JSON strings take double quotes)"),
    "not an object": ('"a"\n"b"\n', "line 1 is a JSON str, not an object"),
}


@pytest.mark.parametrize("kind", JSON_LINES)
def test_a_jsonl_line_that_is_not_a_json_object_is_named_by_its_number(tmp_path, kind):
    """Arrow's own words were "JSON parse error: The document is empty", with neither file nor line."""
    text, message = JSON_LINES[kind]
    f = tmp_path / "docs.jsonl"
    f.write_text(text)
    with pytest.raises(UserError) as err:
        load_corpus(DataConfig(path=str(f)))
    assert str(err.value).startswith(f"data.path={f} {message}")


def test_a_file_of_only_newlines_holds_no_text(tmp_path):
    """datasets said 'Instruction "train" corresponds to no data!'."""
    f = tmp_path / "corpus.txt"
    f.write_text("\n" * 4)
    with pytest.raises(UserError) as err:
        load_corpus(DataConfig(path=str(f)))
    assert str(err.value) == f"data.path={f} holds no text (all 1 file(s) are empty or whitespace)"


@pytest.mark.parametrize("text", ['[{"text": "a b"}, {"text": "c"}]\n', '\ufeff{"text": "a b"}\n\n\n{"text": "c"}\n'],
                         ids=["a JSON array named .jsonl", "a BOM and blank lines"])
def test_json_lines_that_are_read_as_they_are(tmp_path, text):
    f = tmp_path / "docs.jsonl"
    f.write_text(text, encoding="utf-8")
    assert load_corpus(DataConfig(path=str(f)))[0]["text"] == ["a b", "c"]


LATIN1_TXT = "first paragraph\n\ncaf\u00e9 au lait\n".encode("latin-1")  # é is 0xe9: offset 20, line 3
LATIN1_JSONL = b'{"text": "first"}\n\n{"text": "caf\xe9"}\n'  # offset 32, line 3


@pytest.mark.parametrize("kind", ["txt", "jsonl", "folder"])
def test_text_that_is_not_utf8_names_the_file_and_the_byte(tmp_path, kind):
    """The text builder fails as it reads, the json builder only when the text is first used:
    either way one line, with the file and where it breaks."""
    f = tmp_path / ("docs.jsonl" if kind == "jsonl" else "docs.txt")
    f.write_bytes(LATIN1_JSONL if kind == "jsonl" else LATIN1_TXT)
    path, name = f, f"data.path={f}"
    if kind == "folder":
        (tmp_path / "a.txt").write_text("fine\n")  # read first, and valid
        path, name = tmp_path, f"data.path={tmp_path}: {f}"
    offset = 32 if kind == "jsonl" else 20
    with pytest.raises(UserError) as info:
        load_corpus(DataConfig(path=str(path)))
    assert str(info.value) == (
        f"{name} is not UTF-8 text (byte 0xe9 at offset {offset}, line 3); re-encode it as UTF-8, e.g. iconv -f latin1 -t utf-8"
    )


@pytest.mark.parametrize("chunk_bytes", [1, 2, 3, 1 << 20])
def test_utf8_problem_finds_the_first_bad_byte_across_chunk_boundaries(tmp_path, chunk_bytes):
    f = tmp_path / "a.txt"
    f.write_bytes("a\u00e9\u4e2d\n\U0001f600\n".encode() + b"\xe4\xb8" + b"x\n\xff")
    assert utf8_problem(f, chunk_bytes) == "byte 0xe4 at offset 12, line 3"  # a lead byte without its tail
    f.write_bytes("a\u00e9\u4e2d\n".encode() + b"\xe4\xb8")  # cut off at the end
    assert utf8_problem(f, chunk_bytes) == "byte 0xe4 at offset 7, line 2"
    f.write_bytes("a\u00e9\u4e2d\n".encode())
    assert utf8_problem(f, chunk_bytes) is None


def test_data_config_validate():
    assert DataConfig().validate() == []
    assert DataConfig(val_fraction=1.0, seq_len=4, num_proc=0).validate() == [
        "val_fraction=1.0 must be in [0, 1)",
        "seq_len=4 is too short; use at least 8 tokens",
        "num_proc=0 must be at least 1",
    ]
    assert DataConfig(val_fraction=-0.1).validate() == ["val_fraction=-0.1 must be in [0, 1)"]


def test_resolved_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LLM_TOOLKIT_CACHE", str(tmp_path / "env"))
    assert DataConfig().resolved_cache_dir() == tmp_path / "env"
    assert DataConfig(cache_dir=str(tmp_path / "mine")).resolved_cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("LLM_TOOLKIT_CACHE")
    assert DataConfig().resolved_cache_dir().parts[-2:] == (".cache", "llm-toolkit")


# split_documents


def numbered(n: int) -> datasets.Dataset:
    return datasets.Dataset.from_dict({"text": [f"doc {i}" for i in range(n)]})


def test_split_holds_out_whole_documents_deterministically():
    ds = numbered(40)
    train, val = split_documents(ds, 0.1, seed=1234)
    train_texts, val_texts = list(train["text"]), list(val["text"])
    assert len(val_texts) == 4 and len(train_texts) == 36
    assert sorted(train_texts + val_texts) == sorted(ds["text"])  # a partition: nothing lost or shared
    assert train_texts == sorted(train_texts, key=lambda t: int(t.split()[1]))  # corpus order kept
    again_train, again_val = split_documents(ds, 0.1, seed=1234)
    assert list(again_val["text"]) == val_texts and list(again_train["text"]) == train_texts
    other_val = [tuple(split_documents(ds, 0.1, seed=s)[1]["text"]) for s in range(5)]
    assert len(set(other_val)) > 1  # the seed matters


@pytest.mark.parametrize("n, fraction, n_val", [(40, 0.05, 2), (10, 0.01, 1), (7, 0.5, 4), (2, 0.5, 1)])
def test_split_sizes_round_and_keep_at_least_one(n, fraction, n_val):
    train, val = split_documents(numbered(n), fraction, seed=0)
    assert (len(train), len(val)) == (n - n_val, n_val)


def test_no_validation_fraction_keeps_everything():
    ds = numbered(5)
    train, val = split_documents(ds, 0, seed=0)
    assert val is None and train is ds


def test_a_single_document_cannot_be_split():
    with pytest.raises(
        UserError, match=r"the corpus has 1 document\(s\); cannot hold out 5% .* data.val_fraction=0"
    ):
        split_documents(numbered(1), 0.05, seed=0)


def test_the_non_empty_filter_keeps_what_pythons_strip_keeps(tmp_path):
    """Arrow's whitespace trim (over plain reads of the files) agrees with str.strip on every kind of space."""
    texts = ["", " ", "\t\n", "\u3000", "\u00a0", "a", None, "\x1c", "\u200b", "\u2028", "\x85", " x ", "\ufeff"]
    f = tmp_path / "docs.jsonl"
    f.write_text("".join(json.dumps({"text": t, "n": i}) + "\n" for i, t in enumerate(texts)))
    ds, _ = load_corpus(DataConfig(path=str(f)))
    assert ds["text"] == [t for t in texts if t and t.strip()]


def test_streaming_a_hub_id_while_offline_says_so(monkeypatch):
    """data.streaming reads a hub id as it trains: offline, that is one line, not a retry loop."""
    import datasets.config
    import huggingface_hub.constants

    from toolkit.data.corpus import stream_corpus

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UserError) as info:
        stream_corpus(DataConfig(path="org/corpus", streaming=True))
    assert str(info.value).startswith("data.path=org/corpus (no local file or folder has that name) is read as a hub dataset id, but the Hub cannot be reached")
    assert str(info.value).endswith("streaming needs the network for a hub id; give a local file, folder or glob")


def test_a_streamed_folder_reads_the_files_load_corpus_reads(tmp_path):
    """The same files, in the same order, as the prepared path: only when they are read differs."""
    from toolkit.data.corpus import stream_corpus

    for name, texts in (("b.jsonl", ["third", "fourth"]), ("a.jsonl", ["first", "", "second"])):
        (tmp_path / name).write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    (tmp_path / "README").write_text("not read: the folder has jsonl files")
    stream, source = stream_corpus(DataConfig(path=str(tmp_path)))
    prepared, prepared_source = load_corpus(DataConfig(path=str(tmp_path)))
    assert [e["text"] for e in stream if e["text"]] == prepared["text"] == ["first", "second", "third", "fourth"]
    assert source != prepared_source  # cached tokenizers and held-out blocks of the two paths stay apart


def test_a_held_out_file_of_its_own_is_read_as_data_path_and_its_errors_name_data_val_path(tmp_path):
    """data.val_path (a fine-tune's held-out text) is read as data.path is; a fault in it names data.val_path, the
    key to fix, not data.path."""
    from toolkit.data.corpus import load_held_out
    from toolkit.training.recipe_config import FinetuneDataConfig

    (tmp_path / "held.txt").write_text("One held-out document.\n\nAnother one.\n")
    cfg = FinetuneDataConfig(format="text", path=None, val_path=str(tmp_path / "held.txt"), sample_by="paragraph")
    assert [t.strip() for t in load_held_out(cfg)["text"]] == ["One held-out document.", "Another one."]
    missing = FinetuneDataConfig(format="text", val_path=str(tmp_path / "helt.txt"))
    with pytest.raises(UserError) as info:
        load_held_out(missing)
    assert str(info.value).startswith(f"data.val_path={tmp_path / 'helt.txt'} does not exist") and "data.path" not in \
        str(info.value)


def test_a_hub_id_the_hub_cannot_give_is_one_line_at_once(monkeypatch, capfd):
    """Where the Hub cannot be reached, a hub id is looked up in the cache alone: one line with the connection's own
    reason, not ~30 s of the hub client's retries, each printed. The offline mode is the load's alone."""
    import time

    import huggingface_hub

    import toolkit.data.corpus as corpus

    monkeypatch.setattr(corpus, "hub_unreachable", lambda timeout_s=3.0: "hub.example: unreachable (the test)")
    before = datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE
    start = time.monotonic()
    with pytest.raises(UserError) as info:
        corpus.hub_dataset("nobody/no-such-set", None, "train", "data.val_path")
    assert str(info.value).startswith("data.val_path=nobody/no-such-set (no local file or folder has that name) is "
                                      "read as a hub dataset id, but the Hub cannot be reached (hub.example: "
                                      "unreachable (the test)); give a local file")
    assert time.monotonic() - start < 10 and "Retrying" not in capfd.readouterr().err
    assert (datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE) == before


def test_records_with_no_text_are_counted_in_one_line(tmp_path):
    """A parquet whose text is null in 169 of 505 rows trains on the rest and says how many it skipped (issue 44:
    it trained on 336 without a word)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"document {i} has some words" if i % 3 else None for i in range(505)]
    pq.write_table(pa.table({"text": texts}), tmp_path / "data.parquet")
    notes: list[str] = []
    ds, _ = load_corpus(DataConfig(path=str(tmp_path / "data.parquet")), notes)
    assert len(ds) == 505 - 169
    assert notes == [f"data.path={tmp_path / 'data.parquet'}: skipped 169 of 505 records with no text "
                     "(text null, empty or only whitespace)"]


def test_text_named_parquet_is_our_one_line_only(tmp_path, capfd):
    """A .parquet that is text: arrow's own 'Failed to read schema ... magic bytes' line printed before ours (issue
    44); now only ours, saying what the file is."""
    (tmp_path / "data.parquet").write_text("just some text, not a table\n")
    capfd.readouterr()
    with pytest.raises(UserError) as info:
        load_corpus(DataConfig(path=str(tmp_path / "data.parquet")))
    assert str(info.value).startswith(f"data.path={tmp_path / 'data.parquet'} is not a parquet file: it is text")
    assert "Failed" not in capfd.readouterr().err


def test_a_utf16_file_is_named_utf16_not_latin1(tmp_path):
    """UTF-16 (with its byte-order mark, or without: a NUL in every other byte) got the latin-1 hint (issue 44)."""
    for name, data in (("bom.txt", "some text\n".encode("utf-16")), ("bare.txt", "some text\n".encode("utf-16-le"))):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(UserError, match="it is UTF-16 text .*; re-encode it as UTF-8, e.g. iconv -f utf-16 -t utf-8"):
            load_corpus(DataConfig(path=str(tmp_path / name)))


def test_a_parquet_shard_of_no_rows_beside_others_is_read_past(tmp_path):
    """A sharded write leaves a shard of columns and no row: datasets refused the folder ("Couldn't cast array of type
    string to null"); the chat records' reader alike. Only such shards: one line (test_malformed_files.py's no rows)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from toolkit.data.records import read_records

    pq.write_table(pa.table({"text": pa.array([], pa.null())}), tmp_path / "part-0.parquet")
    pq.write_table(pa.table({"text": ["one document", "another"]}), tmp_path / "part-1.parquet")
    assert corpus(str(tmp_path))[0] == ["one document", "another"]
    assert len(read_records(str(tmp_path), "chat")) == 2
    (tmp_path / "part-1.parquet").unlink()
    with pytest.raises(UserError, match=r"holds no records: its parquet file has columns and no row; give a file"):
        load_corpus(DataConfig(path=str(tmp_path)))
