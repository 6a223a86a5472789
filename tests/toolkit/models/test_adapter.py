"""Which weights a fine-tune trains: a LoRA (peft) on a tiny LLaMA, its checks, and the merge.

The merge contract a user relies on: the merged model (an ordinary transformers model) gives the
same logits as the base with the adapter on top, as peft saved it.
"""

from __future__ import annotations

import sys

import pytest
import torch

from toolkit.config.errors import UserError
from toolkit.models import adapter
from toolkit.models.adapter import (
    ADAPTABLE,
    DEFAULT_TARGETS,
    MERGES,
    NOT_WALKED,
    AdapterConfig,
    adaptable_names,
    apply_adapter,
    check_qlora_device,
    layer_kind,
    load_with_adapter,
    merge,
    quantization_config,
)

LLAMA_LINEARS = ["down_proj", "gate_proj", "k_proj", "lm_head", "o_proj", "q_proj", "up_proj", "v_proj"]
LLAMA_ADAPTABLE = sorted([*LLAMA_LINEARS, "embed_tokens"])


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


def test_qlora_needs_bitsandbytes_and_says_how_to_install_it(monkeypatch):
    check_qlora_device(AdapterConfig(method="lora"))  # nothing to check
    check_qlora_device(AdapterConfig(method="full"))
    if sys.modules.get("bitsandbytes", False) is None:  # an in-process run before it marked it absent (leave_out_...)
        monkeypatch.delitem(sys.modules, "bitsandbytes")
    check_qlora_device(AdapterConfig(method="qlora"))  # installed with the tests (recipes/install.sh --for tests)
    monkeypatch.setattr(adapter.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match=r"adapter.method=qlora needs bitsandbytes; pip install -e '.\[qlora\]'"):
        check_qlora_device(AdapterConfig(method="qlora"))


def test_quantization_config_only_for_qlora_computing_in_the_runs_precision():
    assert quantization_config(AdapterConfig(method="lora"), False, "no") is None
    assert quantization_config(AdapterConfig(method="full"), True, "bf16") is None
    for on_gpu, precision, compute in ((True, "bf16", torch.bfloat16), (False, "no", torch.float32),
                                       (False, "bf16", torch.bfloat16)):
        q = quantization_config(AdapterConfig(method="qlora"), on_gpu, precision)
        assert q.load_in_4bit and q.bnb_4bit_quant_type == "nf4" and q.bnb_4bit_use_double_quant
        assert q.bnb_4bit_compute_dtype == compute and q.bnb_4bit_quant_storage == torch.uint8
    assert quantization_config(AdapterConfig(method="qlora"), False, "no", torch.float32).bnb_4bit_quant_storage == torch.float32


# apply_adapter


def test_adaptable_names_of_llama_and_gpt2(base, tiny_model):
    assert adaptable_names(base()) == LLAMA_ADAPTABLE
    assert {"c_attn", "c_fc", "c_proj", "wte"} <= set(adaptable_names(tiny_model("gpt2")))  # Conv1D counts as linear


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
    assert f"its linear and embedding layers are {', '.join(LLAMA_ADAPTABLE)} (or use [all-linear])" in message

    # the LLaMA defaults on a GPT-2: every name is wrong, and the message says what GPT-2 calls them
    with pytest.raises(
        UserError, match=r"match no layer of this GPT2LMHeadModel; its linear and embedding layers are .*c_attn"
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


# Every adapter combination x merge (issue 44, class 6): each row of toolkit.models.adapter.MERGES walked on a base
# with tied and with untied embeddings. What target_modules names, by what it adapts (MERGES["target_modules"]):
ROLE = {"q_proj": "attention", "k_proj": "attention", "v_proj": "attention", "o_proj": "attention", "c_attn": "attention",
        "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp", "c_fc": "mlp", "embed_tokens": "embed_tokens",
        "wte": "embed_tokens", "lm_head": "lm_head", "all-linear": "all-linear"}
# (family, AdapterConfig switches, the MERGES entries the row walks)
ATTENTION, MLP = ["q_proj", "k_proj", "v_proj", "o_proj"], ["gate_proj", "up_proj", "down_proj"]
COMBINATIONS = {
    "attention": ("llama", {"target_modules": ATTENTION}, {"attention"}),
    "mlp": ("llama", {"target_modules": MLP}, {"mlp"}),
    "embed_tokens": ("llama", {"target_modules": ["embed_tokens"]}, {"embed_tokens"}),
    "lm_head": ("llama", {"target_modules": ["lm_head"]}, {"lm_head"}),
    "all-linear": ("llama", {"target_modules": ["all-linear"]}, {"all-linear", "attention", "mlp"}),
    "embed_tokens+lm_head": ("llama", {"target_modules": ["embed_tokens", "lm_head"]}, {"embed_tokens", "lm_head"}),
    **{f"{t}+dora": ("llama", {"target_modules": [t], "dora": True}, {ROLE[t], "dora"})
       for t in ("all-linear", "embed_tokens", "lm_head")},
    "rslora": ("llama", {"rslora": True, "alpha": 3}, {"rslora", "alpha", "attention", "mlp"}),
    "layers": ("llama", {"layers": [1]}, {"layers"}),
    "dropout": ("llama", {"dropout": 0.1}, {"dropout"}),
    "full rank": ("llama", {"r": 64, "target_modules": ["q_proj", "lm_head"]}, {"r"}),
    "modules_to_save=embed_tokens": ("llama", {"target_modules": ["q_proj"], "modules_to_save": ["embed_tokens"]},
                                     {"modules_to_save"}),
    "modules_to_save=lm_head": ("llama", {"target_modules": ["q_proj"], "modules_to_save": ["lm_head"]},
                                {"modules_to_save"}),
    "modules_to_save=norm": ("llama", {"target_modules": ["q_proj"], "modules_to_save": ["norm"]}, {"modules_to_save"}),
    "gpt2 (Conv1D)": ("gpt2", {"target_modules": ["c_attn", "c_fc"]}, {"attention", "mlp"}),
    "gpt2 wte": ("gpt2", {"target_modules": ["wte"]}, {"embed_tokens"}),
    "gemma2 embed_tokens (scaled)": ("gemma2", {"target_modules": ["embed_tokens"]}, {"embed_tokens"}),
}


def test_every_adapter_option_target_and_layer_kind_has_a_merge_row(bases):
    """The table is complete: a field added to AdapterConfig, a method, a target of the LLaMA family or a kind of layer
    a LoRA may adapt fails here until MERGES says what a merge makes of it and a row of COMBINATIONS walks it."""
    from dataclasses import fields
    from typing import get_args, get_type_hints

    assert set(MERGES) == {f.name for f in fields(AdapterConfig)}
    assert set(MERGES["method"]) == set(get_args(get_type_hints(AdapterConfig)["method"]))
    walked = set().union(*(entries for _, _, entries in COMBINATIONS.values()))
    assert walked | {"target_modules", "method", "merge"} | set(NOT_WALKED) >= set(MERGES) | set(MERGES["target_modules"])
    targets = {t for family, switches, _ in COMBINATIONS.values() if family == "llama" for t in switches.get("target_modules", [])}
    assert set(adaptable_names(bases("llama", True)[0])) | {"all-linear"} == targets  # every target the config accepts
    kinds = {family: {layer_kind(m) for m in bases(family, True)[0].modules()} - {None}
             for family in ("llama", "gpt2", "gemma2")}
    assert set(ADAPTABLE) - set(NOT_WALKED) == set().union(*kinds.values())  # each kind on a family a row uses


@pytest.fixture(scope="module")
def bases(tmp_path_factory, tiny_tokenizer, tiny_model):
    """bases(family, tied): a fresh copy of that tiny base and a folder holding it (export --merge-lora --base reads
    one); each built once (a copy costs a tenth of a build)."""
    import copy

    made = {}

    def fresh(family: str, tied: bool):
        if (family, tied) not in made:
            model = tiny_model(family, seed=0, tokenizer=tiny_tokenizer, attn="eager", tie_word_embeddings=tied)
            out = tmp_path_factory.mktemp(f"{family}-{tied}")
            model.save_pretrained(out)
            tiny_tokenizer.save_pretrained(out)
            made[family, tied] = model.eval(), out
        model, out = made[family, tied]
        return copy.deepcopy(model), out

    return fresh


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("row", COMBINATIONS)
def test_every_adapter_combination_merges_to_base_plus_adapter(row, tied, bases, tiny_tokenizer, tmp_path):
    """The merged model of each row gives the logits of the base with the adapter on top (peft, unmerged) to 1e-5:
    final/ as adapter.merge=true writes it and reloads, recipes/export.py --merge-lora of the adapter folder and of a
    LoRA run's checkpoint. On a tied base an adapter on embed_tokens or lm_head unties them (it was merged into both:
    issue 44's 9.45 against 7.88); the base's other weights stay the base's."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from toolkit.export.consolidate import Source, _merge_lora_checkpoint, load_model, resolve_source
    from toolkit.export.hf_folder import write_model_folder

    family, switches, _ = COMBINATIONS[row]
    cfg = AdapterConfig(**{"r": 4, "alpha": 8, "target_modules": ["q_proj", "down_proj"], **switches})
    peft_model, said = apply_adapter(bases(family, tied)[0], cfg)
    touches = {*cfg.modules_to_save, *cfg.target_modules} & {"embed_tokens", "lm_head", "wte"}
    unties = tied and bool(touches)
    assert ("the merged model unties them" in said) == unties, said
    with torch.no_grad():  # stand-in for training: B starts at zero, which would hide a broken merge
        gen = torch.Generator().manual_seed(1)
        for p in (p for p in peft_model.parameters() if p.requires_grad):
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    peft_model.eval()
    x = ids()
    with torch.no_grad():
        expected = peft_model(input_ids=x).logits
        base, base_dir = bases(family, tied)
        assert (expected - base(input_ids=x).logits).abs().max() > 1e-2  # the adapter really changes the output
    peft_model.save_pretrained(tmp_path / "adapter", save_embedding_layers=False)  # as save_adapter does

    final = write_model_folder(merge(bases(family, tied)[0], tmp_path / "adapter"), tiny_tokenizer, tmp_path / "final", {}, {}, card="")
    exports = {"final/": AutoModelForCausalLM.from_pretrained(final)}
    exports["export of the adapter"], _, _ = load_model(resolve_source(tmp_path / "adapter"),
                                                        base=str(base_dir))
    checkpoint, files = tmp_path / "checkpoint", tmp_path / "adapter"  # a LoRA run's checkpoint: peft's whole state
    checkpoint.mkdir()
    save_file({k: v.clone().contiguous() for k, v in peft_model.state_dict().items()}, checkpoint / "model.safetensors")
    base.config.save_pretrained(files)
    exports["export of a checkpoint"], _ = _merge_lora_checkpoint(checkpoint, files, Source("ddp", checkpoint))
    for what, model in exports.items():
        assert not any("lora_" in n for n, _ in model.named_parameters()), what
        assert model.config.tie_word_embeddings == (tied and not unties), what
        with torch.no_grad():
            torch.testing.assert_close(model.eval()(input_ids=x).logits, expected, rtol=1e-5, atol=1e-5, msg=what)
            same_embedding = torch.equal(model.get_input_embeddings().weight, base.get_input_embeddings().weight)
        assert same_embedding == (not touches & {"embed_tokens", "wte"}), what


def test_a_rank_above_what_the_adapted_layers_can_use_is_refused_before_it_is_built(base):
    """r=100000 on 128-wide layers made a 3.7 GB adapter for a 5 MB model without a word. A LoRA of rank r on an
    in x out layer expresses at most rank min(in, out): the largest of those over the adapted layers is the most a
    rank can use, and a larger r is one line naming it (the tiny LLaMA: 64 wide, k_proj and v_proj 64 -> 32)."""
    with pytest.raises(UserError) as info:
        apply_adapter(base(), AdapterConfig(r=100000))
    assert str(info.value) == (
        "adapter.r=100000 is more than the adapted layers can use: a LoRA of rank r on a layer of in x out has the "
        "expressiveness of rank min(in, out), and the largest here is 64 (q_proj); set adapter.r to at most 64 (or use "
        "adapter.method=full to train every weight)"
    )
    with pytest.raises(UserError, match=r"adapter.r=33 is more .* the largest here is 32 \(k_proj\)"):
        apply_adapter(base(), AdapterConfig(r=33, target_modules=["k_proj", "v_proj"]))
    for fits in (AdapterConfig(r=32, target_modules=["k_proj", "v_proj"]), AdapterConfig(r=64)):
        apply_adapter(base(), fits)  # full rank is allowed (a LoRA as expressive as the layer)
    with pytest.raises(UserError, match=r"the largest here is 64 \(embed_tokens\)"):  # vocab x 64: 64
        apply_adapter(base(), AdapterConfig(r=65, target_modules=["embed_tokens"]))


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
