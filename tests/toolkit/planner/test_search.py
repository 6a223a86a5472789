"""The planner's search: every shipped layout x recomputation x micro-batch estimated for a recipe's config, the
layouts the launch would refuse left out in the launch's words, and the fastest row that fits picked."""

from __future__ import annotations

from recipe_runner import ROOT

from toolkit.config.load import load_config
from toolkit.planner.search import plan
from toolkit.training.recipe_config import PretrainConfig

TINY = ROOT / "recipes" / "configs" / "pretrain_tiny.yaml"


def test_the_fastest_row_that_fits_is_picked_from_every_layout_and_recomputation():
    rows, best, notes = plan("pretrain", load_config(PretrainConfig, TINY, []), gpus=2, gpu_memory=80 * 10**9)
    strategies = {r["strategy"] for r in rows}
    assert {"ddp", "fsdp", "zero1", "zero2", "zero3"} <= strategies and "pipeline" in strategies
    assert {r["gradient_checkpointing"] for r in rows} == {"none", "every_k", "selective", "full"}
    assert best["fits"] and best == min((r for r in rows if r["fits"]),
                                        key=lambda r: (r["relative_step_time"], r["peak_bytes"]))
    nothing = plan("pretrain", load_config(PretrainConfig, TINY, []), gpus=2, gpu_memory=10**6)[1]
    assert nothing is None  # a megabyte holds no row


def test_a_layout_the_launch_refuses_is_left_out_in_the_launchs_words():
    cfg = load_config(PretrainConfig, TINY, ["train.mixed_precision=fp8", "model.compile=layers"])
    rows, _, notes = plan("pretrain", cfg, gpus=2, gpu_memory=80 * 10**9)
    assert not any(r["strategy"] == "fsdp_tp" for r in rows) and any(r["strategy"] == "fsdp" for r in rows)
    assert "fsdp_tp: not listed: train.mixed_precision=fp8 trains under DDP, FSDP and ZeRO" in "\n".join(notes)
    assert any(n.startswith("train.mixed_precision=fp8 is planned as bf16") for n in notes)


def test_a_row_whose_layout_takes_an_override_says_it():
    """A rule an override lifts (train.canary under FSDP and ZeRO-3) plans the row as launched with it, and says so,
    for a layout of its own as for a model-parallel one."""
    rows, _, notes = plan("pretrain", load_config(PretrainConfig, TINY, ["train.canary=stop"]), gpus=2,
                          gpu_memory=80 * 10**9)
    said = "\n".join(notes)
    assert {"fsdp", "zero3", "ddp"} <= {r["strategy"] for r in rows}
    assert "fsdp: as launched with train.canary=none" in said and "zero3: as launched with train.canary=none" in said
    assert "ddp: as launched" not in said and "zero2: as launched" not in said


def test_a_fine_tune_that_adds_tokens_is_planned_with_their_rows(tmp_path, tiny_model, tiny_tokenizer):
    """model.new_tokens grows the vocabulary the planner sizes, and a LoRA's trainable rows, as the run does."""
    from transformers import PreTrainedTokenizerFast

    from toolkit.planner.search import meta_model
    from toolkit.training.recipe_config import FinetuneConfig

    tok = PreTrainedTokenizerFast(tokenizer_object=tiny_tokenizer.backend_tokenizer, eos_token=tiny_tokenizer.eos_token)
    tiny_model("llama", tokenizer=tok).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    yaml = ROOT / "recipes" / "configs" / "finetune_smollm2_lora.yaml"
    plain = meta_model("finetune", load_config(FinetuneConfig, yaml, [f"model.path={tmp_path}"]))[0]
    notes = []
    model = meta_model("finetune", load_config(FinetuneConfig, yaml, [f"model.path={tmp_path}",
                                                                      "model.new_tokens=[<x>,<y>]"]), notes)[0]
    assert model.get_base_model().config.vocab_size == plain.get_base_model().config.vocab_size + 2 == 302
    assert model.get_nb_trainable_parameters()[0] == plain.get_nb_trainable_parameters()[0] + 2 * 2 * 64  # embedding and head
    assert any(n.startswith("model.new_tokens: added 2 tokens (<x>, <y>)") for n in notes)
