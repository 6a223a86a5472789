"""Every refusal that the config, the base's config.json and a checkpoint's record decide comes before any data is
prepared or any model is loaded: on a 7-9B base the load alone takes minutes, and a corpus is tokenized and packed in
seconds to minutes, before a line that needed neither.

Each recipe's main() runs in this process with its data preparation and its model load replaced by a function that
fails the test if reached: a refusal of the table raised later fails here. A new refusal of that kind is a row.
"""

from __future__ import annotations

import json

import pytest
from recipe_runner import FT_TINY, ROOT, TINY, recipe_module

from toolkit.checkpoint.trainer_state import TrainerState
from toolkit.config.load import load_config
from toolkit.training.recipe_config import PretrainConfig

# What each recipe does that a refusal must come before: reading and packing data, training a tokenizer, loading or
# building the model.
WORK = {
    "pretrain": ("load_corpus", "stream_corpus", "get_tokenizer", "packed_splits", "packed_dataset", "build_model"),
    "finetune": ("load_base_model", "load_corpus", "chat_blocks", "preference_blocks", "packed_splits"),
}
CONFIG = {"pretrain": ("pretrain_tiny.yaml", TINY), "finetune": ("finetune_smollm2_lora.yaml", FT_TINY)}
BASE_POSITIONS = 256  # the tiny base's config.json: max_position_embeddings

# (recipe, overrides, the error line's words); "{base}", "{resume}", "{other}": the tiny base's folder, a checkpoint
# whose record trained on another data.path, a corpus file that is not that one
EARLY = {
    "step_sync none without the fused AdamW": (
        "pretrain", ["train.step_sync=none"],
        "train.step_sync=none cannot skip a non-finite step on the device here: it needs torch's fused AdamW"),
    "step_sync none with optim.fused=false": (
        "finetune", ["train.step_sync=none", "optim.fused=false", "model.path={base}"],
        "train.step_sync=none cannot skip a non-finite step on the device here"),
    "resume with another data.path": (
        "pretrain", ["resume={resume}", "data.path={other}"],
        "was trained with data.path="),
    "resume onto a mixture where it trained one corpus": (
        "pretrain", ["resume={resume}", "data.path=null", "data.sources=[{{name: web, path: {other}}}]"],
        "was trained on one corpus (data.path) and this run reads the mixture of web (data.sources)"),
    "resume with another seed": (
        "pretrain", ["resume={resume}", "data.path={other}", "seed=7"],
        "was trained with seed="),
    "chunked loss with a LoRA on the head": (
        "finetune", ["model.loss=chunked", "adapter.target_modules=[q_proj,lm_head]", "model.path={base}"],
        "model.loss=chunked computes the loss inside the output head, and adapter.target_modules puts a LoRA on it "
        "(lm_head); use model.loss=full, or train the head whole with adapter.modules_to_save=[lm_head]"),
    "fp8 on a machine without a GPU": (
        "pretrain", ["train.mixed_precision=fp8", "model.compile=layers"],
        "train.mixed_precision=fp8 needs an NVIDIA GPU"),
    "flex_attention on CPU": (
        "pretrain", ["model.attn_implementation=flex_attention"],
        "model.attn_implementation=flex_attention trains only on GPUs"),
    "seq_len past the base's positions": (
        "finetune", [f"data.seq_len={2 * BASE_POSITIONS}", "model.path={base}"],
        f"data.seq_len={2 * BASE_POSITIONS} is larger than the base model's max positions ({BASE_POSITIONS})"),
    "samples past the base's positions": (
        "finetune", [f"samples.max_new_tokens={2 * BASE_POSITIONS}", "model.path={base}"],
        f"samples.max_new_tokens={2 * BASE_POSITIONS} is more than the base model's {BASE_POSITIONS} positions"),
    "a chat template that trains no stop token": (
        "finetune", ["data.format=chat", "data.chat_template={glm}"],
        "fails check (a): assistant turn 0 ends its targets with"),
}


@pytest.fixture(scope="module")
def recipes():
    return {name: recipe_module(name) for name in WORK}


@pytest.fixture
def places(tmp_path, monkeypatch):
    """The tiny base (its config.json alone: nothing may load its weights), a checkpoint's record of a run on corpus
    a.txt, corpus b.txt and a chat template that trains no stop token."""
    from transformers import LlamaConfig

    monkeypatch.setenv("LLM_TOOLKIT_CACHE", str(tmp_path / "cache"))
    base = tmp_path / "base"
    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=512, max_position_embeddings=BASE_POSITIONS).save_pretrained(base)
    trained, other = tmp_path / "a.txt", tmp_path / "b.txt"
    for path in (trained, other):
        path.write_text("Some text to train on.\n\nAnother document.\n")
    cfg = load_config(PretrainConfig, str(ROOT / "recipes" / "configs" / "pretrain_tiny.yaml"), TINY)
    checkpoint = tmp_path / "earlier" / "checkpoints" / "step-3"
    checkpoint.mkdir(parents=True)
    TrainerState(step=3, seed=cfg.seed, global_batch_size=cfg.train.global_batch_size,
                 settings={"data.path": str(trained.resolve())}).write(checkpoint)
    assert json.loads((checkpoint / "trainer_state.json").read_text())["settings"]["data.path"]
    glm = tmp_path / "glm.jinja"  # GLM's shape: nothing ends an answer but the next role's marker
    glm.write_text("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{% endfor %}"
                   "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    yield {"base": base, "resume": checkpoint, "other": other, "glm": glm}
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.mark.parametrize("case", EARLY)
def test_a_refusal_the_config_decides_comes_before_any_data_or_model(case, recipes, places, tmp_path, capsys,
                                                                      monkeypatch):
    recipe, overrides, said = EARLY[case]
    module = recipes[recipe]
    for name in WORK[recipe]:
        def reached(*args, name=name, **kwargs):
            raise AssertionError(f"{recipe}: {name} ran before the refusal of {case!r}")
        monkeypatch.setattr(module, name, reached)
    config, tiny = CONFIG[recipe]
    argv = ["--config", str(ROOT / "recipes" / "configs" / config), *tiny, "train.max_steps=1",
            f"output_dir={tmp_path / 'run'}", *(o.format(**places) for o in overrides)]
    assert module.main(argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert said in errors[0]
