"""Files read strictly: YAML and JSON whose keys are each written once, text that is UTF-8, and a hint for the rest.

(What load_config makes of such files, through a recipe's --config, is in test_load.py.)"""

from __future__ import annotations

import gzip

import pytest

from toolkit.config.errors import ConfigError
from toolkit.config.files import read_json, read_yaml, reencode_hint, utf16_sign


def test_a_yaml_key_written_twice_names_both_lines(tmp_path):
    path = tmp_path / "ds.yaml"
    path.write_text("a: 1\nb:\n  c: 2\n  c: 3\n")
    with pytest.raises(ConfigError, match=r"ds.yaml line 4: b.c is written twice \(lines 3 and 4\); keep one"):
        read_yaml(path)


def test_a_json_file_is_one_object_whose_keys_are_each_written_once(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"stage": 2, "stage": 3}')
    with pytest.raises(ConfigError, match="the key 'stage' is written twice in one object; keep one"):
        read_json(path)
    path.write_text("[1, 2]")
    assert read_json(path) == [1, 2]
    with pytest.raises(ConfigError, match=r"must hold a JSON object \(\{...\}: a DeepSpeed config\), found a list"):
        read_json(path, "a DeepSpeed config")


def test_text_that_is_not_utf8_is_named_by_what_it_is(tmp_path):
    assert utf16_sign("seed: 1\n".encode("utf-16")) == "a UTF-16 byte-order mark"
    assert utf16_sign("seed: 1\n".encode("utf-16-le")) == "a NUL in every other byte, as in UTF-16"
    assert utf16_sign(b"seed: 1\n") is None
    assert reencode_hint(gzip.compress(b"seed: 1")).startswith("it is gzip-compressed, not text; unpack it first")
    assert reencode_hint("é".encode("latin-1")) == "re-encode it as UTF-8, e.g. iconv -f latin1 -t utf-8"
    path = tmp_path / "cfg.yaml"
    path.write_bytes("seed: 1\n".encode("utf-16"))
    with pytest.raises(ConfigError, match=r"cfg.yaml is not UTF-8 text: it is UTF-16 text .* iconv -f utf-16 -t utf-8"):
        read_yaml(path)


def test_the_strategy_files_the_toolkit_reads_are_read_strictly(tmp_path, monkeypatch):
    """The launched DeepSpeed JSON (json.loads kept the last of two keys) and an accelerate config the
    planner reads (yaml.safe_load did the same)."""
    from toolkit.planner.facts import read_strategy
    from toolkit.strategy.deepspeed.launch import check_deepspeed_config

    ds = tmp_path / "ds_configs" / "ds.json"
    ds.parent.mkdir()
    ds.write_text('{"zero_optimization": {"stage": 3, "stage": 1}}')
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(ds))
    with pytest.raises(ConfigError, match=rf"^{ds}: the key 'stage' is written twice in one object; keep one$"):
        check_deepspeed_config()
    accelerate = tmp_path / "accelerate_configs" / "zero.yaml"
    accelerate.parent.mkdir()
    accelerate.write_text("distributed_type: FSDP\nnum_processes: 2\ndistributed_type: DEEPSPEED\n")
    with pytest.raises(ConfigError, match=r"line 3: distributed_type is written twice \(lines 1 and 3\); keep one$"):
        read_strategy(accelerate, 64)
