"""llm-toolkit: the library the recipes call (config, data, model, distributed, checkpoints, export).

Importing it quiets two loggers of other libraries, so that a recipe's one-line error is the first
thing a user reads: torchao (imported by peft, which transformers imports) warns once per
CUDA-only extension it cannot load on a CPU machine, and torch's pytree logs a deprecation for
each Enum torchao registers. Neither says anything about the user's run.
"""

import logging

for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)
