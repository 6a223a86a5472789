"""The optimizer and learning-rate schedule every recipe trains with (toolkit.training.optim):
config checks, which parameters decay, the lr at every step of each schedule, and the prepared
optimizer + scheduler of a real single-process Strategy (registered for checkpointing)."""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.distributed.distributed_c10d as c10d
from accelerate.state import AcceleratorState, GradientState

import toolkit.strategy.collectives as collectives
import toolkit.strategy.distributed as distributed
from toolkit.config.errors import ConfigError
from toolkit.config.load import load_config
from toolkit.training.optim import OptimConfig, build_optimizer, build_scheduler, prepare_optimization

LR = 1e-3
MAX_STEPS = 20
WARMUP = 4


class Tiny(torch.nn.Module):
    """Matrices (embedding, linear weight), vectors (bias, norm gain and bias) and a frozen layer."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 8)
        self.proj = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.frozen = torch.nn.Linear(8, 8)
        self.frozen.requires_grad_(False)

    def forward(self, ids):
        return self.frozen(self.norm(self.proj(self.embed(ids))))


def _ids(params) -> set[int]:
    return {id(p) for p in params}


# ------------------------------------------------------------------ OptimConfig.validate


def test_the_defaults_are_valid():
    assert OptimConfig().validate() == []


@pytest.mark.parametrize(
    "kwargs, names",
    [
        (dict(lr=0.0), "lr=0.0"),
        (dict(lr=-1e-4), "lr=-0.0001"),
        (dict(min_lr_ratio=-0.1), "min_lr_ratio=-0.1"),
        (dict(min_lr_ratio=1.5), "min_lr_ratio=1.5"),
        (dict(warmup_steps=-1), "warmup_steps=-1"),
        (dict(betas=[0.9]), "betas=[0.9]"),
        (dict(betas=[0.9, 0.95, 0.99]), "betas=[0.9, 0.95, 0.99]"),
        (dict(betas=[0.9, 1.0]), "betas=[0.9, 1.0]"),
        (dict(betas=[-0.1, 0.9]), "betas=[-0.1, 0.9]"),
        (dict(max_grad_norm=-1.0), "max_grad_norm=-1.0"),
        (dict(lr_reference_batch=-8), "lr_reference_batch=-8"),
        (dict(lr_scaling="sqrt"), "lr_reference_batch=0"),
    ],
)
def test_each_bad_value_is_one_problem_naming_the_key_and_value(kwargs, names):
    problems = OptimConfig(**kwargs).validate()
    assert len(problems) == 1, problems
    assert problems[0].startswith(names)


@pytest.mark.parametrize(
    "kwargs", [dict(min_lr_ratio=0.0), dict(min_lr_ratio=1.0), dict(max_grad_norm=0.0), dict(betas=[0.0, 0.999])]
)
def test_the_edges_of_each_range_are_valid(kwargs):
    assert OptimConfig(**kwargs).validate() == []


def test_every_problem_is_reported_at_once():
    problems = OptimConfig(lr=0, min_lr_ratio=2, warmup_steps=-3, betas=[1.0, 1.0], max_grad_norm=-1).validate()
    assert [p.split("=")[0] for p in problems] == ["lr", "min_lr_ratio", "warmup_steps", "betas", "max_grad_norm"]


def test_a_config_file_gets_the_schedule_checked_and_numbers_coerced():
    with pytest.raises(ConfigError) as caught:
        load_config(OptimConfig, None, ["schedule=cosin", "lr=-1"])
    assert "schedule='cosin' is not one of cosine, linear, constant; did you mean cosine?" in caught.value.problems
    assert any(p.startswith("lr=-1.0 must be positive") for p in caught.value.problems)
    cfg = load_config(OptimConfig, None, ["lr=3e-4", "schedule=linear"])  # YAML reads 3e-4 as a string
    assert cfg.lr == pytest.approx(3e-4) and cfg.schedule == "linear"


# ------------------------------------------------------------------ build_optimizer


def test_matrices_decay_and_vectors_do_not():
    model = Tiny()
    opt = build_optimizer(model, OptimConfig(weight_decay=0.05))
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    assert _ids(decay["params"]) == _ids([model.embed.weight, model.proj.weight])
    assert _ids(no_decay["params"]) == _ids([model.proj.bias, model.norm.weight, model.norm.bias])


def test_frozen_parameters_are_left_out():
    model = Tiny()
    opt = build_optimizer(model, OptimConfig())
    held = _ids(p for g in opt.param_groups for p in g["params"])
    assert held == _ids(p for p in model.parameters() if p.requires_grad)
    assert not held & _ids(model.frozen.parameters())


def test_every_trainable_parameter_of_a_causal_lm_is_in_exactly_one_group(tiny_model):
    model = tiny_model("llama")
    decay, no_decay = build_optimizer(model, OptimConfig()).param_groups
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    assert all(p.ndim >= 2 for p in decay["params"]) and all(p.ndim == 1 for p in no_decay["params"])
    names = {id(p): n for n, p in model.named_parameters()}
    assert all("norm" in names[id(p)] for p in no_decay["params"])  # llama has no biases


def test_the_optimizer_class_passed_in_is_built_with_the_config():
    built = []

    class Recording(torch.optim.AdamW):
        def __init__(self, groups, **kwargs):
            built.append(kwargs)
            super().__init__(groups, **kwargs)

    cfg = OptimConfig(lr=2e-4, betas=[0.8, 0.9], eps=1e-6)
    opt = build_optimizer(Tiny(), cfg, adamw=Recording)
    assert type(opt) is Recording
    assert built == [dict(lr=2e-4, betas=(0.8, 0.9), eps=1e-6)]
    assert all(g["lr"] == 2e-4 and g["betas"] == (0.8, 0.9) for g in opt.param_groups)


def test_weight_decay_is_decoupled_and_spares_vectors():
    """One step with zero gradients: only AdamW's decay moves weights, and only the matrices."""
    model = Tiny()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = build_optimizer(model, OptimConfig(lr=0.1, weight_decay=0.5))
    for p in model.parameters():
        p.grad = torch.zeros_like(p) if p.requires_grad else None
    opt.step()
    for name, p in model.named_parameters():
        if name in ("embed.weight", "proj.weight"):
            torch.testing.assert_close(p.detach(), before[name] * (1 - 0.1 * 0.5))
        else:
            torch.testing.assert_close(p.detach(), before[name], rtol=0, atol=0)


# ------------------------------------------------------------------ build_scheduler


def _lrs(cfg: OptimConfig, max_steps: int = MAX_STEPS) -> list[float]:
    """The lr of every optimizer step 0..max_steps, stepping a real AdamW as the trainer does."""
    model = Tiny()
    opt = build_optimizer(model, cfg)
    sched = build_scheduler(opt, cfg, max_steps)
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range(max_steps):
        assert opt.param_groups[0]["lr"] == opt.param_groups[1]["lr"]  # both groups follow the schedule
        model(torch.tensor([1, 2, 3])).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    return lrs


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_warmup_rises_linearly_from_zero_to_the_peak(schedule):
    lrs = _lrs(OptimConfig(lr=LR, warmup_steps=WARMUP, schedule=schedule))
    assert lrs[: WARMUP + 1] == pytest.approx([LR * k / WARMUP for k in range(WARMUP + 1)])
    assert max(lrs) == pytest.approx(LR)


def test_cosine_decays_to_min_lr_ratio_of_the_peak():
    lrs = _lrs(OptimConfig(lr=LR, warmup_steps=WARMUP, schedule="cosine", min_lr_ratio=0.1))
    after = lrs[WARMUP:]
    assert all(a >= b for a, b in zip(after, after[1:], strict=False))
    assert lrs[-1] == pytest.approx(0.1 * LR)
    # the cosine's midpoint lies halfway between the peak and the floor
    mid = WARMUP + (MAX_STEPS - WARMUP) // 2
    assert lrs[mid] == pytest.approx(0.1 * LR + 0.9 * LR * 0.5 * (1 + math.cos(math.pi * 0.5)))


def test_linear_decays_to_zero():
    lrs = _lrs(OptimConfig(lr=LR, warmup_steps=WARMUP, schedule="linear"))
    decay = MAX_STEPS - WARMUP
    assert lrs[WARMUP:] == pytest.approx([LR * (1 - k / decay) for k in range(decay + 1)])
    assert lrs[-1] == 0.0


def test_constant_stays_at_the_peak_after_warmup():
    lrs = _lrs(OptimConfig(lr=LR, warmup_steps=WARMUP, schedule="constant", min_lr_ratio=0.1))
    assert lrs[WARMUP:] == pytest.approx([LR] * (MAX_STEPS - WARMUP + 1))


def test_without_warmup_the_first_step_trains_at_the_peak():
    assert _lrs(OptimConfig(lr=LR, warmup_steps=0, schedule="cosine"))[0] == pytest.approx(LR)


# ------------------------------------------------------------------ OptimConfig.peak_lr


@pytest.mark.parametrize(("scaling", "global_batch", "expected"), [
    ("none", 1024, 3e-4),
    ("linear", 1024, 1.2e-3), ("linear", 128, 1.5e-4), ("linear", 256, 3e-4),
    ("sqrt", 1024, 6e-4), ("sqrt", 512, 3e-4 * 2 ** 0.5), ("sqrt", 64, 1.5e-4),
])
def test_the_peak_rate_scales_with_the_global_batch_from_the_reference(scaling, global_batch, expected):
    cfg = OptimConfig(lr=3e-4, lr_scaling=scaling, lr_reference_batch=256 if scaling != "none" else 0)
    assert cfg.peak_lr(global_batch) == pytest.approx(expected, rel=1e-12)


# ------------------------------------------------------------------ prepare_optimization


@pytest.fixture(scope="module")
def strategy(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", raising=False)
        # launch sets the process-wide collective timeout (torch's defaults too): restored afterwards
        for module, name in [(c10d, "default_pg_timeout"), (c10d, "default_pg_nccl_timeout"),
                             (collectives, "_COLLECTIVE_TIMEOUT_S")]:
            mp.setattr(module, name, getattr(module, name))
        yield distributed.Strategy.launch(
            mixed_precision="no", global_batch=4, micro_batch=2, max_grad_norm=1.0,
            project_dir=str(tmp_path_factory.mktemp("run")), trackers=[], timeout_s=60,
        )
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _step(model, optimizer, scheduler) -> None:
    model(torch.tensor([1, 2, 3])).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()


def test_prepare_optimization_steps_our_scheduler_and_registers_it(strategy):
    assert strategy.layout.kind == "single" and strategy.accumulation == 2
    cfg = OptimConfig(lr=LR, warmup_steps=WARMUP, weight_decay=0.05)
    model, optimizer, scheduler, step_scheduler = prepare_optimization(strategy, Tiny(), cfg, MAX_STEPS, 4)
    assert step_scheduler is True  # no DeepSpeed engine to step it: the trainer does
    assert any(obj is scheduler for obj in strategy.accelerator._custom_objects)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.05, 0.0]
    assert optimizer.param_groups[0]["lr"] == 0.0  # warmup starts from 0
    for _ in range(WARMUP):
        _step(model, optimizer, scheduler)
    assert optimizer.optimizer.param_groups[0]["lr"] == pytest.approx(LR)  # the wrapped torch optimizer's lr


def test_the_scheduler_position_survives_save_and_load_state(strategy, tmp_path):
    cfg = OptimConfig(lr=LR, warmup_steps=WARMUP)
    model, optimizer, scheduler, _ = prepare_optimization(strategy, Tiny(), cfg, MAX_STEPS, 4)
    for _ in range(3):
        _step(model, optimizer, scheduler)
    saved_lr = optimizer.param_groups[0]["lr"]
    strategy.accelerator.save_state(str(tmp_path / "ckpt"))
    for _ in range(5):
        _step(model, optimizer, scheduler)
    assert optimizer.param_groups[0]["lr"] != pytest.approx(saved_lr)
    strategy.accelerator.load_state(str(tmp_path / "ckpt"))
    assert scheduler.last_epoch == 3
    _step(model, optimizer, scheduler)  # resumes where it stopped
    assert optimizer.param_groups[0]["lr"] == pytest.approx(LR * 4 / WARMUP)


@pytest.mark.parametrize("fused, expected", [("auto", None), ("false", None), ("true", True)])
def test_fused_adamw_is_taken_on_cuda_or_when_asked(strategy, fused, expected):
    """auto leaves CPU runs on the default (foreach) kernel, so their numbers stay exactly as they were."""
    assert strategy.accelerator.device.type == "cpu"
    _, optimizer, _, _ = prepare_optimization(strategy, Tiny(), OptimConfig(lr=LR, fused=fused), MAX_STEPS, 4)
    assert optimizer.optimizer.defaults["fused"] is expected


def test_use_fused_on_each_device():
    from toolkit.training.optim import use_fused

    assert use_fused("auto", torch.device("cuda")) and not use_fused("auto", torch.device("cpu"))
    assert use_fused("true", torch.device("cpu")) and not use_fused("false", torch.device("cuda"))


def test_the_fused_kernel_gives_the_same_update_up_to_rounding():
    torch.manual_seed(0)
    models = [torch.nn.Linear(16, 8), torch.nn.Linear(16, 8)]
    models[1].load_state_dict(models[0].state_dict())
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1)
    optimizers = [build_optimizer(models[0], cfg), build_optimizer(models[1], cfg, functools.partial(torch.optim.AdamW, fused=True))]
    x = torch.randn(4, 16)
    for _ in range(5):
        for model, optimizer in zip(models, optimizers, strict=True):
            model(x).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert optimizers[1].defaults["fused"] is True


def test_prepare_optimization_trains_at_the_scaled_peak(strategy):
    """A global batch of 4 with lr tuned at 1: linear scaling trains at 4 x lr from the first step (no
    warmup), and the schedule decays from there."""
    cfg = OptimConfig(lr=LR, schedule="constant", lr_scaling="linear", lr_reference_batch=1)
    model, optimizer, scheduler, _ = prepare_optimization(strategy, Tiny(), cfg, MAX_STEPS, 4)
    assert [g["lr"] for g in optimizer.optimizer.param_groups] == [pytest.approx(4 * LR)] * 2
    _step(model, optimizer, scheduler)
    assert scheduler.get_last_lr() == [pytest.approx(4 * LR)] * 2
