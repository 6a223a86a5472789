"""A recipe, unchanged, that also writes down its optimizer: what test_resume_elsewhere.py compares.

    accelerate launch ... tests/support/resume_probe.py pretrain|finetune --config FILE [key=value ...]

On the main process it writes to $RESUME_PROBE_OUT (torch.save) every trained parameter's fp32
master weight, the module's own copy of it, its Adam moments and step, each gathered whole with the
strategy's own getters, plus the learning rates and the step counters: right after a resume (the
state as loaded), or, in a run that did not resume, right after the checkpoint of step
$RESUME_PROBE_STEP is saved (the state that checkpoint holds). A test-only wrapper: the recipes
themselves never write this.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
MOMENTS = ("exp_avg", "exp_avg_sq")


def recipe_module(name: str):
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", ROOT / "recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _float(value) -> float:
    return float(value.item() if isinstance(value, torch.Tensor) else value)


def optimizer_state(trainer) -> dict:
    """Collective: {"moments": name -> {exp_avg, exp_avg_sq}, "steps": name -> step, "module": name ->
    the module's own copy} on the main process (empty elsewhere)."""
    acc, strategy = trainer.accelerator, trainer.strategy
    module = acc.unwrap_model(trainer.model)
    main = strategy.is_main
    moments, steps, copies = {}, {}, {}
    if strategy.layout.kind == "deepspeed":
        import deepspeed
        from deepspeed.utils import safe_get_full_optimizer_state

        engine = acc.deepspeed_engine_wrapped.engine
        inner = engine.optimizer.optimizer
        if hasattr(engine.optimizer, "_hp_optimizer_states_linked"):
            # ZeRO-1/2 (DeepSpeed 0.19.8) links each parameter to its slice of the Adam state once, right
            # after the update of the first parameter group, before the second group has any state:
            # safe_get_full_optimizer_state then fails for every parameter of the second group
            # ("exp_avg not found in optimizer state fragment"). Linked again here, with all state there.
            engine.optimizer._hp_optimizer_states_linked = False
            engine.optimizer._lazy_init_hp_params_optimizer_state()
        step = {_float(s["step"]) for s in inner.state.values()}
        for name, p in module.named_parameters():
            if p.requires_grad:
                found = {k: safe_get_full_optimizer_state(p, k) for k in MOMENTS}
                moments[name] = {k: v.detach().float().cpu().clone() for k, v in found.items()}
                steps[name] = max(step) if step else None
            with deepspeed.zero.GatheredParameters([p], enabled=hasattr(p, "ds_id")):
                copies[name] = p.detach().float().cpu().clone()
        counters = {"global_steps": engine.global_steps, "micro_steps": engine.micro_steps}
    elif strategy.layout.kind == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        full = get_optimizer_state_dict(module, trainer.optimizer.optimizer, options=StateDictOptions(full_state_dict=True))
        for name, state in full["state"].items():
            moments[name] = {k: state[k].detach().float().cpu().clone() for k in MOMENTS}
            steps[name] = _float(state["step"])
        counters = {}
    else:
        names = {id(p): n for n, p in module.named_parameters()}
        for p, state in trainer.optimizer.optimizer.state.items():
            moments[names[id(p)]] = {k: state[k].detach().float().cpu().clone() for k in MOMENTS}
            steps[names[id(p)]] = _float(state["step"])
        copies = {n: p.detach().float().cpu().clone() for n, p in module.named_parameters()}
        counters = {}
    counters["accelerate_step"] = acc.step
    return {"moments": moments, "steps": steps, "module": copies, "counters": counters} if main else {}


def dump(trainer) -> None:
    masters = trainer.strategy.master_weights(trainer.model)  # collective
    state = optimizer_state(trainer)
    if trainer.strategy.is_main:
        lrs = [g["lr"] for g in trainer.optimizer.param_groups]
        torch.save({**state, "masters": masters, "lrs": lrs, "step": trainer.step}, os.environ["RESUME_PROBE_OUT"])


def main() -> int:
    name, argv = sys.argv[1], sys.argv[2:]
    module = recipe_module(name)
    recipe_class = module.PretrainRecipe if name == "pretrain" else module.FinetuneRecipe
    config_class = module.PretrainConfig if name == "pretrain" else module.FinetuneConfig

    class Probed(recipe_class):
        def setup(self) -> None:
            super().setup()
            trainer = self.trainer
            if trainer.resumed:
                dump(trainer)
                return
            save, at = trainer.save_checkpoint, int(os.environ["RESUME_PROBE_STEP"])

            def save_and_dump(background: bool = False):
                folder = save(background)
                if trainer.step == at:
                    dump(trainer)
                return folder

            trainer.save_checkpoint = save_and_dump

    return module.run(name, config_class, Probed, argv)


if __name__ == "__main__":
    from toolkit.launch.verdict import exit_process

    exit_process(main())
