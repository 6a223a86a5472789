"""Which weights a fine-tune trains: a LoRA (peft) on a tiny LLaMA, its checks, and the merge.

The merge contract a user relies on: the merged model (an ordinary transformers model) gives the
same logits as the base with the adapter on top, as peft saved it.
"""

from __future__ import annotations

import pytest
import torch

from toolkit.config import UserError
from toolkit.models.adapter import (
    DEFAULT_TARGETS,
    AdapterConfig,
    apply_adapter,
    check_qlora_device,
    linear_names,
    load_with_adapter,
    merge,
    qlora_problem,
    quantization_config,
)
from toolkit.parallel_layout import ParallelLayout

LLAMA_LINEARS = ["down_proj", "gate_proj", "k_proj", "lm_head", "o_proj", "q_proj", "up_proj", "v_proj"]


@pytest.fixture
def base(tiny_model, tiny_tokenizer):
    """A fresh, identically initialised tiny LLaMA per call (apply_adapter changes the model in place)."""
    return lambda: tiny_model("llama", seed=0, tokenizer=tiny_tokenizer)


def ids() -> torch.Tensor:
    return torch.randint(3, 300, (2, 24), generator=torch.Generator().manual_seed(0))


# AdapterConfig


def test_the_defaults_are_valid():
    cfg = AdapterConfig()
    assert cfg.validate() == []
    assert cfg.method == "lora" and cfg.is_lora
    assert cfg.target_modules == DEFAULT_TARGETS and cfg.target_modules is not DEFAULT_TARGETS


def test_every_bad_value_is_reported():
    cfg = AdapterConfig(r=0, alpha=0, dropout=1.0, target_modules=[])
    assert sorted(cfg.validate()) == sorted(
        [
            "r=0 must be at least 1",
            "alpha=0 must be positive",
            "dropout=1.0 must be in [0, 1)",
            "target_modules is empty; name the projections to adapt, or use [all-linear]",
        ]
    )
    assert AdapterConfig(dropout=-0.1).validate() == ["dropout=-0.1 must be in [0, 1)"]
    assert AdapterConfig(alpha=-1).validate() == ["alpha=-1 must be positive"]


def test_is_lora_per_method():
    assert [AdapterConfig(method=m).is_lora for m in ("full", "lora", "qlora")] == [False, True, True]


def test_qlora_needs_cuda_and_says_what_to_use_instead():
    check_qlora_device(AdapterConfig(method="lora"))  # nothing to check
    check_qlora_device(AdapterConfig(method="full"))
    if not torch.cuda.is_available():
        with pytest.raises(
            UserError, match=r"adapter.method=qlora needs a CUDA GPU .* use adapter.method=lora"
        ):
            check_qlora_device(AdapterConfig(method="qlora"))


@pytest.mark.parametrize(("layout", "refused"), [
    (ParallelLayout("single"), None), (ParallelLayout("ddp", world=8), None),
    (ParallelLayout("fsdp", world=8), "FSDP would shard"), (ParallelLayout("deepspeed", zero_stage=1), "DeepSpeed would"),
    (ParallelLayout("fsdp", world=4, tp=2), "model parallel would split"), (ParallelLayout("ddp", pp=2), "model parallel"),
])
def test_qlora_trains_under_ddp_only_and_each_other_layout_says_why(layout, refused):
    """bitsandbytes' 4-bit base is held whole on each GPU: a layout that shards, casts or splits it is one line."""
    assert qlora_problem(AdapterConfig(method="lora"), layout) is None  # a full-precision base goes anywhere
    said = qlora_problem(AdapterConfig(method="qlora"), layout)
    if refused is None:
        assert said is None
    else:
        assert said.startswith(f"adapter.method=qlora trains under DDP only ({refused}") and "ddp.yaml" in said


def test_quantization_config_only_for_qlora():
    assert quantization_config(AdapterConfig(method="lora")) is None
    assert quantization_config(AdapterConfig(method="full")) is None
    q = quantization_config(AdapterConfig(method="qlora"))
    assert q.load_in_4bit and q.bnb_4bit_quant_type == "nf4" and q.bnb_4bit_use_double_quant
    assert q.bnb_4bit_compute_dtype == torch.bfloat16


# apply_adapter


def test_linear_names_of_llama_and_gpt2(base, tiny_model):
    assert linear_names(base()) == LLAMA_LINEARS
    assert {"c_attn", "c_fc", "c_proj"} <= set(linear_names(tiny_model("gpt2")))  # Conv1D counts as linear


def test_full_fine_tune_trains_everything(base):
    model = base()
    out, line = apply_adapter(model, AdapterConfig(method="full"))
    assert out is model
    n = sum(p.numel() for p in model.parameters())
    assert all(p.requires_grad for p in model.parameters())
    assert line == f"weights: full fine-tune, {n:,} trainable parameters"


def test_lora_trains_only_the_adapter_and_says_how_much(base):
    model = base()
    total_before = sum(p.numel() for p in model.parameters())
    cfg = AdapterConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"])
    peft_model, line = apply_adapter(model, cfg)
    trainable = {n: p for n, p in peft_model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert all(not p.requires_grad for n, p in peft_model.named_parameters() if "lora_" not in n)
    # one A (r x in) and one B (out x r) per adapted projection, in each of the 2 layers
    hidden, kv = 64, 32
    expected = 2 * ((4 * hidden + hidden * 4) + (4 * hidden + kv * 4))
    assert sum(p.numel() for p in trainable.values()) == expected
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable}
    assert adapted == {"q_proj", "v_proj"}
    total = total_before + expected
    assert line == (
        f"weights: lora r=4 alpha=8 on q_proj, v_proj: {expected:,} trainable of {total:,} parameters "
        f"({expected / total:.2%})"
    )


def test_lora_starts_as_the_base_model(base):
    """LoRA's B starts at zero: before any training the adapted model computes what the base did."""
    x = ids()
    reference = base().eval()(input_ids=x).logits
    peft_model, _ = apply_adapter(base(), AdapterConfig(dropout=0.0))
    torch.testing.assert_close(peft_model.eval()(input_ids=x).logits, reference, rtol=0, atol=0)


def test_all_linear(base):
    peft_model, line = apply_adapter(base(), AdapterConfig(r=2, target_modules=["all-linear"]))
    adapted = {
        n.split(".lora_")[0].rsplit(".", 1)[-1] for n, p in peft_model.named_parameters() if p.requires_grad
    }
    assert adapted == set(LLAMA_LINEARS) - {"lm_head"}  # peft leaves the output layer alone
    assert "on all-linear:" in line


def test_targets_that_match_no_layer_list_the_real_ones(base, tiny_model):
    with pytest.raises(UserError) as excinfo:
        apply_adapter(base(), AdapterConfig(target_modules=["q_proj", "qkv_proj", "mlp"]))
    message = str(excinfo.value)
    assert message.startswith(
        "adapter.target_modules ['qkv_proj', 'mlp'] match no layer of this LlamaForCausalLM"
    )
    assert f"its linear layers are {', '.join(LLAMA_LINEARS)} (or use [all-linear])" in message

    # the LLaMA defaults on a GPT-2: every name is wrong, and the message says what GPT-2 calls them
    with pytest.raises(
        UserError, match=r"match no layer of this GPT2LMHeadModel; its linear layers are .*c_attn"
    ):
        apply_adapter(tiny_model("gpt2"), AdapterConfig())


# merge and load_with_adapter


SWITCHES = {"plain": {}, "dora": {"dora": True}, "rslora": {"rslora": True}, "modules_to_save": {"modules_to_save": ["norm"]},
            "layers": {"layers": [1]}}


@pytest.mark.parametrize("switch", SWITCHES)
def test_merge_and_load_with_adapter_round_trip(base, tmp_path, switch):
    """With each of peft's switches the adapter reloads and merges to the logits it trained to."""
    peft_model, said = apply_adapter(base(), AdapterConfig(r=4, alpha=16, dropout=0.1, **SWITCHES[switch]))
    lora_layers = {n.split(".layers.")[1].split(".")[0] for n, _ in peft_model.named_parameters() if "lora_A" in n}
    assert lora_layers == ({"1"} if switch == "layers" else {str(i) for i in range(base().config.num_hidden_layers)})
    q = peft_model.base_model.model.model.layers[1].self_attn.q_proj
    assert q.scaling["default"] == (16 / 2 if switch == "rslora" else 16 / 4)  # alpha / sqrt(r), or alpha / r
    assert any("lora_magnitude_vector" in n for n, _ in q.named_parameters()) == (switch == "dora")
    assert said.startswith({"dora": "weights: lora+dora r=4", "rslora": "weights: lora+rslora r=4"}.get(
        switch, "weights: lora r=4")) and ("norm trained whole" in said) == (switch == "modules_to_save")
    with torch.no_grad():  # stand-in for training: B starts at zero, which would hide a broken merge
        gen = torch.Generator().manual_seed(1)
        for name, p in peft_model.named_parameters():
            if "lora_" in name or (p.requires_grad and "modules_to_save" in name):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + (1 if "magnitude" in name or "norm" in name else 0))
    peft_model.eval()  # dropout off
    x = ids()
    with torch.no_grad():
        expected = peft_model(input_ids=x).logits
        base_logits = base().eval()(input_ids=x).logits
    assert (expected - base_logits).abs().max() > 1e-2  # the adapter really changes the output

    peft_model.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()

    loaded = load_with_adapter(base(), tmp_path / "adapter")
    assert not loaded.training
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=x).logits, expected, rtol=1e-5, atol=1e-5)

    merged = merge(base(), tmp_path / "adapter")
    assert type(merged).__name__ == "LlamaForCausalLM"
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    assert set(merged.state_dict()) == set(base().state_dict())
    with torch.no_grad():
        torch.testing.assert_close(merged.eval()(input_ids=x).logits, expected, rtol=1e-4, atol=1e-4)


def test_lora_on_a_mixture_of_experts_takes_its_experts_and_refuses_dropout_in_one_line(tiny_model):
    """all-linear on a MoE takes the experts' 3-D weights too, which peft wraps without dropout: its
    ValueError was a traceback. With dropout 0 the adapter goes on, experts included, and the router
    loss is still found through peft's wrapper."""
    from toolkit.models.router import RouterLoss

    with pytest.raises(UserError) as info:
        apply_adapter(tiny_model("qwen3_moe"), AdapterConfig(method="lora", target_modules=["all-linear"], dropout=0.1))
    assert str(info.value) == (
        "peft cannot put this LoRA on Qwen3MoeForCausalLM (lora.ParamWrapper does not work with lora_dropout != 0.); "
        "set adapter.dropout=0: peft's LoRA on a mixture of experts' expert weights (all-linear takes them too) has "
        "no dropout"
    )
    model, _ = apply_adapter(tiny_model("qwen3_moe"), AdapterConfig(method="lora", target_modules=["all-linear"],
                                                                    dropout=0.0))
    assert any("experts" in name and "lora" in name for name, p in model.named_parameters() if p.requires_grad)
    router = RouterLoss.of(model)
    router.start()
    model(input_ids=torch.arange(16).reshape(2, 8), use_cache=False)
    assert torch.isfinite(router.loss())


def test_a_run_without_a_4bit_base_never_imports_bitsandbytes(tmp_path):
    """peft imports bitsandbytes whenever it is installed (and transformers' schedules import peft);
    bitsandbytes 0.50 then prints "Failed to load CPU gemm_4bit_forward …" on a machine without the
    `kernels` package. A stand-in that records its import: after leave_out_bitsandbytes(), a LoRA, its
    save and load, and a schedule never touch it, and peft and transformers see it as not installed."""
    import os
    import subprocess
    import sys

    imported = tmp_path / "imported"
    package = tmp_path / "site" / "bitsandbytes"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(f"open({str(imported)!r}, 'w').close()\n")
    code = f"""
from toolkit.models.adapter import AdapterConfig, apply_adapter, leave_out_bitsandbytes, load_with_adapter
leave_out_bitsandbytes()
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from toolkit.training.optim import OptimConfig, build_scheduler
from peft.import_utils import is_bnb_available
from transformers.utils import is_bitsandbytes_available
config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1, vocab_size=64)
model, _ = apply_adapter(LlamaForCausalLM(config), AdapterConfig(r=2))
model.save_pretrained({str(tmp_path / 'adapter')!r})
load_with_adapter(LlamaForCausalLM(config), {str(tmp_path / 'adapter')!r})
build_scheduler(torch.optim.AdamW(model.parameters()), OptimConfig(), 10)
assert not is_bnb_available() and not is_bitsandbytes_available()
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(package.parent), *sys.path])}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not imported.exists()
