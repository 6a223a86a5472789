"""A mixture-of-experts model's router load-balancing loss, for the objective and the metrics.

The router logits are recorded with forward hooks on the model's own router modules and passed to its own
`load_balancing_loss_func` without a mask (transformers' computation fails on packing's 4-D mask). The
objective is the global per-token cross-entropy plus `router_aux_loss_coef` x the micro-batches' mean router loss.
Why, and why it is the same under any layout: docs/internals.md, toolkit/models/router.py.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from toolkit.config.errors import UserError


def expert_count(config) -> int:
    """Experts per MoE layer in a transformers config (Qwen-MoE's num_experts, Mixtral's
    num_local_experts); 0 for a dense model."""
    return getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0


class RouterLoss:
    """Records every router's logits in the forward passes of `model` between `start` and `loss`
    (not in evaluation, generation or a backward's recomputation: nothing piles up there).

    The hooks are registered once, for the model's lifetime (`close` removes them): registering them
    per forward would change the hooks of compiled layers at every step (model.compile=layers) and
    make torch.compile recompile them."""

    def __init__(self, model: torch.nn.Module, coef: float, router: type[torch.nn.Module], index: int,
                 loss_fn: Callable, num_experts: int, top_k: int):
        self.coef, self.router, self.index = coef, router, index
        self.loss_fn, self.num_experts, self.top_k = loss_fn, num_experts, top_k
        self._logits: list[torch.Tensor] = []
        self._recording = False
        self._handles = [m.register_forward_hook(self._keep) for m in model.modules() if isinstance(m, router)]

    @classmethod
    def of(cls, model: torch.nn.Module) -> RouterLoss | None:
        """The router loss of `model` (before any strategy wraps it: the wrappers keep its modules),
        or None for a model without routers."""
        config = getattr(model, "config", None)
        if config is None or not hasattr(config, "output_router_logits"):
            return None
        recorder = next((spec for m in model.modules()
                         if (spec := (getattr(type(m), "_can_record_outputs", None) or {}).get("router_logits"))), None)
        # the model's own modeling module holds it (not a wrapper's, e.g. peft's PeftModel)
        loss_fn = next((fn for m in model.modules()
                        if (fn := getattr(sys.modules.get(type(m).__module__), "load_balancing_loss_func", None))), None)
        num_experts = expert_count(config)
        top_k = getattr(config, "num_experts_per_tok", None)
        router = getattr(recorder, "target_class", recorder)
        if not isinstance(router, type) or loss_fn is None or not num_experts or not top_k:
            raise UserError(
                f"model_type={config.model_type} has routers, but transformers gives no router load-balancing loss "
                "the toolkit can read for it (a router output recorder, load_balancing_loss_func, num_experts and "
                "num_experts_per_tok); train a Qwen2-MoE, Qwen3-MoE or Mixtral model"
            )
        return cls(model, float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0), router,
                   getattr(recorder, "index", 0), loss_fn, int(num_experts), int(top_k))

    def _keep(self, _module, _args, output) -> None:
        if self._recording:
            self._logits.append(output[self.index] if isinstance(output, (tuple, list)) else output)

    def start(self) -> None:
        """Record the routers of the forward that follows."""
        self._logits, self._recording = [], True

    def loss(self) -> torch.Tensor:
        """The load-balancing loss of the forward since `start` (unweighted, fp32)."""
        logits, self._logits, self._recording = tuple(self._logits), [], False
        if not logits:
            raise RuntimeError(f"no {self.router.__name__} ran in the forward: the router logits were not recorded")
        return torch.as_tensor(self.loss_fn(logits, self.num_experts, self.top_k, None)).float()

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
