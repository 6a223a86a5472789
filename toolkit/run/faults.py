"""Deterministic hard kills for the fault-tolerance harness; only tests and bench/kill_soak.py set them.

    LLM_TOOLKIT_KILL="backward@4/1,save.rank_files@6/0,final/0"   point[@step][/rank], comma separated
    LLM_TOOLKIT_KILL_LOG=/path/kills.log                          required with it

At a named point, at that step, the named rank sends itself SIGKILL: no handler, no flush, no
cleanup, as the kernel's OOM killer or a lost node would. Each kill fires once: its line is
appended to the log (and fsynced) before the signal, and a kill already in the log never fires
again, so a relaunch (or an elastic restart under `--max_restarts`) runs on past it.

The points, where the step is the optimizer step being trained (1-based) or the checkpoint's
(no step: the first time the point is reached; no rank: rank 0), and the non-finite values a step takes instead:

    LLM_TOOLKIT_NONFINITE="batch@3/1,grad@5"    kind@step[/rank]: batch (the embedding's output is NaN), loss
                                                (the loss alone), grad (the gradients alone)

A training step enters them all through one context, `planted`; unset, it costs a few environment lookups.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

ENV, LOG_ENV = "LLM_TOOLKIT_KILL", "LLM_TOOLKIT_KILL_LOG"
# The same points (those that write: save.*, final) fail a write instead: LLM_TOOLKIT_FAIL="save.rank_files@4/1=ENOSPC"
FAIL_ENV = "LLM_TOOLKIT_FAIL"
NONFINITE_ENV, NONFINITE_KINDS = "LLM_TOOLKIT_NONFINITE", ("batch", "loss", "grad")

POINTS = {
    "forward": "after the first micro-batch's forward, before its backward",
    "backward": "inside the backward, once the decoder layers' gradients are computed (a frozen embedding's, as a "
                "LoRA's: all but the first layer's)",
    "between_micro_batches": "after the first micro-batch's backward, before the second one's forward",
    "after_optimizer": "after the optimizer step, before the step counter moves",
    "eval": "inside an evaluation, after its first forward",
    "save.start": "before the strategy's save_state",
    "save.rank_files": "after this rank wrote its part of save_state, before the others finish",
    "save.background": "in a checkpoint's writes in the background (checkpoint.async_save), after one of its files",
    "save.manifest": "after the manifest, before the state file (the checkpoint is not complete)",
    "save.state_file": "after the state file, before old checkpoints are pruned",
    "prune": "between moving an old checkpoint out of rotation and deleting it",
    "final": "while final/ is written: its weights are in the temporary folder, not yet renamed",
}
__doc__ += "\n".join(f"    {name:<22} {where}" for name, where in POINTS.items()) + "\n"


def _planned(env: str = ENV) -> list[tuple[str, str, int | None, int, str]]:
    """(the item as written, point, step or None for any, rank, errno name) for each planned fault."""
    spec = os.environ.get(env, "").strip()
    if not spec:
        return []
    if not os.environ.get(LOG_ENV):
        raise RuntimeError(f"{env} is set without {LOG_ENV}: the faults would fire again after every restart")
    planned = []
    for item in spec.split(","):
        item = item.strip()
        where, _, error = item.partition("=")
        head, _, rank = where.partition("/")
        point, _, step = head.partition("@")
        if point not in POINTS:
            raise RuntimeError(f"{env}: unknown point {point!r}; the points are {', '.join(POINTS)}")
        planned.append((item, point, int(step) if step else None, int(rank or 0), error or "ENOSPC"))
    return planned


def _armed(point: str, step: int | None, env: str = ENV) -> tuple[str, str] | None:
    """(the planned item, its errno name) this rank is to fire at `point` of `step`, unless it already fired."""
    if env not in os.environ:
        return None
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    log = Path(os.environ.get(LOG_ENV, ""))
    fired = log.read_text().split() if log.is_file() else []
    for item, p, s, r, error in _planned(env):
        if p == point and r == rank and (s is None or s == step) and item not in fired:
            return item, error
    return None


def _fire(item: str) -> None:
    with open(os.environ[LOG_ENV], "a") as log:
        log.write(item + "\n")
        log.flush()
        os.fsync(log.fileno())


def armed(point: str, step: int | None = None) -> bool:
    return _armed(point, step) is not None


def kill_point(point: str, step: int | None = None) -> None:
    """Die here if a kill is planned at this point and step, for this rank, and has not fired yet."""
    found = _armed(point, step)
    if found is not None:
        _fire(found[0])
        os.kill(os.getpid(), signal.SIGKILL)


def fail_point(point: str, step: int | None, path: Path) -> None:
    """Raise the OSError a full disk (or EIO, EACCES...) gives for `path`, if one is planned here."""
    found = _armed(point, step, FAIL_ENV)
    if found is not None:
        _fire(found[0])
        code = getattr(errno, found[1])
        raise OSError(code, os.strerror(code), str(path))


def killing_batches(batches: Iterable, step: int) -> Iterator:
    """The micro-batches of one step, with the `between_micro_batches` point after the first."""
    for i, batch in enumerate(batches):
        if i == 1:
            kill_point("between_micro_batches", step)
        yield batch


@contextlib.contextmanager
def model_kill_points(model, step: int, point_forward: str = "forward"):
    """Hooks for the points inside a forward or backward of `model` (an unwrapped HF model)."""
    handles = []
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if armed(point_forward, step) and embedding is not None:
        handles.append(model.register_forward_hook(lambda *_: kill_point(point_forward, step)))
    if point_forward == "forward" and armed("backward", step) and embedding is not None:
        # The first output of a forward that needs a gradient is the last tensor the backward reaches: the
        # embedding's, or, where the embedding is frozen (an adapter), the first trained module's in the first
        # decoder layer; every other decoder layer's gradient exists, the optimizer has not stepped, and DDP's
        # buckets may be in flight. One per forward (a recomputing checkpointed layer adds none).
        first: list[torch.Tensor] = []

        def on_output(module, inputs, output):
            if not first and isinstance(output, torch.Tensor) and output.requires_grad:
                first.append(output)
                output.register_hook(lambda grad: kill_point("backward", step))

        handles.append(model.register_forward_pre_hook(lambda *_: first.clear()))
        handles += [module.register_forward_hook(on_output) for module in model.modules() if module is not model]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _nonfinite_planned(step: int) -> set[str]:
    """The kinds to inject on this rank at `step`."""
    spec = os.environ.get(NONFINITE_ENV, "").strip()
    if not spec:
        return set()
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    kinds = set()
    for item in spec.split(","):
        head, _, at_rank = item.strip().partition("/")
        kind, _, at_step = head.partition("@")
        if kind not in NONFINITE_KINDS or not at_step:
            raise RuntimeError(f"{NONFINITE_ENV}: {item.strip()!r} is not kind@step[/rank] with a kind among "
                               f"{', '.join(NONFINITE_KINDS)}")
        if int(at_step) == step and int(at_rank or 0) == rank:
            kinds.add(kind)
    return kinds


class _PoisonedLoss(torch.autograd.Function):
    """A NaN in every position's first logit (a loss already computed in the head, under
    model.loss=chunked: the loss itself), so that no ignored target can mask it; the backward
    passes on finite gradients."""

    @staticmethod
    def forward(ctx, output):
        output = output.clone()
        if output.dim() == 0:
            output.fill_(float("nan"))
        else:
            output[..., 0] = float("nan")
        return output

    @staticmethod
    def backward(ctx, grad):
        return torch.nan_to_num(grad, nan=0.0)


@contextlib.contextmanager
def injected(model, step: int):
    """Hooks putting the planned non-finite values into `model` (unwrapped) during `step` (1-based)."""
    kinds = _nonfinite_planned(step) if NONFINITE_ENV in os.environ else ()
    handles = []
    embedding = model.get_input_embeddings() if kinds else None
    if "batch" in kinds:
        handles.append(embedding.register_forward_hook(lambda module, inputs, output: output * float("nan")))
    if "grad" in kinds:
        def on_output(module, inputs, output):
            if output.requires_grad:
                output.register_hook(lambda grad: grad * float("nan"))

        handles.append(embedding.register_forward_hook(on_output))
    if "loss" in kinds:
        head = model.get_output_embeddings()
        handles.append(head.register_forward_hook(lambda module, inputs, output: _PoisonedLoss.apply(output)))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def planted(model, step: int):
    """Every fault planted in training step `step` (1-based) of `model` (unwrapped): the kills inside its forward and
    backward and between its micro-batches (the batches are passed through what this yields), its non-finite values,
    and the kill after its optimizer step, on leaving without an error."""
    with model_kill_points(model, step), injected(model, step):
        yield lambda batches: killing_batches(batches, step)
    kill_point("after_optimizer", step)
