"""A test-only fault: launched in place of a recipe, it makes one rank skip one collective.

    accelerate launch ... tests/support/desync_launch.py pretrain --config ... key=value ...

Rank 1 leaves out the per-step all-reduce of the loss (`Accelerator.reduce`) at step 2 and
trains on, as a bug that sends ranks down different paths would. The other ranks wait in that
all-reduce; the run must stop within train.collective_timeout_s with an error saying so.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from accelerate import Accelerator

ROOT = Path(__file__).resolve().parents[2]
SKIPPING_RANK, SKIPPED_CALL = 1, 2

_real_reduce = Accelerator.reduce
_calls = 0


def _reduce(self, tensor, *args, **kwargs):
    global _calls
    if sys._getframe(1).f_code.co_name != "reduce_step":  # the step's all-reduce, not the non-finite check's
        return _real_reduce(self, tensor, *args, **kwargs)
    _calls += 1
    if self.process_index == SKIPPING_RANK and _calls == SKIPPED_CALL:
        return tensor
    return _real_reduce(self, tensor, *args, **kwargs)


if __name__ == "__main__":
    Accelerator.reduce = _reduce
    recipe = sys.argv[1]
    spec = importlib.util.spec_from_file_location(f"recipe_{recipe}", ROOT / "recipes" / f"{recipe}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.exit_process(module.main(sys.argv[2:]))
