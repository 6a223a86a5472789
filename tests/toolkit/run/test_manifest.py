"""The checkpoint manifest finds every kind of damage and names the file."""

from __future__ import annotations

import json
import zlib

import pytest

from toolkit.run.manifest import MANIFEST, check_manifest, crc32, write_manifest


@pytest.fixture
def folder(tmp_path):
    """A checkpoint-shaped folder: rank files, a nested model_files/, a state file left out."""
    root = tmp_path / "step-4"
    (root / "model_files").mkdir(parents=True)
    (root / "model.safetensors").write_bytes(bytes(range(256)) * 4096)  # 1 MiB
    (root / "optimizer.bin").write_bytes(b"\x01" * 50_000)
    (root / "random_states_1.pkl").write_bytes(b"rng")
    (root / "model_files" / "config.json").write_text('{"hidden_size": 64}')
    (root / "trainer_state.json").write_text('{"step": 4}')
    write_manifest(root, skip=("trainer_state.json",))
    return root


def test_an_intact_checkpoint_passes_and_its_manifest_lists_every_file_but_the_skipped(folder):
    assert check_manifest(folder) is None
    entries = json.loads((folder / MANIFEST).read_text())["files"]
    assert sorted(entries) == ["model.safetensors", "model_files/config.json", "optimizer.bin", "random_states_1.pkl"]
    ones = zlib.crc32(b"\x01" * 50_000)
    assert entries["optimizer.bin"] == {"size": 50_000, "crc32": f"{ones:08x}"}


def test_a_crc_over_several_chunks_equals_one_pass(tmp_path, monkeypatch):
    import toolkit.run.manifest as manifest

    data = bytes(range(256)) * 1000
    (tmp_path / "f").write_bytes(data)
    monkeypatch.setattr(manifest, "_CHUNK", 1000)  # 256 reads
    assert crc32(tmp_path / "f") == f"{zlib.crc32(data):08x}"


def test_a_truncated_file_is_named_with_both_sizes(folder):
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:1000])
    assert check_manifest(folder) == (
        f"{folder / 'model.safetensors'} has 1,000 bytes, 1,048,576 were written (truncated or replaced)"
    )


def test_one_flipped_bit_is_found(folder):
    data = bytearray((folder / "model.safetensors").read_bytes())
    data[123_457] ^= 0x40  # one exponent bit of one weight
    (folder / "model.safetensors").write_bytes(bytes(data))
    problem = check_manifest(folder)
    assert problem.startswith(f"{folder / 'model.safetensors'} does not match its checksum")


def test_a_missing_rank_file_is_named(folder):
    (folder / "random_states_1.pkl").unlink()
    assert check_manifest(folder) == f"{folder / 'random_states_1.pkl'} is missing"


def test_a_checkpoint_without_a_manifest_is_accepted_as_before(folder):
    (folder / MANIFEST).unlink()
    assert check_manifest(folder) is None


def test_an_unreadable_manifest_is_named(folder):
    (folder / MANIFEST).write_text("{not json")
    assert check_manifest(folder).startswith(f"{folder / MANIFEST} is not a readable manifest (not JSON: ")
