"""fp8 training (`train.mixed_precision=fp8`): the model's large `nn.Linear` layers compute in float8 through
torchao's float8 training, the rest of the model in bf16 autocast as `bf16` does.

Each chosen layer becomes torchao's `Float8Linear`, an `nn.Linear` with the same parameters, so checkpoints,
final/ and every export read the same files as a bf16 run's. `RULES` chooses the layers (the first rule that
holds leaves a layer in bf16, with its reason). `LLM_TOOLKIT_FP8_EMULATE=1` (tests only) emulates the matmul.
The casts, scales, size rule and FSDP2's float8 gather: docs/internals.md, toolkit/models/float8.py.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from toolkit.config.errors import UserError

EMULATE = "LLM_TOOLKIT_FP8_EMULATE"
MIN_CAPABILITY = (8, 9)  # Ada and Hopper: the first GPUs with float8 tensor cores (torch._scaled_mm)


def emulated() -> bool:
    return os.environ.get(EMULATE, "") == "1"


def hardware_refused(device: torch.device) -> str | None:
    """Why this machine cannot train in fp8, or None where it can (or emulates it)."""
    if emulated():
        return None
    if device.type != "cuda":
        return ("train.mixed_precision=fp8 needs an NVIDIA GPU of compute capability 8.9 or newer (Ada, Hopper); "
                f"this run is on {device.type}: use bf16")
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return (f"train.mixed_precision=fp8 needs a GPU of compute capability 8.9 or newer (Ada, Hopper); {name} is "
                f"{capability[0]}.{capability[1]}, without float8 matmuls: use bf16")
    return None


def config_problems(cfg) -> list[str]:
    """What a recipe config with train.mixed_precision=fp8 asks that fp8 cannot do, whatever the layout, on a machine
    that trains fp8 (on another, the launch refuses the machine first)."""
    problems = []
    # float8's casts and scales are separate kernels eagerly: nanochat measured 0.23x bf16's speed without compile.
    # A machine that cannot train fp8 at all hears that first, at launch (hardware_refused): its speed is no question
    here = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.model.compile == "none" and not emulated() and hardware_refused(here) is None:
        problems.append("train.mixed_precision=fp8 is slower than bf16 without torch.compile (its casts and scales "
                        "run as separate kernels); set model.compile=layers (or model)")
    adapter = getattr(cfg, "adapter", None)
    if adapter is not None and adapter.method == "qlora":
        problems.append("train.mixed_precision=fp8 converts linear layers to float8, and adapter.method=qlora's base "
                        "is 4-bit (bitsandbytes), not linear layers; use adapter.method=lora")
    return problems


def _head(model: torch.nn.Module) -> torch.nn.Module | None:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft
    return base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None


@dataclass(frozen=True)
class LayerRule:
    reason: str  # why a layer it holds for stays in bf16
    holds: Callable[[torch.nn.Module, torch.nn.Module, str, bool], bool]  # (layer, model, recipe, sizes) -> left?


def _too_small(layer: torch.nn.Linear, recipe: str) -> bool:
    from torchao.float8 import _auto_filter_for_recipe  # noqa: PLC0415 (torchao only where fp8 is asked for)

    return not _auto_filter_for_recipe(recipe, filter_fqns=[])(layer, "")


RULES: tuple[LayerRule, ...] = (
    # the chunked loss reads the head's weight itself; its logits are the loss's precision (as torchtitan leaves it)
    LayerRule("output head", lambda layer, model, recipe, sizes: layer is _head(model)),
    LayerRule("a dimension not a multiple of 16",  # float8 matmuls (torch._scaled_mm) need it
              lambda layer, model, recipe, sizes: layer.in_features % 16 != 0 or layer.out_features % 16 != 0),
    LayerRule("below torchao's size rule", lambda layer, model, recipe, sizes: sizes and _too_small(layer, recipe)),
)
# train.fp8_layers=mlp: one rule more, by the layer's name
OUTSIDE_THE_MLP = "outside the MLP (train.fp8_layers=mlp)"


@dataclass
class Conversion:
    recipe: str
    converted: list[str]  # module names now computing in float8
    left: dict[str, str]  # module name -> the rule's reason
    gathers_float8: bool = False  # FSDP2 gathers the converted layers' weights in float8

    def said(self) -> str:
        shapes = sorted({_shape_of(n) for n in self.converted})
        kept = sorted({f"{_shape_of(n)} ({why})" for n, why in self.left.items()})
        mode = ", emulated (LLM_TOOLKIT_FP8_EMULATE=1)" if emulated() else ""
        mode += ", gathered in float8 by FSDP2" if self.gathers_float8 else ""
        return (f"fp8: {len(self.converted)} of {len(self.converted) + len(self.left)} linear layers in float8 "
                f"({self.recipe} scaling{mode}): {', '.join(shapes)}; left in bf16: {', '.join(kept) or 'none'}")


def _shape_of(name: str) -> str:
    """A layer's name without its index and prefixes: model.layers.3.mlp.up_proj -> mlp.up_proj."""
    parts = name.split(".")
    tail = [p for p in parts[-2:] if not p.isdigit()]
    return ".".join(tail) if len(tail) > 1 or not any(p.isdigit() for p in parts) else tail[-1]


def plan(model: torch.nn.Module, recipe: str, sizes: bool, layers: str = "auto") -> Conversion:
    """Which of `model`'s nn.Linear layers convert, and why each other one does not (`sizes`: apply the size rule;
    `layers`: train.fp8_layers). Works on a meta-device model: it reads shapes only."""
    converted, left = [], {}
    for name, layer in model.named_modules():
        if not isinstance(layer, torch.nn.Linear):
            continue
        rule = next((r for r in RULES if r.holds(layer, model, recipe, sizes)), None)
        if rule is not None:
            left[name] = rule.reason
        elif layers == "mlp" and ".mlp." not in f".{name}.":
            left[name] = OUTSIDE_THE_MLP
        else:
            converted.append(name)
    return Conversion(recipe, converted, left)


def convert(model: torch.nn.Module, recipe: str, layers: str = "auto", fsdp2: bool = False) -> Conversion:
    """Swap `model`'s eligible layers for torchao's Float8Linear, in place, before the adapter, the compile and the
    strategy's wrapping; a model with none eligible is refused (it would train in bf16 while saying fp8).
    `fsdp2` (the launch shards with FSDP2): tensorwise layers gather their weights in float8 (as the module says)."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: PLC0415
    except ImportError:
        raise UserError("train.mixed_precision=fp8 trains through torchao, which is not installed: "
                        "pip install -e '.[fp8]'") from None
    emulate = emulated()
    chosen = plan(model, recipe, sizes=not emulate, layers=layers)
    if not chosen.converted and OUTSIDE_THE_MLP in chosen.left.values():
        raise UserError("train.fp8_layers=mlp: no linear layer under this model's .mlp. modules passes the rules "
                        "above it; use train.fp8_layers=auto")
    if not chosen.converted:
        largest = max((m.weight.shape for m in model.modules() if isinstance(m, torch.nn.Linear)),
                      key=lambda s: s.numel(), default=None)
        raise UserError(
            "train.mixed_precision=fp8: no linear layer of this model is large enough to gain from float8 (the "
            f"largest is {tuple(largest) if largest is not None else 'none'}, below torchao's size rule for {recipe}): "
            "it would train in bf16; use train.mixed_precision=bf16"
        )
    config = Float8LinearConfig.from_recipe_name(recipe)
    if emulate:
        config = dataclasses.replace(config, emulate=True)
    if fsdp2 and recipe == "tensorwise":  # torchao gathers float8 with one scale per tensor only
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
        chosen.gathers_float8 = True
    names = set(chosen.converted)
    convert_to_float8_training(model, module_filter_fn=lambda module, fqn: fqn in names, config=config)
    return chosen


def precompute_scales(model: torch.nn.Module) -> None:
    """After an optimizer step under FSDP2: every float8-gathered weight's scale, from its new values, in one
    all-reduce for them all (without it each layer's gather would all-reduce its own amax). A no-op for a model
    without such weights, and without importing torchao where nothing imported it (no layer was converted)."""
    if "torchao.float8" not in sys.modules:
        return
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp  # noqa: PLC0415

    precompute_float8_dynamic_scale_for_fsdp(model)


def unwrapped(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor inside torchao's float8 weight wrapper (an FSDP2 shard's, with the float8 all-gather), which
    has no storage of its own to read (.numpy(), data_ptr()); any other tensor as it is."""
    if "torchao.float8" not in sys.modules:
        return tensor
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor  # noqa: PLC0415

    return tensor._tensor if isinstance(tensor, WeightWithDynamicFloat8CastTensor) else tensor
