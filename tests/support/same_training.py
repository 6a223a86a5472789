"""How far two fp32 runs of the same AdamW training may end apart when they sum the same terms in
another order (another strategy's all-reduce, another process count); see docs/parallelism.md,
"How the tolerances are set".

Adam's step on a coordinate is at most lr (Kingma & Ba 2.1, as 1 - beta1 <= sqrt(1 - beta2): 0.1 <=
0.22 here) and about lr * sign(g): a coordinate whose gradient's sign was within its rounding (|g| <=
8 u sqrt(K) of its tensor's rms, tests/support/adam_step.py) may step the other way, and
then stays up to 2 * sum(lr) apart; no coordinate can be further. Near zero a gradient's density is
~sqrt(2/pi) / rms, so each step about n * 8 u sqrt(K) of a tensor's n coordinates are such; with 4
more for the tail of that count, a tensor is at most 2 * sum(lr) * sqrt(k) apart. A broken strategy
moves every coordinate by ~lr instead: lr * sqrt(n).

The loss curves (rel 1e-4, the recipe tests' parity tolerance): a step's mean loss over V = 512
logits is off by u sqrt(V) = 1.4e-6 of itself; each flipped coordinate moves the losses after it by
2 lr |dL/dw|, |dL/dw| ~ the rms gradient, grad_norm / sqrt(N). TINY (N = 1.07e5 weights, 6 steps,
sum(lr) = 9.5e-3, grad_norm <= 1.4, loss ~6) expects 5 steps x N x 8 u sqrt(V) x 0.8 = 4.6 such
coordinates: 2 x 9.5e-3 x 4.6 x 1.4 / 327 / 6 = 6e-5 of the loss, within 1e-4. Measured: DDP's
curve equals one process's to the bit, its weights within 1.2e-7.
"""

from __future__ import annotations

from toolkit.training.metrics import read_metrics

U = 2.0**-24


def lr_sum(out) -> float:
    """The sum of the rates a run's steps trained with (metrics.jsonl logs each step's)."""
    return sum(r["lr"] for r in read_metrics(out / "metrics.jsonl") if "lr" in r)


def assert_same_weights(got: dict, ref: dict, lr_total: float, steps: int, longest_sum: int, what=()) -> None:
    """`got` and `ref` (name -> fp32 tensor) within what the steps' rounding allows; `longest_sum` is
    the longest reduction behind a gradient (the vocabulary)."""
    assert got.keys() == ref.keys()
    for name, b in ref.items():
        diff = (got[name] - b).float()
        flips = 4 + steps * b.numel() * 8 * U * longest_sum**0.5
        assert diff.abs().max() <= 2 * lr_total, (*what, name, diff.abs().max().item())
        assert diff.norm() <= 2 * lr_total * flips**0.5, (*what, name, diff.norm().item())
