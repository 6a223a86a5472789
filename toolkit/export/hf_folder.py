"""The final model as one Hugging Face folder: safetensors, config, tokenizer, model card.

Written to a temporary sibling and renamed into place (`toolkit.run.folder.replace_folder`), so `final/` is
always either the whole previous folder, the whole new one, or absent. Its manifest.json
(toolkit.run.manifest: every file's size and CRC-32) lets export tell a damaged final/ or adapter/
(a deleted or truncated file, a flipped bit) from an intact one, as resume does for checkpoints.
Its weights are the fp32 master weights cast to one dtype (`checkpoint.final_dtype`, float32
by default) under every strategy, so that swapping DDP for ZeRO-3 never changes the artifact.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import torch
import yaml

from toolkit.models.adapter import BASE_MODEL_FILE
from toolkit.models.gguf_base import HUB_ID
from toolkit.run.faults import kill_point
from toolkit.run.folder import replace_folder
from toolkit.run.manifest import write_manifest
from toolkit.run.writes import writing
from toolkit.strategy.distributed import Strategy

# what a card of a model or an adapter says of the run that made it (its .format fields)
RUN_ROWS = """| steps | {step} |
| tokens seen | {tokens:,} |
| final held-out loss | {eval_loss} |
| final held-out perplexity | {eval_ppl} |
| strategy | {strategy} |
"""

CARD = """---
library_name: transformers
pipeline_tag: text-generation
tags: [llm-toolkit, {model_type}]
---
# {name}

A {model_type} causal language model ({params:,} parameters) {origin} with
llm-toolkit's `{recipe}` recipe.

| | |
|---|---|
""" + RUN_ROWS + """| weights | {weights} |

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("{name}")
tokenizer = AutoTokenizer.from_pretrained("{name}")
```

## Training config
```yaml
{config}```
"""


ADAPTER_CARD = """---
library_name: peft
{hub_base}pipeline_tag: text-generation
tags: [llm-toolkit, {model_type}, {adapter}]
---
# {name}

A {method} adapter of {base} ({model_type}, {params:,} parameters), trained on {origin_detail} with
llm-toolkit's `{recipe}` recipe: rank {r}, alpha {alpha}, on {targets}.

| | |
|---|---|
""" + RUN_ROWS + """| adapter weights | {dtype}, cast from the fp32 master weights |
| base, as peft loads it | {base_row} |

```python
from peft import AutoPeftModelForCausalLM
from transformers import AutoTokenizer
model = AutoPeftModelForCausalLM.from_pretrained("{name}")
tokenizer = AutoTokenizer.from_pretrained("{name}")
```

{base_note}One folder with the adapter merged into its base: `llm-toolkit export --from {name} --merge-lora
--output DIR`.
"""


def adapter_card(out_dir: Path, facts: dict, lora: dict, base_path: str | None, dtype: str) -> str:
    """adapter/README.md, in place of peft's template: what the adapter is, of which base, and how it loads. No path
    of the machine that trained it: a card is what gets published; adapter_config.json names the base's path."""
    shown = {k: f"{v:.4f}" if isinstance(v, float) else v for k, v in facts.items()}
    gguf = facts.get("gguf")
    hub = base_path if base_path and HUB_ID.match(base_path) and not Path(base_path).expanduser().exists() else None
    if hub:
        row, note = f"`{hub}` (the Hugging Face Hub)", ""
    elif base_path and gguf:
        row = f"`{Path(base_path).name}/` beside this folder: {Path(gguf).name} dequantised to float"
        note = (f"The base is the run's float copy of the GGUF {Path(gguf).name}, kept in the run folder; "
                "adapter_config.json names it by its path (the run folder moved: set its base_model_name_or_path to "
                "base/'s new path; the toolkit's commands find it beside this folder). Elsewhere, dequantise that "
                "GGUF (`model.path` of the toolkit's recipes takes it) and load the adapter onto it. ")
    elif base_path:
        row, note = f"the folder `{Path(base_path).name}` (adapter_config.json names its path)", ""
    else:
        row = "none (a GGUF base without a float copy, model.gguf_cache=false)"
        note = "peft cannot load this adapter by itself: its base was a GGUF that the run kept no float copy of. "
    return ADAPTER_CARD.format(**{"eval_loss": "n/a", "eval_ppl": "n/a", **shown}, name=out_dir,
                               hub_base=f"base_model: {hub}\n" if hub else "", base_row=row, base_note=note,
                               dtype=dtype, method=facts.get("adapter", "LoRA"), origin_detail=facts.get("data", "trained"),
                               r=lora["r"], alpha=lora["lora_alpha"], targets=", ".join(sorted(lora["target_modules"])))


def tied_copies(model) -> list[str]:
    """Keys that are tied to another weight (e.g. lm_head to the embeddings) and load from it.

    Strategies that gather weights into fresh tensors (ZeRO-1/2, FSDP) lose the shared storage
    that save_pretrained uses to spot ties, so the duplicate would be written twice.
    """
    if not getattr(model.config, "tie_word_embeddings", False):
        return []
    tied = getattr(model, "_tied_weights_keys", None) or []
    return list(tied.keys()) if isinstance(tied, dict) else list(tied)


def save_final_model(
    strategy: Strategy, model, tokenizer, out_dir: Path, card_facts: dict, train_config: dict,
    dtype: str = "float32", **written,
) -> Path | None:
    """Collective (gathers sharded weights); only the main process writes, in `dtype` (`written`: write_model_folder's
    card and writer). The other processes go on once it is done, whether or not its write failed."""
    state_dict = strategy.master_weights(model)
    if not strategy.is_main:
        strategy.accelerator.wait_for_everyone()
        return None
    try:
        write_model_folder(strategy.model_to_save(model, state_dict), tokenizer, out_dir, card_facts, train_config,
                           state_dict, dtype=dtype, **written)
    finally:
        strategy.accelerator.wait_for_everyone()
    return out_dir


def generate_with_cache(model) -> None:
    """A folder for inference generates with the KV cache: training turned it off in the config and in the
    generation config made from it (an export of a checkpoint of SmolLM2 took 2.6x as long to generate)."""
    model.config.use_cache = True
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.use_cache = True


def write_model_folder(
    model,
    tokenizer,
    out_dir: Path,
    card_facts: dict,
    train_config: dict,
    state_dict: dict | None = None,
    card: str | None = None,
    max_shard_size: str = "5GB",
    dtype: str | None = None,
    writer: str = "final model",
) -> Path:
    """One process: the model (or `state_dict` for it), tokenizer and card, renamed into place.

    `card` replaces the training card (README.md); weights above `max_shard_size` are split
    into shards with an index, as transformers does. `writer` names it in the line a failed write
    says (toolkit.run.writes.WRITERS). `dtype` casts the floating-point weights
    (and says so in config.json); None keeps them as they are."""
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with writing(writer, tmp):  # a failed write: one line (toolkit.run.writes.WRITERS), the .tmp removed
        if dtype is not None:  # a torch dtype's name (checkpoint.final_dtype)
            state_dict = {
                k: v.to(getattr(torch, dtype)) if v.is_floating_point() else v
                for k, v in (state_dict if state_dict is not None else model.state_dict()).items()
            }
        if state_dict is not None:
            for key in tied_copies(model):
                state_dict.pop(key, None)
        generate_with_cache(model)
        with undistributed(model.config):
            model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True, max_shard_size=max_shard_size)
        if dtype is not None:  # save_pretrained wrote the dtype of the live parameters (16-bit under DeepSpeed)
            model.config.dtype = dtype
            model.config.save_pretrained(tmp)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        kill_point("final")
        if card is not None:
            (tmp / "README.md").write_text(card)
            write_manifest(tmp)
            return replace_folder(tmp, out_dir)
        facts = {"name": out_dir.name, "origin": "trained from scratch", **card_facts}
        facts.setdefault(
            "weights", f"{dtype}, cast from the fp32 master weights (the same under every strategy)" if dtype else "as trained"
        )
        for key in ("eval_loss", "eval_ppl"):
            if isinstance(facts.get(key), float):
                facts[key] = f"{facts[key]:.4f}"
        facts.setdefault("eval_loss", "n/a")
        facts.setdefault("eval_ppl", "n/a")
        (tmp / "README.md").write_text(CARD.format(config=yaml.safe_dump(train_config, sort_keys=False), **facts))
        (tmp / "training_summary.json").write_text(json.dumps(card_facts, indent=2))
        write_manifest(tmp)
        return replace_folder(tmp, out_dir)


@contextlib.contextmanager
def undistributed(config):
    """`config` without the distributed_config that tensor parallel (transformers' DistributedConfig)
    sets on it, while a whole model is written: save_pretrained would otherwise gather the weights
    again, a collective on the main process alone (the run hangs), and config.json would tell
    from_pretrained to split the model again."""
    saved = getattr(config, "distributed_config", None)
    if saved is None:
        yield config
        return
    config.distributed_config = None
    try:
        yield config
    finally:
        config.distributed_config = saved


def write_model_files(model, tokenizer, folder: Path, extra: dict[str, dict] | None = None) -> Path:
    """What a checkpoint needs to become a model again: the architecture config, generation
    config and tokenizer; for a peft model the base's config plus the adapter's config.
    `extra` maps file names to JSON-able dicts (e.g. how the base model was loaded)."""
    folder.mkdir(parents=True, exist_ok=True)
    base = model.get_base_model() if hasattr(model, "peft_config") else model
    with undistributed(base.config):
        base.config.save_pretrained(folder)
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if hasattr(model, "peft_config"):
        model.peft_config["default"].save_pretrained(folder)
    for name, content in (extra or {}).items():
        (folder / name).write_text(json.dumps(content, indent=2))
    return folder


def save_adapter(
    strategy: Strategy, model, tokenizer, out_dir: Path, base_model: dict, dtype: str = "float32",
    facts: dict | None = None,
) -> Path | None:
    """Collective (gathers sharded weights); the main process writes the peft folder atomically.

    The adapter weights are the fp32 master weights cast to `dtype`, the same under every
    strategy (see Strategy.master_weights). `base_model` (how the run loaded its base, and what loads it alone:
    `loads_from`) is kept as base_model.json, so that the base can be found again for merging, even when it was a
    GGUF; its `loads_from` is what peft's `base_model_name_or_path` names, so that AutoPeftModelForCausalLM loads the
    folder (None: a GGUF without a kept float copy; the card then says to merge). `facts` (the model card's) make its
    README.md."""
    state_dict = strategy.master_weights(model)
    if not strategy.is_main:
        strategy.accelerator.wait_for_everyone()
        return None
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    # peft keeps only the adapter's entries of the full state dict; the embeddings are not
    # trained by a LoRA here, so it need not look for the base's config to decide about them
    target = getattr(torch, dtype)  # a torch dtype's name (checkpoint.final_dtype)
    state_dict = {k: v.to(target) if v.is_floating_point() else v for k, v in state_dict.items()}
    peft_model = strategy.accelerator.unwrap_model(model)
    lora = peft_model.peft_config["default"]
    named = lora.base_model_name_or_path  # where the base was loaded from: a GGUF's folder holds no config
    base_path = base_model.get("loads_from")
    lora.base_model_name_or_path = base_path or named
    with writing("final model", tmp):  # a failed write: one line, the .tmp removed
        try:
            peft_model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True, save_embedding_layers=False)
        finally:
            lora.base_model_name_or_path = named
        tokenizer.save_pretrained(tmp)
        if facts is not None:
            (tmp / "README.md").write_text(adapter_card(out_dir, facts, lora.to_dict(), base_path, dtype))
            # as final/'s: what the run trained (its last trained step read by resume=auto), no path of its machine
            (tmp / "training_summary.json").write_text(json.dumps({k: v for k, v in facts.items() if k != "gguf"}, indent=2))
        (tmp / BASE_MODEL_FILE).write_text(json.dumps(base_model, indent=2))
        write_manifest(tmp)
        replace_folder(tmp, out_dir)
    strategy.accelerator.wait_for_everyone()
    return out_dir
