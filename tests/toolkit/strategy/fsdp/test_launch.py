"""FSDP2's launch (toolkit.strategy.fsdp.launch): its gradients reduced in fp32, and FSDP itself on a CPU machine."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("precision, param_dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_fsdp2_reduces_gradients_in_fp32_under_mixed_precision(precision, param_dtype):
    """What Accelerate sets for FSDP2 under bf16 on a GPU (params and reduction in bf16), then ours."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    from toolkit.strategy.fsdp.launch import reduce_gradients_in_fp32

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    plugin.set_mixed_precision(precision)
    assert plugin.mixed_precision_policy.reduce_dtype == param_dtype  # Accelerate's own choice
    reduce_gradients_in_fp32(plugin)
    policy = plugin.mixed_precision_policy
    assert (policy.param_dtype, policy.reduce_dtype, policy.output_dtype) == (param_dtype, torch.float32, param_dtype)
    plain = FullyShardedDataParallelPlugin(fsdp_version=2)  # fp32: no policy, nothing to change
    reduce_gradients_in_fp32(plain)
    assert plain.mixed_precision_policy is None


def test_a_launch_under_fsdp_shards_on_a_cpu_machine_too(monkeypatch):
    """Accelerate applies FSDP on a GPU only; under a launcher (MASTER_ADDR) the family sets its plugin on CPU."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    from toolkit.strategy.fsdp.family import FAMILY

    monkeypatch.delenv("MASTER_ADDR", raising=False)
    assert FAMILY.accelerator_kwargs(False, None) == {"cpu": True}  # one plain process: no process group
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert set(FAMILY.accelerator_kwargs(False, None)) == {"cpu", "kwargs_handlers"}
    AcceleratorState._reset_state(True)
    accelerator = Accelerator(cpu=True)
    try:
        FAMILY.configure_accelerator(accelerator, multi=False)
        assert accelerator.distributed_type == DistributedType.FSDP and accelerator.state.fsdp_plugin is not None
    finally:
        AcceleratorState._reset_state(True)
