"""One assembly (toolkit.training.assembly): a model made the run's in one order, on a real one-process trainer."""

from __future__ import annotations

import pytest
from accelerate.state import AcceleratorState
from one_process_trainer import SETTINGS, packed_blocks

from toolkit.config.load import load_config
from toolkit.data.packing import collate, target_counts
from toolkit.models.adapter import AdapterConfig
from toolkit.training.assembly import assemble
from toolkit.training.metrics import model_size
from toolkit.training.recipe_config import PretrainConfig
from toolkit.training.trainer import Trainer


@pytest.fixture
def trainer(tmp_path, tiny_texts, tiny_tokenizer):
    AcceleratorState._reset_state(True)
    cfg = load_config(PretrainConfig, None, [*SETTINGS, f"output_dir={tmp_path / 'run'}",
                                             "model.gradient_checkpointing=full"])
    trainer = Trainer("unit", cfg)
    trainer.use_data(*packed_blocks(tiny_texts, tiny_tokenizer, tmp_path / "cache", False), collate, target_counts)
    said = []
    trainer.print = said.append
    yield trainer, said
    trainer.close()
    AcceleratorState._reset_state(True)


def test_fp8_recomputation_the_count_the_adapter_and_the_compile_come_before_the_split_and_the_wrap(
        trainer, tiny_model, tiny_tokenizer, monkeypatch):
    """The split shards too (tensor parallel's FSDP2 over dp), so recomputation and the compile come before it, as
    torchtitan's come before fully_shard (docs/architecture.md, "One assembly")."""
    import toolkit.training.assembly as assembly
    import toolkit.training.trainer as trainer_module

    trainer, said = trainer
    trainer.cfg.train.mixed_precision = "fp8"  # its conversion recorded, not run: float8 needs a GPU here
    calls = []

    def recorded(name, real=None):
        def step(model, *args, **kwargs):
            calls.append(name)
            return real(model, *args, **kwargs) if real is not None else _Said()
        return step

    class _Said:
        def said(self):
            return "fp8: recorded"

    monkeypatch.setattr(assembly.float8, "convert", recorded("fp8"))
    for name in ("apply_gradient_checkpointing", "apply_adapter", "compile_model"):
        monkeypatch.setattr(assembly, name, recorded(name, getattr(assembly, name)))
    split = trainer.strategy.apply_model_parallel
    monkeypatch.setattr(trainer.strategy, "apply_model_parallel", lambda *a: calls.append("split") or split(*a))
    monkeypatch.setattr(trainer_module, "prepare_optimization",
                        recorded("wrap", trainer_module.prepare_optimization))
    model = tiny_model("llama", seed=0, tokenizer=tiny_tokenizer)
    whole = model_size(model, 64)
    assembled = assemble(trainer, model, tiny_tokenizer, AdapterConfig(method="lora", r=2))
    assert calls == ["fp8", "apply_gradient_checkpointing", "apply_adapter", "compile_model", "split", "wrap"]
    assert (assembled.n_params, assembled.flops_token) == whole  # the base's, the adapter aside
    assert not assembled.resumed and not assembled.held_out and not assembled.needs_reference
    prepared = trainer.accelerator.unwrap_model(trainer.model)
    trainable = [n for n, p in prepared.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)  # the adapter, applied before the wrap
    assert prepared.base_model.model.is_gradient_checkpointing  # recomputation, under the adapter
    model_line = next(i for i, line in enumerate(said) if line.startswith("model: llama, "))
    assert said[model_line] == f"model: llama, {whole[0]:,} parameters, gradient checkpointing full"
    assert said.index("fp8: recorded") < model_line  # said in the order each step runs
    assert any("lora" in line.lower() for line in said[model_line + 1:])
