"""What a data file holds before a reader trips on it (toolkit/data/text_files.py); every reader x malformation
is walked by tests/toolkit/test_malformed_files.py."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from toolkit.data.text_files import parquet_problem


def test_parquet_problem_tells_what_the_file_is_instead(tmp_path):
    good = tmp_path / "good.parquet"
    pq.write_table(pa.table({"text": ["a", "b"]}), good)
    assert parquet_problem(good) is None
    cases = {"empty": b"", "text": b"hello\n", "utf16": "hello\n".encode("utf-16"), "cut": good.read_bytes()[:-9],
             "other": b"\x89PNG\r\n\x1a\n\x00"}
    said = {}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        said[name] = parquet_problem(tmp_path / name)
    assert said["empty"] == "it is empty"
    assert said["text"] == said["utf16"] == "it is text, not a parquet file (those start and end with PAR1)"
    assert said["cut"].startswith("it starts as one but its footer is missing")
    assert said["other"] == "it does not start with PAR1, as every parquet file does"
