"""Every file the toolkit reads x every way it comes malformed (issue 44, class 5): one table, walked.

Each cell writes the malformed file into tmp_path, calls the toolkit's real reader in-process and checks the
outcome: a user's file gives one UserError line naming the file and what to do (a recipe prints it as `error: `
and exits 2); a checkpoint's own files (trainer_state.json, manifest.json) give the line with which a resume
sets the checkpoint aside (resume=auto) or refuses it (resume=PATH), docs/faults.md.

Completeness, both ways: every kind has a cell for every malformation (an expected fragment, or why it cannot
happen to that kind), and every function in toolkit/ that reads a file (json.load(s), yaml, read_text/read_bytes,
open, load_dataset, load_from_disk, from_pretrained, safe_open/load_file) is in READERS: walked here as one of
the kinds, or said not to read a user's file. A new reader fails `test_every_reader_is_classified` until it is
classified; a new malformation fails `test_every_kind_has_a_cell_for_every_malformation`.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from toolkit.checkpoint.integrity import check_state_file
from toolkit.config.errors import UserError
from toolkit.config.files import read_config_file
from toolkit.data.chat import chat_template_for
from toolkit.data.corpus import DataConfig, load_corpus
from toolkit.data.records import read_records
from toolkit.data.tokenizer import check_tokenizer_files
from toolkit.launch.launcher import read_accelerate_config
from toolkit.planner.facts import read_strategy
from toolkit.run.manifest import check_manifest

ROOT = Path(__file__).resolve().parents[2]
MALFORMATIONS = ("empty", "binary", "utf16", "latin1", "truncated", "top-level type", "field type", "key twice",
                 "no rows")  # no rows: a table whose columns are there and no record (a valid parquet of 0 rows)
NOT_A_TABLE = "not a table: a file with nothing in it is the empty cell"
UTF16 = "iconv -f utf-16 -t utf-8"
LATIN1 = "iconv -f latin1 -t utf-8"
NOT_JSON = "is not valid JSON"


def _parquet(table: dict) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table(table), sink)
    return sink.getvalue().to_pybytes()


GOOD_PARQUET = _parquet({"text": ["hello world"] * 20})


def _arrow(table: dict) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, pa.table(table).schema) as writer:  # datasets' .arrow files are arrow streams
        writer.write_table(pa.table(table))
    return sink.getvalue().to_pybytes()


NO_TEXT = {"text": pa.array([], pa.string())}
NO_MESSAGES = {"messages": pa.array([], pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])))}

# kind -> (file name, {malformation: (bytes written, expected fragment of the one line)} or a str: why not)
CELLS: dict[str, tuple[str, dict]] = {
    "recipe YAML": ("cfg.yaml", {
        "empty": (b"", None),  # every default, said in the log (test_an_empty_file_gives_the_defaults_and_says_so)
        "binary": (b"\x00\x01\x02", "is a binary file (it holds NUL bytes), not a config; give a YAML file"),
        "utf16": ("seed: 1\n".encode("utf-16"), UTF16),
        "latin1": ("seed: 1\nrun_name: caf\xe9\n".encode("latin1"), LATIN1),
        "truncated": (b"train:\n  max_steps: [1, 2\n", "is not valid YAML at line 3"),
        "top-level type": (b"- seed: 1\n", "must hold a mapping of keys (key: value lines), found a list"),
        "field type": "load_config checks each field's type: test_bad_config_gives_one_line[wrong type]",
        "key twice": (b"seed: 1\nseed: 2\n", "seed is written twice (lines 1 and 2); keep one"),
        "no rows": NOT_A_TABLE,
    }),
    "accelerate config": ("acc.yaml", {
        "empty": (b"", None),  # Accelerate's defaults: one process
        "binary": (b"\x00\x01\x02", "is a binary file"),
        "utf16": ("num_processes: 2\n".encode("utf-16"), UTF16),
        "latin1": ("num_processes: 2\n# caf\xe9\n".encode("latin1"), LATIN1),
        "truncated": (b"deepspeed_config: {deepspeed_config_file: ds.json\n", "is not valid YAML"),
        "top-level type": (b"- num_processes: 2\n", "must hold a mapping of keys (an accelerate config"),
        "field type": (b"num_processes: many\n", "num_processes='many' must be an integer"),
        "key twice": (b"num_processes: 2\nnum_processes: 4\n", "num_processes is written twice"),
        "no rows": NOT_A_TABLE,
    }),
    "DeepSpeed JSON": ("ds.json", {
        "empty": (b"", f"{NOT_JSON}: Expecting value at line 1"),
        "binary": (b"\x00\x01\x02", "is a binary file (it holds NUL bytes), not a config; give a JSON file"),
        "utf16": ('{"zero_optimization": {"stage": 2}}'.encode("utf-16"), UTF16),
        "latin1": ('{"comment": "caf\xe9"}'.encode("latin1"), LATIN1),
        "truncated": (b'{"zero_optimization": {"stage": 2', NOT_JSON),
        "top-level type": (b"[2]", "must hold a JSON object ({...}: a DeepSpeed config), found a list"),
        "field type": (b'{"zero_optimization": [2]}', "zero_optimization must be an object"),
        "key twice": (b'{"zero_optimization": {"stage": 2, "stage": 3}}', "the key 'stage' is written twice"),
        "no rows": NOT_A_TABLE,
    }),
    "corpus .txt": ("corpus.txt", {
        "empty": (b"", "holds no text (all 1 file(s) are empty)"),
        "binary": (bytes(range(256)) * 4, "is not UTF-8 text (byte 0x80 at offset 128, line 2)"),
        "utf16": ("some text\n".encode("utf-16"), UTF16),
        "latin1": ("caf\xe9 au lait\n".encode("latin1"), LATIN1),
        "truncated": "plain text has no end to cut: any prefix is text (a cut UTF-8 character is the binary case)",
        "top-level type": "plain text has no structure",
        "field type": "plain text has no fields",
        "key twice": "plain text has no keys",
        "no rows": "text has no columns: a file with no line is the empty cell, one of blank lines test_corpus.py's",
    }),
    "corpus .jsonl": ("corpus.jsonl", {
        "empty": (b"", "holds no text (all 1 file(s) are empty)"),
        "binary": (bytes(range(256)) * 4, "is not UTF-8 text"),
        "utf16": ('{"text": "a"}\n'.encode("utf-16"), UTF16),
        "latin1": ('{"text": "caf\xe9"}\n'.encode("latin1"), LATIN1),
        "truncated": (b'{"text": "a"}\n{"text": "b', "line 2 is not JSON (Unterminated string"),
        "top-level type": (b'["a"]\n["b"]\n', "is a JSON list, not an object"),
        "field type": (b'{"text": 12}\n', "record 0 has text=12 (int), not text; set data.text_column"),
        "key twice": (b'{"text": "a", "text": "b"}\n', "line 1: the key 'text' is written twice in one object"),
        "no rows": (b"\n\n", "holds no text"),
    }),
    "corpus .parquet": ("corpus.parquet", {
        "empty": (b"", "holds no text (all 1 file(s) are empty)"),
        "binary": (bytes(range(256)) * 4, "is not a parquet file: it does not start with PAR1"),
        "utf16": ("some text\n".encode("utf-16"), "is not a parquet file: it is text"),
        "latin1": ("caf\xe9 au lait\n".encode("latin1"), "is not a parquet file"),
        "truncated": (GOOD_PARQUET[: len(GOOD_PARQUET) // 2], "its footer is missing"),
        "top-level type": ("a parquet file is always a table; text under its name is the utf16/latin1 cells"),
        "field type": (_parquet({"text": [1, 2]}), "record 0 has text=1 (int), not text"),
        "key twice": "arrow refuses to write two columns of one name",
        "no rows": (_parquet(NO_TEXT), "holds no records: its parquet file has columns and no row"),
    }),
    "chat records .jsonl": ("chats.jsonl", {
        "empty": (b"", "holds no records"),
        "binary": (bytes(range(256)) * 4, "is not UTF-8 text"),
        "utf16": ('{"messages": []}\n'.encode("utf-16"), UTF16),
        "latin1": ('{"prompt": "caf\xe9"}\n'.encode("latin1"), LATIN1),
        "truncated": (b'{"messages": []}\n{"mess', "line 2 is not valid JSON"),
        "top-level type": (b"[1]\n", "line 1 is a JSON list, not an object"),
        "field type": "to_messages checks each record's fields: tests/toolkit/data/test_records.py (BAD records)",
        "key twice": (b'{"prompt": "a", "prompt": "b"}\n', "the key 'prompt' is written twice in one object"),
        "no rows": (b"\n\n", "holds no records"),
    }),
    "chat records .json": ("chats.json", {
        "empty": (b"", f"{NOT_JSON} at line 1"),
        "binary": (bytes(range(256)) * 4, "is not UTF-8 text"),
        "utf16": (b"[]".decode().encode("utf-16"), UTF16),
        "latin1": ('[{"prompt": "caf\xe9"}]'.encode("latin1"), LATIN1),
        "truncated": (b'[{"prompt": "a"}, {"pro', NOT_JSON),
        "top-level type": (b'{"messages": []}', "must hold a JSON list of records, found dict"),
        "field type": (b'["hi"]', "record 0 is a JSON str, not an object"),
        "key twice": (b'[{"prompt": "a", "prompt": "b"}]', "the key 'prompt' is written twice"),
        "no rows": (b"[]", "holds no records"),
    }),
    "chat records .parquet": ("chats.parquet", {
        "empty": (b"", "is not a parquet file: it is empty"),
        "binary": (bytes(range(256)) * 4, "is not a parquet file"),
        "utf16": ('{"messages": []}'.encode("utf-16"), "is not a parquet file: it is text"),
        "latin1": ('{"prompt": "caf\xe9"}'.encode("latin1"), "is not a parquet file"),
        "truncated": (GOOD_PARQUET[:-20], "is not a parquet file"),
        "top-level type": "a parquet file is always a table",
        "field type": "to_messages checks each record's fields, as for jsonl",
        "key twice": "arrow refuses to write two columns of one name",
        "no rows": (_parquet(NO_MESSAGES), "holds no records"),
    }),
    "chat records .csv": ("chats.csv", {
        "empty": (b"", "is empty; give a csv file with a header line"),
        "binary": (bytes(range(256)) * 4, "is not UTF-8 text"),
        "utf16": ("prompt,completion\na,b\n".encode("utf-16"), UTF16),
        "latin1": ("prompt,completion\ncaf\xe9,b\n".encode("latin1"), LATIN1),
        "truncated": (b'prompt,completion\n"a,b\n', "cannot be read as csv"),
        "top-level type": "a csv file is always a table",
        "field type": "csv cells are strings; to_messages checks the shape",
        "key twice": (b"prompt,prompt\na,b\n", None),  # pandas renames the second prompt.1: read, then the shape
        "no rows": (b"prompt,completion\n", "holds no records"),
    }),
    "chat records .arrow": ("chats.arrow", {
        "empty": (b"", "cannot be read as arrow: File is too small: 0; write it again"),
        "binary": (bytes(range(256)) * 4, "cannot be read as arrow"),
        "utf16": ('{"messages": []}'.encode("utf-16"), "cannot be read as arrow"),
        "latin1": ('{"prompt": "caf\xe9"}'.encode("latin1"), "cannot be read as arrow"),
        "truncated": (b"ARROW1\x00\x00\xff\xff", "cannot be read as arrow"),
        "top-level type": "an arrow file is always a table",
        "field type": "to_messages checks each record's fields, as for jsonl",
        "key twice": "arrow refuses to write two columns of one name",
        "no rows": (_arrow(NO_MESSAGES), "holds no records"),
    }),
    "save_to_disk folder": ("saved/state.json", {
        "empty": (b"", "cannot be read as a save_to_disk folder"),
        "binary": (b"\x00\x01", "cannot be read as a save_to_disk folder"),
        "utf16": ("{}".encode("utf-16"), "cannot be read as a save_to_disk folder"),
        "latin1": ('{"x": "caf\xe9"}'.encode("latin1"), "cannot be read as a save_to_disk folder"),
        "truncated": (b'{"_data_files": [', "cannot be read as a save_to_disk folder"),
        "top-level type": (b"[1]", "cannot be read as a save_to_disk folder"),
        "field type": (b'{"_data_files": 3}', "cannot be read as a save_to_disk folder"),
        "key twice": "datasets wrote it (json.dump cannot write a key twice); a hand edit is the other cells",
        "no rows": "its state.json names arrow files: a save of no rows is read_records' 'holds no records' (_non_empty)",
    }),
    "tokenizer folder": ("tok/tokenizer_config.json", {
        "empty": (b"", f"tokenizer_config.json {NOT_JSON}"),
        "binary": (b"\x00\x01", "is a binary file"),
        "utf16": ("{}".encode("utf-16"), UTF16),
        "latin1": ('{"x": "caf\xe9"}'.encode("latin1"), LATIN1),
        "truncated": (b'{"eos_token": "<', NOT_JSON),
        "top-level type": (b"[1]", "must hold a JSON object ({...}: a tokenizer's tokenizer_config.json), found a list"),
        "field type": "transformers' own checks, said as 'could not be loaded (...)' (load_tokenizer)",
        "key twice": (b'{"eos_token": "a", "eos_token": "b"}', "the key 'eos_token' is written twice"),
        "no rows": NOT_A_TABLE,
    }),
    "chat template file": ("template.jinja", {
        "empty": (b"", "is empty; write the Jinja template in it"),
        "binary": (bytes(range(256)) * 4, "is not UTF-8 text"),
        "utf16": ("{{ x }}".encode("utf-16"), UTF16),
        "latin1": ("{{ 'caf\xe9' }}".encode("latin1"), LATIN1),
        "truncated": "a cut template fails as Jinja when it renders: 'the chat template rejected the conversation'",
        "top-level type": "a template is text",
        "field type": "a template is text",
        "key twice": "a template is text",
        "no rows": NOT_A_TABLE,
    }),
    "trainer_state.json": ("step-4/trainer_state.json", {
        "empty": (b"", "is not a readable trainer state (empty)"),
        "binary": (bytes(range(256)), "is not a readable trainer state (not UTF-8 text"),
        "utf16": ('{"step": 4}'.encode("utf-16"), "is not a readable trainer state (not UTF-8 text"),
        "latin1": ('{"step": 4, "suspect": "caf\xe9"}'.encode("latin1"), "is not a readable trainer state (not UTF-8"),
        "truncated": (b'{"step": 4, "tokens', "is not a readable trainer state (not JSON: "),
        "top-level type": (b"[4]", "is not a readable trainer state (a JSON list, not the object the toolkit writes)"),
        "field type": (b'{"step": "4"}', "is not a readable trainer state (its step is '4', not an integer)"),
        "key twice": (b'{"step": 4, "step": 3}', "is not a readable trainer state (the key 'step' is written twice in one object)"),
        "no rows": NOT_A_TABLE,
    }),
    "manifest.json": ("step-4/manifest.json", {
        "empty": (b"", "is not a readable manifest (not JSON"),
        "binary": (bytes(range(256)), "is not a readable manifest (not UTF-8 text)"),
        "utf16": ('{"files": {}}'.encode("utf-16"), "is not a readable manifest (not UTF-8 text)"),
        "latin1": ('{"files": {"caf\xe9": 1}}'.encode("latin1"), "is not a readable manifest (not UTF-8 text)"),
        "truncated": (b'{"version": 1, "files": {"a": {"si', "is not a readable manifest (not JSON"),
        "top-level type": (b"[1]", "is not a readable manifest (a JSON list, not an object)"),
        "field type": (b'{"files": {"a": "x"}}', "is not a readable manifest (its entry for a is 'x'"),
        "key twice": (b'{"files": {}, "files": {}}', "is not a readable manifest (the key 'files' is written twice in one object)"),
        "no rows": NOT_A_TABLE,
    }),
}


def _read(kind: str, path: Path, tmp_path: Path):
    """The toolkit's real reader of `kind`, on the file just written at `path`. Returns a line (the readers of a
    checkpoint's own files return what is wrong) or raises UserError."""
    if kind == "recipe YAML":
        return read_config_file(path)
    if kind == "accelerate config":
        return read_accelerate_config(str(path))
    if kind == "DeepSpeed JSON":  # as the planner finds it from an accelerate config (the ranks read it alike)
        (tmp_path / "acc").mkdir()
        acc = tmp_path / "acc" / "zero.yaml"
        acc.write_text(f"distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: {path}\n")
        return read_strategy(acc, 64)
    if kind.startswith("corpus"):
        return load_corpus(DataConfig(path=str(path)), [])
    if kind.startswith("chat records"):
        return read_records(str(path), "chat")
    if kind == "save_to_disk folder":
        (path.parent / "dataset_info.json").write_text("{}")
        return read_records(str(path.parent), "chat")
    if kind == "tokenizer folder":
        return check_tokenizer_files(str(path.parent))
    if kind == "chat template file":
        return chat_template_for(None, str(path))
    if kind == "trainer_state.json":
        return check_state_file(path.parent)
    if kind == "manifest.json":
        return check_manifest(path.parent)
    raise AssertionError(f"no reader for {kind}")


CASES = [(kind, m) for kind, (_, cells) in CELLS.items() for m, cell in cells.items() if not isinstance(cell, str)]


@pytest.mark.parametrize(("kind", "malformation"), CASES, ids=[f"{k}-{m}" for k, m in CASES])
def test_a_malformed_file_is_one_line(kind, malformation, tmp_path, capfd):
    name, cells = CELLS[kind]
    data, expected = cells[malformation]
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    capfd.readouterr()
    try:
        said = _read(kind, path, tmp_path)
    except UserError as exc:
        said = str(exc)
    if expected is None:  # read, or its documented outcome further on
        assert not isinstance(said, str) or "not" not in said, said
        return
    assert isinstance(said, str), f"{kind} {malformation}: read without a word ({said!r:.200})"
    assert expected in said, said
    if malformation == "binary":  # re-encoding from latin-1 would make a text of its bytes (issue 44's probe)
        assert LATIN1 not in said, said
    assert "\n" not in said and len(said) < 600, said
    assert str(path.name) in said or str(path.parent.name) in said, f"the line does not name the file: {said}"
    # nothing from datasets, arrow or pandas before (or after) the line; progress bars aside
    err = "\n".join(line for line in capfd.readouterr().err.splitlines() if "examples/s" not in line)
    assert not err.strip(), err


def test_every_kind_has_a_cell_for_every_malformation():
    """A malformation added to MALFORMATIONS (or a kind added) needs its cells classified: walked, or why not."""
    for kind, (_, cells) in CELLS.items():
        assert tuple(cells) == MALFORMATIONS, f"{kind}: cells {tuple(cells)}, malformations {MALFORMATIONS}"
        for malformation, cell in cells.items():
            assert isinstance(cell, str) and len(cell) > 10 or isinstance(cell, tuple), (kind, malformation)


# Every function in toolkit/ that reads a file -> the kind of CELLS that walks it, or why it reads no user's file.
READS = re.compile(r"json\.loads?\(|yaml\.safe_load|read_yaml\(|read_json\(|\.read_text\(|\.read_bytes\(|\bopen\(|"
                   r"load_dataset\(|load_from_disk\(|from_pretrained\(|safe_open\(|load_file\(|os\.pread\(")
OWN = "the toolkit's own file, written atomically beside a manifest or a lock: damage is a damaged checkpoint/run"
READERS: dict[str, str] = {
    "toolkit/config/files.py:read_config_file": "recipe YAML",
    "toolkit/config/files.py:_text": "recipe YAML",
    "toolkit/config/files.py:read_yaml": "recipe YAML",
    "toolkit/config/files.py:read_json": "DeepSpeed JSON",
    "toolkit/launch/launcher.py:read_accelerate_config": "accelerate config",
    "toolkit/planner/facts.py:_read_strategy": "accelerate config",
    "toolkit/strategy/deepspeed/family.py:config_facts": "DeepSpeed JSON",
    "toolkit/planner/search.py:strategies": "accelerate config",
    "toolkit/strategy/deepspeed/launch.py:check_deepspeed_config": "DeepSpeed JSON",
    "toolkit/data/corpus.py:load_corpus": "corpus .parquet",
    "toolkit/data/corpus.py:stream_corpus": "corpus .jsonl",
    "toolkit/data/corpus.py:hub_dataset": "a hub id: datasets' errors said in one line (test_corpus.py's hub tests)",
    "toolkit/data/text_files.py:_binary": "corpus .txt",
    "toolkit/data/text_files.py:utf8_problem": "corpus .txt",
    "toolkit/data/text_files.py:read_utf8": "chat template file",
    "toolkit/data/text_files.py:_head": "corpus .txt",
    "toolkit/data/text_files.py:parquet_problem": "corpus .parquet",
    "toolkit/data/text_files.py:_only_whitespace": "corpus .txt",
    "toolkit/data/text_files.py:_first_line_not_a_record": "corpus .jsonl",
    "toolkit/data/records.py:read_records": "save_to_disk folder",
    "toolkit/data/records.py:_read_file": "chat records .jsonl",
    "toolkit/data/records.py:_json": "chat records .json and .jsonl",
    "toolkit/data/chat.py:rendered": "a record's `tools` held as a JSON string, read where it parses (else handed on)",
    "toolkit/data/tokenizer.py:load_tokenizer": "tokenizer folder",
    "toolkit/data/tokenizer.py:get_tokenizer": "its own cache, written by save_pretrained then renamed into place",
    "toolkit/checkpoint/trainer_state.py:_state_record": "trainer_state.json",
    "toolkit/run/manifest.py:crc32": "manifest.json",
    "toolkit/run/manifest.py:_entries": "manifest.json",
    "toolkit/run/manifest.py:written_by": "manifest.json",
    "toolkit/run/lock.py:take": OWN,
    "toolkit/run/lock.py:holder": OWN,
    "toolkit/run/lock.py:_record": OWN,
    "toolkit/run/lock.py:one_writer": "a lock file it opens, never reads (the lock is the kernel's)",
    "toolkit/data/text_files.py:_json_hint": "corpus .jsonl",
    "toolkit/data/text_files.py:_one_array": "corpus .jsonl",
    "toolkit/data/tokenizer.py:check_tokenizer_files": "tokenizer folder",
    "toolkit/run/faults.py:_armed": "the test suite's fault-injection log, not a user's",
    "toolkit/run/faults.py:_fire": "the test suite's fault-injection log, not a user's",
    "toolkit/training/metrics.py:_open": OWN + " (metrics.jsonl, appended by the run; a line that is not JSON is dropped)",
    "toolkit/training/metrics.py:read_metrics": OWN + " (metrics.jsonl, appended by the run)",
    "toolkit/training/loss_plot.py:_rows": OWN + " (metrics.jsonl, appended by the run; a line that is not a JSON object "
                                                 "is skipped)",
    "toolkit/training/reference.py:base_identity": "the base's config.json as transformers wrote it: a fingerprint",
    "toolkit/training/reference.py:_write": OWN,
    "toolkit/training/harness.py:_unreadable_yamls": "a user's harness task folder: test_harness.py's MALFORMED walks "
                                                     "its YAML's and documents' damage",
    "toolkit/training/harness_hub.py:_named": "task YAMLs read as bytes for the names they give, nothing else: one it "
                                              "cannot read is skipped, and harness.py's check names it",
    "toolkit/training/harness_hub.py:read_task_file": "a task YAML read for its dataset: one it cannot read tells "
                                                      "nothing (_entry), and harness.py's check names it "
                                                      "(test_harness.py's MALFORMED)",
    "toolkit/training/harness_runs.py:_collect": OWN + " (harness/step-N.json, staged and renamed by recipes/evaluate.py; "
                                                   "one it cannot read is a warning: the step is not scored)",
    "toolkit/training/harness_runs.py:start": "harness.log, opened to append the scoring's output, never read",
    "toolkit/training/samples.py:sample_folder": "final/, which the run wrote and checked",
    "toolkit/training/sample_prompts.py:_written_for": "the shipped configs (recipes/configs/), each validated by "
                                                       "test_configs.py",
    "toolkit/config/text_lists.py:entries": "a command line's value (yaml of a string), not a file",
    "toolkit/config/text_lists.py:read_text_list": "a command line's value (yaml of a string), not a file",
    "toolkit/run/folder.py:_trained": OWN + " (final/ and adapter/'s training_summary.json: one it cannot read "
                                               "is no finished run, and resume=auto goes on as it did)",
    "toolkit/training/profiling.py:_quiet_stderr": "/dev/null",
    "toolkit/training/entry.py:run": "/dev/null, as stdout once a --preview's reader has gone (| head)",
    "toolkit/strategy/deepspeed/files.py:tag_folder": OWN + " (DeepSpeed's `latest`)",
    "toolkit/checkpoint/same_model.py:check_same_model": OWN + " (model_files/)",
    "toolkit/checkpoint/conversion.py:cached_conversion": OWN,
    "toolkit/strategy/by_name.py:__init__": OWN,
    "toolkit/strategy/ddp/files.py:read_optimizer_names": OWN,
    "toolkit/strategy/pipeline/files.py:full_weights": OWN,
    "toolkit/strategy/pipeline/files.py:load_stage": OWN,
    "toolkit/data/packing.py:_load_blocks": OWN + " (the data cache's blocks)",
    "toolkit/data/streaming.py:load": OWN + " (a streamed run's data position)",
    "toolkit/models/base_model.py:*": "a base model: transformers' from_pretrained, its errors said by load_base",
    "toolkit/models/gguf_base.py:*": "a GGUF base: test_gguf_base.py's missing and non-GGUF files",
    "toolkit/models/adapter.py:load_with_adapter": OWN + " (adapter/)",
    "toolkit/export/*": "export's sources: tests/toolkit/export (damaged checkpoints by their manifest, folders "
                        "that are not a model)",
}


def _readers() -> set[str]:
    found = set()
    for path in sorted((ROOT / "toolkit").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text())
        lines = path.read_text().splitlines()
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                body = "\n".join(lines[node.lineno - 1: node.end_lineno])
                inner = [n for n in ast.walk(node) if n is not node and isinstance(n, ast.FunctionDef)]
                for n in inner:  # a nested function is its own reader
                    body = body.replace("\n".join(lines[n.lineno - 1: n.end_lineno]), "")
                code = "\n".join(line.split("#")[0] for line in body.splitlines()
                                 if not line.strip().startswith(('"', "'")))
                if READS.search(code):
                    found.add(f"{rel}:{node.name}")
    return found


def _classified(reader: str) -> str | None:
    module, _ = reader.split(":")
    return (READERS.get(reader) or READERS.get(f"{module}:*")
            or READERS.get(f"{module.rsplit('/', 1)[0]}/*"))


def test_every_reader_is_classified():
    """A function that reads a file is walked by the table above, or says why it needs no cell."""
    found = _readers()
    unclassified = sorted(r for r in found if _classified(r) is None)
    assert not unclassified, f"readers without a row in READERS: {unclassified}"
    kinds = {v for v in READERS.values() if v in CELLS}
    assert kinds <= set(CELLS)
    stale = sorted(r for r in READERS if "*" not in r and r not in found)
    assert not stale, f"READERS names functions that read no file (renamed?): {stale}"
