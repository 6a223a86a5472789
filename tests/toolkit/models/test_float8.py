"""train.mixed_precision=fp8 (toolkit.models.float8): which layers convert and why the others do not, for the tiny
model and the 1B YAML's shapes; the model keeps its parameters; what cannot train in fp8 is refused in one line; and
30 steps under torchao's emulated float8 track bf16's within the bound that float8's rounding gives."""

from __future__ import annotations

import datasets
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from toolkit.config.errors import ConfigError, UserError
from toolkit.config.load import load_config
from toolkit.data.packing import collate, pack_documents, tokenize_documents
from toolkit.models import float8
from toolkit.training.recipe_config import FinetuneConfig, PretrainConfig

ONE_B = "recipes/configs/pretrain_llama_1b.yaml"


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setenv(float8.EMULATE, "1")


def one_b_on_meta():
    cfg = load_config(PretrainConfig, ONE_B, [])
    with torch.device("meta"):
        config = AutoConfig.for_model("llama", **{**cfg.model.config, "vocab_size": cfg.tokenizer.vocab_size})
        return AutoModelForCausalLM.from_config(config)


def short(conversion: float8.Conversion) -> tuple[set[str], dict[str, str]]:
    return ({float8._shape_of(n) for n in conversion.converted},
            {float8._shape_of(n): why for n, why in conversion.left.items()})


def test_the_1b_keeps_q_o_and_the_mlp_in_float8_and_k_v_and_the_head_in_bf16():
    """torchao's size rule on Llama-3.2-1B's shapes (hidden 2048, MLP 8192, 8 KV heads of 64): tensorwise keeps every
    layer with more than 1024 outputs or 4096 inputs, rowwise only the 8192-wide MLP inputs."""
    model = one_b_on_meta()
    converted, left = short(float8.plan(model, "tensorwise", sizes=True))
    assert converted == {"self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
    assert left == {"self_attn.k_proj": "below torchao's size rule", "self_attn.v_proj": "below torchao's size rule",
                    "lm_head": "output head"}
    converted, _ = short(float8.plan(model, "rowwise", sizes=True))
    assert converted == {"mlp.gate_proj", "mlp.up_proj"}
    converted, left = short(float8.plan(model, "tensorwise", sizes=True, layers="mlp"))  # train.fp8_layers=mlp
    assert converted == {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
    assert left["self_attn.q_proj"] == left["self_attn.o_proj"] == float8.OUTSIDE_THE_MLP
    assert left["self_attn.k_proj"] == "below torchao's size rule"  # the rules first
    # 16 layers x 5 converted of 7, and the head: 80 of 113, as the H200 run said (docs/fp8.md)
    whole = float8.plan(model, "tensorwise", sizes=True)
    assert (len(whole.converted), len(whole.converted) + len(whole.left)) == (80, 113)


def test_emulated_conversion_keeps_every_parameter_and_trains(emulated, tiny_model):
    model = tiny_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    done = float8.convert(model, "tensorwise")
    assert len(done.converted) == 14 and set(done.left.values()) == {"output head"}  # 2 layers x 7, the head left
    assert "fp8: 14 of 15 linear layers in float8 (tensorwise scaling, emulated" in done.said()
    assert type(model.model.layers[0].mlp.up_proj).__name__ == "Float8Linear"
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    plain = tiny_model(seed=1)
    plain.load_state_dict(after)  # a plain transformers model takes the same names and shapes
    x = torch.randint(0, 300, (2, 32))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=x, labels=x).loss
    loss.backward()
    assert model.model.layers[0].mlp.up_proj.weight.grad.dtype == torch.float32  # the fp32 master's gradient


def test_a_model_with_no_layer_large_enough_is_refused(monkeypatch, tiny_model):
    monkeypatch.setenv(float8.EMULATE, "1")
    no_mlp = torch.nn.Sequential(torch.nn.Linear(64, 64))  # a linear layer float8 takes, but not under .mlp.
    with pytest.raises(UserError, match=r"^train.fp8_layers=mlp: no linear layer under this model's .mlp. modules"):
        float8.convert(no_mlp, "tensorwise", layers="mlp")
    monkeypatch.delenv(float8.EMULATE, raising=False)
    with pytest.raises(UserError, match=r"no linear layer of this model is large enough to gain from float8 \(the "
                                        r"largest is \(300, 64\), below torchao's size rule for tensorwise\): it "
                                        r"would train in bf16; use train.mixed_precision=bf16$"):
        float8.convert(tiny_model(), "tensorwise")


def test_the_hardware_check(monkeypatch):
    monkeypatch.delenv(float8.EMULATE, raising=False)
    assert "needs an NVIDIA GPU of compute capability 8.9 or newer (Ada, Hopper); this run is on cpu: use bf16" in (
        float8.hardware_refused(torch.device("cpu")))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    assert float8.hardware_refused(torch.device("cuda")).endswith(
        "NVIDIA A100-SXM4-80GB is 8.0, without float8 matmuls: use bf16")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert float8.hardware_refused(torch.device("cuda")) is None
    monkeypatch.setenv(float8.EMULATE, "1")
    assert float8.hardware_refused(torch.device("cpu")) is None


@pytest.mark.parametrize("recipe, overrides, said", [
    (PretrainConfig, ["model.compile=none"], "train.mixed_precision=fp8 is slower than bf16 without torch.compile"),
    (FinetuneConfig, ["model.compile=layers", "adapter.method=qlora"], "adapter.method=qlora's base is 4-bit"),
])
def test_what_fp8_cannot_do_is_refused_with_the_config(recipe, overrides, said, monkeypatch):
    monkeypatch.delenv(float8.EMULATE, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a machine that trains fp8: an H100
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    with pytest.raises(ConfigError, match=said):
        load_config(recipe, None, ["train.mixed_precision=fp8", *overrides])
    load_config(recipe, None, ["train.mixed_precision=bf16", *overrides])  # fp8 is why


def test_a_machine_without_fp8_is_said_before_what_fp8_would_want_of_the_config(monkeypatch):
    """On a CPU, fp8 without model.compile was refused for the compile first, and for the CPU once that was set: the
    most fundamental is said first, the machine (at launch: test_bad_config_gives_one_line[fp8 on a CPU])."""
    monkeypatch.delenv(float8.EMULATE, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert float8.config_problems(load_config(PretrainConfig, None, ["train.mixed_precision=fp8"])) == []


# ---------------------------------------------------------------- 30 steps against bf16
STEPS, SEQ_LEN, BATCH = 30, 64, 4
# Rounding moves the loss, to first order, in proportion to the format's unit roundoff: bf16 keeps 8 significant bits
# (u = 2^-8), float8 e4m3 (weights, activations) 4 and e5m2 (gradients) 3, so u = 2^-3 at worst: 32 x bf16's. So
# fp8's distance from bf16 is bounded by 32 x bf16's own distance from fp32, over the same steps.
ROUNDOFF_RATIO = 2.0**-3 / 2.0**-8


def curve(blocks, mode: str, tiny_model) -> list[float]:
    model = tiny_model()
    if mode == "fp8":
        float8.convert(model, "tensorwise")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    losses = []
    for step in range(STEPS):
        batch = collate(blocks[[(step * BATCH + i) % len(blocks) for i in range(BATCH)]], "sdpa")
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode != "fp32"):
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_thirty_steps_of_emulated_fp8_track_bf16_within_float8s_rounding(emulated, tiny_texts, tiny_tokenizer, tiny_model):
    tokenized = tokenize_documents(datasets.Dataset.from_dict({"text": tiny_texts[:40]}), tiny_tokenizer)
    blocks = pack_documents(tokenized, SEQ_LEN, tiny_tokenizer.pad_token_id).with_format("numpy")
    fp32, bf16, fp8 = (curve(blocks, mode, tiny_model) for mode in ("fp32", "bf16", "fp8"))
    assert fp8[-1] < fp8[0] - 1.0  # it trains
    bf16_gap = max(abs(a - b) for a, b in zip(bf16, fp32, strict=True))
    fp8_gap = max(abs(a - b) for a, b in zip(fp8, bf16, strict=True))
    print(f"30 steps: bf16 - fp32 at most {bf16_gap:.4f}, fp8 - bf16 at most {fp8_gap:.4f} "
          f"(bound {ROUNDOFF_RATIO:.0f} x {bf16_gap:.4f}); last losses {fp32[-1]:.4f} {bf16[-1]:.4f} {fp8[-1]:.4f}")
    assert 0 < fp8_gap <= ROUNDOFF_RATIO * bf16_gap  # float8 did compute (not bf16's numbers), within its rounding


def test_a_lora_adapter_trains_over_float8_layers_and_merges_into_plain_weights(emulated, tiny_model):
    """The recipe converts before the adapter: peft wraps each Float8Linear as it wraps an nn.Linear, its own
    matrices stay bf16, and merging gives the same names as a plain model's."""
    from peft import LoraConfig, get_peft_model

    model = tiny_model()
    float8.convert(model, "tensorwise")
    lora = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "up_proj"]))
    x = torch.randint(0, 300, (2, 32))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lora(input_ids=x, labels=x).loss.backward()
    a = next(p for n, p in lora.named_parameters() if "lora_B" in n)
    assert a.grad is not None and a.grad.abs().sum() > 0
    assert type(lora.base_model.model.model.layers[0].self_attn.q_proj.base_layer).__name__ == "Float8Linear"
    merged = lora.merge_and_unload().state_dict()
    assert merged.keys() == tiny_model().state_dict().keys()
