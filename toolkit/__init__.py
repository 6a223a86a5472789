"""llm-toolkit: the library the recipes call (config, data, model, distributed, checkpoints, export).

Importing it names DeepSpeed's accelerator on a machine without a GPU (DS_ACCELERATOR=cpu, unless set):
Accelerate and transformers import DeepSpeed whenever it is installed, under every strategy and in
export too (`extract_model_from_parallel`), and DeepSpeed would otherwise guess and log "Setting
accelerator to CPU" in each process.

It also drops a few exact records of other libraries, so that every line of a run is the
toolkit's, a progress bar or something the user can act on (docs/training.md, "What a run prints"). Each
has no cause the toolkit or the user could fix; other records of the same loggers still show:

- torchao (which transformers imports whenever it is installed) warns once per CUDA extension of
  its own it cannot load, on any machine without the GPU it was built for;
- torch's pytree logs a deprecation for each Enum that torchao registers;
- Accelerate's checkpoint of a model whose output head is its input embedding (tie_word_embeddings)
  saves the one tensor once and says "Removed shared tensor {'lm_head.weight'} while saving ... check
  by verifying that you don't receive any warning while reloading": the load ties it again, and a
  resume is checked to give the same losses bit for bit;
- peft 0.21 reads `is_gradient_checkpointing` from the model it wraps, deprecated by transformers 5
  (in favour of `is_activation_checkpointing`): a FutureWarning on each LoRA built or loaded;
- transformers' bars while it loads or writes a model's weights ("Loading weights", "Writing model
  shards"; up to 4 a run, each a fraction of a second), once `quiet_weight_bars()` is called (the
  recipes' entry and export do; the hub's download bars stay).
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


def _tied_head_saved_once(record: logging.LogRecord) -> bool:
    return re.fullmatch(r"(\[RANK \d+\] )?Removed shared tensor \{'([\w.]+\.)?lm_head\.weight'\} while saving\..*",
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
