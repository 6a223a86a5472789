"""DPO's reference pass (toolkit.training.reference): every block's target log-probabilities under the model with its
adapter off, in blocks of micro-batches that need not divide them, and the saved values read back only for the data
and base they were made for. (Split over 2 ranks and gathered: tests/recipes/test_preference_training.py, whose
first step has rewards of exactly 0 under every strategy.)"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState

from toolkit.data.chat import ChatDataConfig
from toolkit.data.preference import collate_pairs, preference_blocks
from toolkit.models.adapter import AdapterConfig, apply_adapter
from toolkit.models.preference_loss import token_logps
from toolkit.training.evaluation import forwards
from toolkit.training.reference import _read, _write, fingerprint, reference_logps


class Counted:
    """A pass's bar that counts its updates."""

    def __init__(self):
        self.n = 0

    def update(self, n: int = 1) -> None:
        self.n += n


@pytest.fixture(scope="module")
def blocks(chat_tokenizer):
    train, val, _ = preference_blocks(ChatDataConfig(seq_len=256, val_fraction=0.25), chat_tokenizer, 1)
    return chat_tokenizer, train, val


@pytest.fixture
def accelerator():
    AcceleratorState._reset_state(True)
    yield Accelerator(cpu=True)
    AcceleratorState._reset_state(True)


def test_the_pass_is_the_base_with_the_adapter_off(blocks, tiny_model, accelerator):
    tok, train, _ = blocks
    base = tiny_model("llama", tokenizer=tok)
    with torch.no_grad():
        expected = token_logps(base.eval(), collate_pairs(train.with_format("numpy")[:], "sdpa")).numpy()
    model, _ = apply_adapter(copy.deepcopy(base), AdapterConfig(method="lora", r=4, dropout=0.0))
    with torch.no_grad():  # an adapter that changes the outputs, as a trained one does
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    model.train()
    bar = Counted()
    got = reference_logps(accelerator, model, train, micro_batch=3, attn="sdpa", bar=bar)  # 3 does not divide them
    assert len(train) % 3 and got.shape == expected.shape
    assert bar.n == forwards(train, 3, 0, 1) == len(train) // 3 + 1  # the total use_reference gives the pass's bar
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert (got[expected == 0] == 0).all() and (got != 0).sum() > 100  # targets only, and there are some
    assert model.training  # left as it was found
    with torch.no_grad():
        on = token_logps(model, collate_pairs(train.with_format("numpy")[:], "sdpa")).numpy()
    assert np.abs(on - expected).max() > 1e-3  # the adapter really was on outside the pass


def test_saved_values_are_read_back_only_for_their_data_and_base(blocks, tmp_path):
    _, train, val = blocks
    key = fingerprint(train, val, "base-a")
    assert key != fingerprint(train, val, "base-b") and key != fingerprint(train, None, "base-a")
    values = {"train": np.ones((len(train), 256), np.float32), "val": np.zeros((len(val), 256), np.float32)}
    path = tmp_path / "reference_logps.npz"
    _write(path, key, values)
    read = _read(path, key)
    assert read.keys() == values.keys() and all(np.array_equal(read[k], values[k]) for k in values)
    assert _read(path, fingerprint(train, val, "base-b")) is None and _read(tmp_path / "none.npz", key) is None
    assert not (tmp_path / "reference_logps.npz.tmp").exists()


def test_another_model_in_the_base_folder_is_another_base(tmp_path):
    from toolkit.models.base_model import BaseModelConfig
    from toolkit.training.reference import base_identity

    folder = tmp_path / "base"
    folder.mkdir()
    (folder / "config.json").write_text('{"hidden_size": 64}')
    (folder / "model.safetensors").write_bytes(b"0" * 100)
    cfg = BaseModelConfig(path=str(folder))
    first = base_identity(cfg)
    assert base_identity(cfg) == first  # read twice: the same
    (folder / "model.safetensors").write_bytes(b"0" * 101)  # other weights written to the same folder
    assert base_identity(cfg) != first
    second = base_identity(cfg)
    (folder / "config.json").write_text('{"hidden_size": 65}')
    assert base_identity(cfg) != second
