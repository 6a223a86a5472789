"""The `auto` compute switches of a run made concrete for the machine it launched on, once, before anything reads
them (`resolve`): on a CUDA GPU the fast paths, elsewhere what the run computed before they existed.

Each fast path is proven equal on CPU to the path it replaces (the test named in its row of `AUTO`), and checked
while a run goes on by the numerics canary (toolkit.training.canary.LEVERS). After `resolve` the config holds the
values the run takes, so the run folder's config.yaml, a resume's comparison and every reader see those; the line it
returns says what `auto` became.
"""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.config.combinations import positions_refused
from toolkit.parallel_layout import ParallelLayout


@dataclass(frozen=True)
class Machine:
    """What the launch decided that `auto` depends on."""

    device: str  # "cuda" or "cpu"
    precision: str  # the Accelerator's mixed precision: "no", "bf16" or "fp16"
    layout: ParallelLayout


def _attention(cfg, m: Machine) -> str:
    # flex_attention skips the blocks of other documents in a packed row (sdpa computes and masks them); context,
    # sequence and tensor parallel read packing's block-causal mask, which only sdpa and eager take
    return "flex_attention" if m.device == "cuda" and m.layout.model_parallel == 1 else "sdpa"


def _compile(cfg, m: Machine) -> str:
    # one graph every decoder layer reuses: the first steps compile; the model-parallel splits are untried compiled
    return "layers" if m.device == "cuda" and m.layout.model_parallel == 1 else "none"


def _loss_positions(cfg, m: Machine) -> str:
    # compile=model computes transformers' loss in its graph, at every position; model parallel: positions_refused
    applies = cfg.model.compile != "model" and positions_refused(m.layout) is None
    return "targets" if m.device == "cuda" and applies else "all"


def _dtype(cfg, m: Machine) -> str:
    # a frozen base computes in the autocast dtype anyway: stored in it, it takes half the memory and no cast a step;
    # weights that train keep fp32 masters (a LoRA's own matrices: peft keeps them in fp32 on a bf16 base). On CPU the
    # base stays fp32 whatever the precision, as it trained before
    frozen = getattr(getattr(cfg, "adapter", None), "is_lora", False)
    low = {"bf16": "bfloat16", "fp16": "float16"}.get(m.precision)
    return low if frozen and low and m.device == "cuda" else "float32"


# key -> (the value that resolves, how, the CPU test that proves the fast path equal to the other)
AUTO = {
    "model.attn_implementation": ("auto", _attention, "tests/toolkit/models/test_loss.py::"
                                  "test_flex_attention_loss_equals_the_masked_sdpa_loss"),
    "model.compile": ("auto", _compile, "tests/toolkit/models/test_compilation.py"),
    "model.loss_positions": ("auto", _loss_positions, "tests/toolkit/models/test_loss.py::"
                             "test_the_head_on_target_positions_alone_gives_the_same_loss_and_gradients"),
    "model.dtype": ("compute", _dtype, "tests/toolkit/config/test_switches.py::"
                    "test_a_bf16_base_under_a_lora_trains_as_the_fp32_base_within_bf16"),
}


def resolve(cfg, machine: Machine) -> str | None:
    """Every `auto` of AUTO in `cfg` set to its value on `machine`; the line that says them, or None if none was."""
    said, words = [], []
    for key, (value, how, _) in AUTO.items():
        section, name = key.split(".")
        part = getattr(cfg, section)
        if getattr(part, name, None) == value:
            setattr(part, name, how(cfg, machine))
            said.append(f"{key}={getattr(part, name)}")
            words += [value] if value not in words else []
    if not said:
        return None
    return f"on {'a CUDA GPU' if machine.device == 'cuda' else 'CPU'}, {' and '.join(words)}: {', '.join(said)}"
