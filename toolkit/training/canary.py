"""The numerics canary (`train.canary`): every fast path a run takes, checked while it goes on against the
reference it was proven against on CPU (`LEVERS`).

At the launch's first step and every `train.canary_every` steps, before the step trains, a row of its first micro-batch
goes through the model as the run computes it and with every lever switched to its reference, on the same weights;
the summed loss and a sample of gradients are compared within the precision's `TOLERANCE`. A drift stops the run
(`Drifted`) or, with `warn`, is said. Why and how it leaves training untouched: docs/internals.md, this module.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from accelerate.utils import gather_object

from toolkit.data.packing import POSITION_ATTENTION, VARLEN_ATTENTION, attention_inputs
from toolkit.models.loss import LOSS_IN_FORWARD, TARGETS_ONLY, forward_loss_sum, unwrapped
from toolkit.training.step import Diverged, on_device, verdict

MODEL_INPUTS = ("input_ids", "position_ids", "attention_mask", "labels")  # what a row of any collated batch holds
# The relative difference two paths may show at each compute precision: ~100x what the healthy levers measure on CPU
# (fp32: 1e-7 to 1e-6, the order of the sums), a few units in the last place of bf16 (2**-8) and fp16 (2**-11), and
# e4m3's one (2**-4) for fp8's matmul inputs. Drifts are logged at every check (metrics.jsonl, kind "canary").
TOLERANCE = {"no": 1e-4, "fp16": 5e-3, "bf16": 2e-2, "fp8": 1e-1}
PRECISION = {"no": "fp32"}  # the Accelerator's names, as a line says them
SAMPLE_ELEMENTS = 1 << 20  # a trainable tensor this small is in the gradients compared (norms, biases, LoRA matrices)


class Drifted(Diverged):
    """A fast path computed past its reference's tolerance (train.canary=stop); raised on every rank at the same step,
    before that step's update (after it, for the update's own lever). The message is the run's one `error:` line."""


@dataclass
class Pass:
    """What one pass through the model is made of; a lever's reference changes it for the length of the pass."""

    model: torch.nn.Module  # the transformers model, unwrapped of DDP's and DeepSpeed's wrappers
    batch: dict[str, torch.Tensor]
    chunk_tokens: int
    weight_cast: object | None


@dataclass(frozen=True)
class Taken:
    """What the launched run decided that its config alone does not say."""

    casts_per_step: bool = False  # model.cast_weights: the copy made once per step (auto, where it applies)
    skips_on_device: bool = False  # train.step_sync: the fused AdamW skips a non-finite step on the device


@dataclass(frozen=True)
class Lever:
    setting: str  # as a user writes it; its reference is said as the override that takes it
    reference: str
    in_use: Callable[[object, Taken], bool]  # (recipe config, what the launched run took) -> whether it takes it
    # the pass made the reference's for a while; None: a lever of the update, checked after it (Canary.after)
    switch: Callable[[Pass], contextlib.AbstractContextManager] | None


@contextlib.contextmanager
def _eager(p: Pass) -> Iterator[None]:
    inner = unwrapped(p.model)
    marked = getattr(inner, LOSS_IN_FORWARD, False)
    if marked:  # compile=model's loss, computed by transformers in the compiled forward: the logits' loss instead
        setattr(inner, LOSS_IN_FORWARD, False)
    try:
        with torch.compiler.set_stance("force_eager"):
            yield
    finally:
        if marked:
            setattr(inner, LOSS_IN_FORWARD, marked)


@contextlib.contextmanager
def _masked_attention(p: Pass) -> Iterator[None]:
    inner = unwrapped(p.model)
    kind, batch = inner.config._attn_implementation, p.batch
    # sdpa reads the documents from a block-causal mask, made from the same position ids (toolkit.data.packing)
    p.batch = attention_inputs({k: batch[k] for k in ("input_ids", "position_ids", "labels")}, "sdpa")
    inner.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        inner.set_attn_implementation(kind)
        p.batch = batch


@contextlib.contextmanager
def _bf16_linears(p: Pass) -> Iterator[None]:
    layers = [m for m in p.model.modules() if type(m).__name__ == "Float8Linear"]
    for layer in layers:  # the same weights through nn.Linear's matmul, in autocast's bf16
        layer.forward = types.MethodType(torch.nn.Linear.forward, layer)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward


@contextlib.contextmanager
def _full_loss(p: Pass) -> Iterator[None]:
    chunk, p.chunk_tokens = p.chunk_tokens, 0
    try:
        yield
    finally:
        p.chunk_tokens = chunk


@contextlib.contextmanager
def _every_position(p: Pass) -> Iterator[None]:
    inner = unwrapped(p.model)
    marked = getattr(inner, TARGETS_ONLY, False)
    setattr(inner, TARGETS_ONLY, False)
    try:
        yield
    finally:
        setattr(inner, TARGETS_ONLY, marked)


@contextlib.contextmanager
def _autocast_casts(p: Pass) -> Iterator[None]:
    linears = getattr(p.weight_cast, "linears", [])
    copies = [m.step_weight for m in linears]
    for m in linears:  # autocast casts the fp32 weight at each forward
        m.step_weight = None
    try:
        yield
    finally:
        for m, copy in zip(linears, copies, strict=True):
            m.step_weight = copy


# Every fast path a run can take: a setting's value that computes what its reference computes, faster. A value of
# model.compile, model.attn_implementation, model.loss, model.loss_positions, model.cast_weights or
# train.mixed_precision that is neither
# a lever nor a reference fails tests/toolkit/training/test_canary.py until it is classified here or in REFERENCES.
LEVERS: tuple[Lever, ...] = (
    Lever("model.compile", "model.compile=none", lambda cfg, t: cfg.model.compile not in ("none", "auto"), _eager),
    Lever("model.attn_implementation", "model.attn_implementation=sdpa",
          lambda cfg, t: cfg.model.attn_implementation in POSITION_ATTENTION | VARLEN_ATTENTION, _masked_attention),
    Lever("train.mixed_precision=fp8", "train.mixed_precision=bf16",
          lambda cfg, t: cfg.train.mixed_precision == "fp8", _bf16_linears),
    Lever("model.loss=chunked", "model.loss=full", lambda cfg, t: cfg.model.loss == "chunked", _full_loss),
    Lever("model.loss_positions=targets", "model.loss_positions=all",
          lambda cfg, t: cfg.model.loss_positions == "targets", _every_position),
    # where the run really casts once per step (model.cast_weights=auto takes it where it applies)
    Lever("model.cast_weights=per_step", "model.cast_weights=per_forward", lambda cfg, t: t.casts_per_step,
          _autocast_casts),
    # the skip of a non-finite step decided on the device (auto takes it where fused AdamW steps), against the host's
    # reading of the same flags: the sampled weights moved exactly where the host says the step trained
    Lever("train.step_sync=none", "train.step_sync=host", lambda cfg, t: t.skips_on_device, None),
)
# The values that are the references (or change nothing the canary could compare), with why.
AUTO = "made a lever or a reference at the launch, before the canary reads it (toolkit.config.switches)"
REFERENCES = {
    "model.compile": {"none": "eager: the reference", "auto": AUTO},
    "model.attn_implementation": {"sdpa": "the document mask: the reference", "eager": "the scores materialised: "
                                  "a reference as sdpa is (test_attention)", "auto": AUTO},
    "model.loss": {"full": "the reference"},
    "model.loss_positions": {"all": "the reference", "auto": AUTO},
    "model.cast_weights": {"per_forward": "autocast's casts: the reference",
                           "auto": "per_step where it applies: the canary asks the run (`casts_per_step`)",
                           "per_step": "a lever where the run casts once per step (`casts_per_step`)"},
    "train.mixed_precision": {"no": "fp32", "bf16": "the reference of fp8", "fp16": "autocast's, as bf16",
                              "auto": "bf16 or fp32, as the device computes: a reference either way"},
    "train.step_sync": {"host": "the host's verdict: the reference",
                        "auto": "none where fused AdamW steps: the canary asks the run (`skips_on_device`)",
                        "none": "a lever where the run skips on the device (`skips_on_device`)"},
}


def named(lever: Lever, cfg) -> str:
    """The lever as this run sets it: `model.compile=layers`, where its setting names the key alone."""
    if "=" in lever.setting:
        return lever.setting
    section, key = lever.setting.split(".")
    return f"{lever.setting}={getattr(getattr(cfg, section), key)}"


def levers_in_use(cfg, taken: Taken) -> list[Lever]:
    """The levers this run takes."""
    return [lever for lever in LEVERS if lever.in_use(cfg, taken)]


@dataclass(frozen=True)
class Reading:
    loss: float
    grads: torch.Tensor | None  # the sample's gradients, flat, fp32 on the host; None where no backward ran

    def drift(self, other: Reading) -> tuple[float, float]:
        """(the loss's relative difference, the gradients'), against `other`, the reference."""
        loss = abs(self.loss - other.loss) / max(abs(other.loss), 1e-12)
        if self.grads is None or other.grads is None:
            return loss, 0.0
        grads = float((self.grads - other.grads).norm() / other.grads.norm().clamp_min(1e-30))
        return loss, grads

    def grad_norm(self) -> float | None:
        return None if self.grads is None else float(self.grads.norm())


def sample_of(model: torch.nn.Module) -> list[torch.Tensor]:
    """The trainable tensors whose gradients are compared: every one of at most SAMPLE_ELEMENTS (each one's gradient
    is a sum over every token of the row), else the smallest."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    small = [p for p in trainable if p.numel() <= SAMPLE_ELEMENTS]
    return small or sorted(trainable, key=torch.Tensor.numel)[:1]


def measure(p: Pass, sample: list[torch.Tensor], backward: bool) -> Reading:
    """The row's summed loss through the pass as it is now, and its sample's gradients (`backward`)."""
    device = p.batch["input_ids"].device
    # a compiled layer (or flex_attention's kernel) meets the row's shape here: compiled for it alone, static, so
    # that training's own shape keeps its graph rather than a dynamic one made for both (other kernels, other bits)
    with (torch.random.fork_rng(devices=[device] if device.type == "cuda" else []),
          torch._dynamo.config.patch(automatic_dynamic_shapes=False)):
        torch.manual_seed(0)  # dropout draws the same masks in both passes
        with torch.set_grad_enabled(backward):
            loss = forward_loss_sum(p.model, p.batch, p.chunk_tokens)
            grads = torch.autograd.grad(loss, sample, allow_unused=True) if backward else None
    if grads is not None:
        grads = torch.cat([(torch.zeros_like(t) if g is None else g).float().reshape(-1).cpu()
                           for g, t in zip(grads, sample, strict=True)])
    return Reading(float(loss.detach()), grads)


class Canary:
    """The run's canary: `before` a step checks its forward and backward where one is due, `after` its update."""

    def __init__(self, cfg, model: torch.nn.Module, weight_cast, precision: str, say: Callable[[str], None],
                 log: Callable[[dict], None], taken: Taken = Taken(), backward: bool = True):
        self.action, self.every = cfg.train.canary, cfg.train.canary_every
        self.model, self.weight_cast, self.say, self.log = model, weight_cast, say, log
        self.levers = levers_in_use(cfg, taken)
        self.passes = [lever for lever in self.levers if lever.switch is not None]
        self.names = {lever.setting: named(lever, cfg) for lever in self.levers}  # model.compile -> model.compile=layers
        self.tolerance = TOLERANCE[precision]
        self.precision, self.backward = precision, backward
        self.sample = sample_of(model)
        self.device = self.sample[0].device
        self.checked, self.before_update, self.update_due = False, None, False
        if not self.levers:
            say(f"train.canary={self.action}: this run takes no fast path to check (" + ", ".join(
                lever.reference for lever in LEVERS if lever.setting != "train.mixed_precision=fp8")
                + ", and no fp8, are the references); it checks nothing")

    @classmethod
    def of(cls, cfg, model: torch.nn.Module, weight_cast, mixed_precision: str, skips_on_device: bool,
           say: Callable[[str], None], log: Callable[..., None]) -> Canary | None:
        """The run's canary, or None with train.canary=none. `mixed_precision`: the Accelerator's (auto resolved);
        `log`: the trainer's, a row of metrics.jsonl of a kind."""
        if cfg.train.canary == "none":
            return None
        precision = "fp8" if cfg.train.mixed_precision == "fp8" else mixed_precision
        return cls(cfg, model, weight_cast, precision, say, lambda record: log("canary", record),
                   Taken(casts_per_step=weight_cast is not None, skips_on_device=skips_on_device))

    def due(self, step: int) -> bool:
        """Whether step `step` (from 1) is checked: the launch's first, then one every train.canary_every."""
        return bool(self.levers) and (not self.checked or (step - 1) % self.every == 0)

    def before(self, step: int, batches: Iterator[dict], chunk_tokens: int) -> Iterator[dict]:
        """Step `step`'s micro-batches, checked first where a check is due (its first one, `check`), and the sampled
        weights kept for `after` where the update is a lever."""
        due = self.due(step)
        if due and self.passes:
            first = next(batches)
            self.check(step, first, chunk_tokens)
            batches = itertools.chain([first], batches)
        self.checked = self.checked or due
        if len(self.passes) < len(self.levers) and (due or self.update_due):
            self.before_update = (step, [t.detach().clone() for t in self.sample])
        return batches

    def after(self, nonfinite, lr: float) -> None:
        """After a checked step's update (`nonfinite`: optimizer_step's third value, the flags left on the device):
        the sampled weights moved where the host's reading of the flags says the step trained, and only there."""
        if self.before_update is None:
            return
        (step, kept), self.before_update = self.before_update, None
        self.update_due = lr == 0  # a step at rate 0 moves nothing and tells nothing: the next one is checked
        if self.update_due:
            return
        host = verdict(nonfinite.tolist()) if isinstance(nonfinite, torch.Tensor) else nonfinite
        moved = any(not torch.equal(was, now.detach()) for was, now in zip(kept, self.sample, strict=True))
        self.log({"step": step, "levers": ["train.step_sync=none"], "loss": None, "reference_loss": None,
                  "loss_drift": None, "grad_norm": None, "reference_grad_norm": None, "grad_drift": None,
                  "tolerance": None, "drifted": None if moved == (host is None) else "train.step_sync=none",
                  "seconds": 0.0, "verdict": host, "moved": moved})
        if moved != (host is None):
            self.stop_or_say(
                f"numerics canary at step {step}: train.step_sync=none's update on the device "
                f"{'changed' if moved else 'left'} the weights where the host's reading of the same flags "
                f"{'skips' if host else 'trains'} the step ({host or 'all finite'})", "train.step_sync=host",
                "the update was applied as the device decided")

    def check(self, step: int, batch: dict[str, torch.Tensor], chunk_tokens: int) -> None:
        """Collective (one gather): every rank checks a row of its micro-batch `batch`; a drift on any rank is said
        (or raised as Drifted) on every rank alike."""
        t0 = time.perf_counter()
        # the row that holds the most documents: the one whose document mask has the most to keep apart
        i = int((batch["position_ids"] == 0).sum(dim=-1).argmax())
        row = on_device({k: v[i : i + 1] for k, v in batch.items() if k in MODEL_INPUTS}, self.device)
        p = Pass(self.model, row, chunk_tokens, self.weight_cast)
        fast = measure(p, self.sample, self.backward)
        with self.switched(p, self.passes):
            reference = measure(p, self.sample, self.backward)
        loss_drift, grad_drift = fast.drift(reference)
        lever = self.names[self.culprit(p, reference)] if self.drifted(fast, reference) else None
        record = {"step": step, "levers": [self.names[lv.setting] for lv in self.passes], "loss": fast.loss,
                  "reference_loss": reference.loss, "loss_drift": loss_drift, "grad_norm": fast.grad_norm(),
                  "reference_grad_norm": reference.grad_norm(), "grad_drift": grad_drift,
                  "tolerance": self.tolerance, "drifted": lever, "seconds": time.perf_counter() - t0}
        found = [r for r in gather_object([record]) if r["drifted"] is not None]
        self.log(record)
        if found:
            self.drift(found[0])

    @contextlib.contextmanager
    def switched(self, p: Pass, levers: list[Lever]) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for lever in levers:
                stack.enter_context(lever.switch(p))
            yield

    def drifted(self, fast: Reading, reference: Reading) -> bool:
        if not math.isfinite(fast.loss) and not math.isfinite(reference.loss):
            return False  # a non-finite loss on both paths is the run's to judge (train.on_nonfinite), not a drift
        return not all(d <= self.tolerance for d in fast.drift(reference))  # NaN: a drift

    def culprit(self, p: Pass, reference: Reading) -> str:
        """The lever that, alone in its fast form, drifts most from the reference (one pass per lever, on a drift)."""
        if len(self.passes) == 1:
            return self.passes[0].setting
        drifts = {}
        for lever in self.passes:
            with self.switched(p, [other for other in self.passes if other is not lever]):
                drifts[lever.setting] = max(measure(p, self.sample, self.backward).drift(reference))
        return max(drifts, key=drifts.get)

    def drift(self, r: dict) -> None:
        lever = next(lv for lv in self.levers if self.names[lv.setting] == r["drifted"])
        grads = "" if r["grad_norm"] is None else (
            f", the sampled gradients' norm {r['grad_norm']:.6g} against {r['reference_grad_norm']:.6g} (a relative "
            f"difference of {r['grad_drift']:.2g})")
        self.stop_or_say(
            f"numerics canary at step {r['step']}: {r['drifted']} computed a loss of {r['loss']:.6g} against its "
            f"reference's ({lever.reference}) {r['reference_loss']:.6g} (a relative difference of "
            f"{r['loss_drift']:.2g}){grads}, past {PRECISION.get(self.precision, self.precision)}'s tolerance "
            f"({r['tolerance']:g})",
            lever.reference, "the step was not applied")

    def stop_or_say(self, said: str, reference: str, applied: str) -> None:
        if self.action == "warn":
            self.say(f"warning: {said}; training goes on (train.canary=warn)")
            return
        raise Drifted(f"{said}; {applied} and the checkpoints saved so far are intact: train with {reference} and "
                      "resume=auto, and report the drift (train.canary=warn only says it)")
