"""How far one AdamW step may differ between two computations that sum the same fp32 terms in other
orders (a model split over processes against the whole one), for the probes of this folder.

Adam's first update is lr * g / (|g| + eps), lr * sign(g) for any |g| >> eps = 1e-8: a gradient off
by rounding moves its weight by the same lr, unless its sign is the rounding's, which turns that
weight's step from +lr to -lr and moves the loss after the step by 2 lr |dL/dw| there. So the loss
after a step is not within fp32 rounding of the other computation's (measured: one such weight of
Qwen3's v_proj, 2.4e-7 of its row's rms, moved it 0.024 of 923 on AVX-512, 2.6e-5 rel); every other
weight steps alike.

A gradient element's rounding error is a fraction of its row's rms: u sqrt(K) for a K-term fp32 sum
in another order (u = 2^-24), K the longest reduction behind any gradient (the vocabulary here), x 2
for two computations each off the exact one, x 4 for the tails of ~10^6 elements: 8 u sqrt(K) of the
rms (measured, the tensor-parallel probe's model, K = 4096: its fp32 gradients are at most 6e-6 of
the rms, 1.6 u sqrt(K), off their float64 values). Exact zeros are structural (an absent token's
embedding row), the same in any order.
"""

from __future__ import annotations

import torch

U = 2.0**-24


def unsure(g: torch.Tensor, longest_sum: int) -> torch.Tensor:
    """The elements of gradient `g` whose sign, and so Adam's step, is within their rounding."""
    rows = g.reshape(-1, g.shape[-1]) if g.dim() > 1 else g[None]
    rms = rows.pow(2).mean(1, keepdim=True).sqrt().expand_as(rows).reshape(g.shape)
    return (g.abs() <= 8 * U * longest_sum**0.5 * rms) & (g != 0)


def after_step_bound(grads: dict, slopes: dict, lr: float, longest_sum: int) -> float:
    """The loss after the step may move by 2 lr |dL/dw| for each unsure weight (`slopes`: dL/dw after
    the step, of the loss that is compared)."""
    return 2 * lr * sum(s[unsure(grads[n], longest_sum)].abs().sum().item() for n, s in slopes.items())


def steps_apart(steps: dict, reference_steps: dict, reference_grads: dict, lr: float, longest_sum: int) -> int:
    """How many weights whose gradient's sign is sure step otherwise than in the reference (a step left
    out or doubled is lr apart)."""
    return sum((((steps[n] - s).abs() > lr / 2) & ~unsure(reference_grads[n], longest_sum)).sum().item()
               for n, s in reference_steps.items() if n in steps)
