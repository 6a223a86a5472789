"""What a data file holds before a reader trips on it (toolkit/data/text_files.py); every reader x malformation
is walked by tests/toolkit/test_malformed_files.py."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

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


@pytest.mark.parametrize(("head", "says"), [
    (b"\x1f\x8b\x08\x00", "it is gzip-compressed, not text; unpack it first (gunzip) and give the text"),
    (b"PK\x03\x04\x14\x00", "it is a zip archive, not text; unpack it first (unzip) and give the text"),
    (bytes(range(1, 256)) + b"\x00", "it holds NUL bytes, so it is a binary file, not text; give a text file"),
    ("caf\xe9 au lait\n".encode("latin1"), "re-encode it as UTF-8, e.g. iconv -f latin1 -t utf-8"),
])
def test_a_file_that_is_not_text_is_not_told_to_be_re_encoded_from_latin1(tmp_path, head, says):
    """A compressed or binary file (--eval-text, data.path, a template) got 'iconv -f latin1': a text of its bytes."""
    from toolkit.config.errors import UserError
    from toolkit.data.text_files import read_utf8

    path = tmp_path / "held_out.txt"
    path.write_bytes(head + bytes(range(128, 256)))
    with pytest.raises(UserError) as refused:
        read_utf8(path, "--eval-text held_out.txt")
    assert str(refused.value).startswith("--eval-text held_out.txt is not UTF-8 text (byte 0x")
    assert str(refused.value).endswith(says)
