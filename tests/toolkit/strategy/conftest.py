"""The one-process Strategy the tests of toolkit.strategy and its families share, and real one-process checkpoints."""

from __future__ import annotations

import pytest
from one_process_checkpoints import fresh_accelerate, one_process_checkpoint, strategy  # noqa: F401 (fixtures)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """`Strategy.launch` as a recipe calls it, in this one CPU process (no launcher environment)."""
    from accelerate.state import AcceleratorState, GradientState

    from toolkit.strategy.distributed import Strategy

    with pytest.MonkeyPatch.context() as mp:
        for name in ("WORLD_SIZE", "RANK", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP",
                     "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"):
            mp.delenv(name, raising=False)
        # launch sets the process-wide collective timeout (torch's defaults too): restored afterwards
        import torch.distributed.distributed_c10d as c10d

        import toolkit.strategy.collectives as collectives

        for module, name in [(c10d, "default_pg_timeout"), (c10d, "default_pg_nccl_timeout"),
                             (collectives, "_COLLECTIVE_TIMEOUT_S")]:
            mp.setattr(module, name, getattr(module, name))
        yield Strategy.launch(
            mixed_precision="no", global_batch=4, micro_batch=2, max_grad_norm=1.0,
            project_dir=str(tmp_path_factory.mktemp("run")), trackers=[], timeout_s=60,
        )
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
