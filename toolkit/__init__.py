"""llm-toolkit: the library the recipes call (config, data, model, distributed, checkpoints, export).

Importing it sets DS_ACCELERATOR=cpu on a machine without a GPU (unless set), and drops a few exact records of
other libraries that neither the toolkit nor the user could act on: torchao's CUDA extensions it cannot load,
torch's pytree deprecations for torchao's Enums, Accelerate's "Removed shared tensor" for a tied head, peft's
`is_gradient_checkpointing` FutureWarning; `quiet_weight_bars()` hides transformers' bars while weights load or
are written. Other records of the same loggers still show.
Why each: docs/internals.md, toolkit/__init__.py.
"""

import logging
import os
import re
import warnings

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _torchao_extension(record: logging.LogRecord) -> bool:
    return str(record.msg).startswith("Failed to load ") and "/torchao/_C" in str(record.msg)


def _torchao_enum(record: logging.LogRecord) -> bool:
    return str(record.msg).startswith("%s is an Enum subclass and is now natively supported by torch.compile") and any(
        getattr(arg, "__module__", "").startswith("torchao") for arg in record.args or ()
    )


# the head's weight itself, or the one peft keeps of it under a LoRA (base_layer) or a trained copy (original_module),
# or under model.new_tokens' trainable tokens (token_adapter: its base weight and the new rows' delta, which peft ties
# to the embedding's): the same tensors as the embedding's, which the load ties again
_TIED_HEAD = (r"'([\w.]+\.)?lm_head\.(base_layer\.weight|original_module\.weight|weight|token_adapter\.base_layer\.weight|"
              r"token_adapter\.trainable_tokens_delta\.\w+)'")


def _tied_head_saved_once(record: logging.LogRecord) -> bool:
    return re.fullmatch(rf"(\[RANK \d+\] )?Removed shared tensor \{{{_TIED_HEAD}(, {_TIED_HEAD})*\}} while saving\..*",
                        str(record.msg)) is not None


logging.getLogger("accelerate.utils.other").addFilter(lambda record: not _tied_head_saved_once(record))
logging.getLogger("torchao").addFilter(lambda record: not _torchao_extension(record))
logging.getLogger("torch.utils._pytree").addFilter(lambda record: not _torchao_enum(record))
warnings.filterwarnings(
    "ignore", message=r"`is_gradient_checkpointing` is deprecated and will be removed in v6", category=FutureWarning
)


WEIGHT_BARS = ("Loading weights", "Writing model shards")


def quiet_weight_bars() -> None:
    """transformers' WEIGHT_BARS off, its other bars (and the hub's) as they were."""
    from transformers.utils import logging as hf_logging

    def hook(factory, args, kwargs):
        return (hf_logging.EmptyTqdm if kwargs.get("desc") in WEIGHT_BARS else factory)(*args, **kwargs)

    hf_logging.set_tqdm_hook(hook)
