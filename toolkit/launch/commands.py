"""`llm-toolkit`'s commands, each with what it does and an example (the README's), and the help that lists them.

A recipe (recipes/NAME.py) is a command once it is described here: tests/toolkit/launch/test_cli.py fails until it is.
"""

from __future__ import annotations

COMMANDS = {
    "pretrain": ("train a LLaMA/GPT-style model from scratch",
                 "llm-toolkit pretrain --num_processes 2 --config pretrain_tiny output_dir=runs/tiny"),
    "finetune": ("fine-tune a pretrained model: continued pretraining, chat SFT, DPO; LoRA, QLoRA or full",
                 "llm-toolkit finetune --config_file zero3 --num_processes 2 --config finetune_smollm2_lora "
                 "output_dir=runs/ft"),
    "export": ("write a run for inference: a Hugging Face folder, a GGUF (llama.cpp, Ollama), int8 or int4",
               "llm-toolkit export --from runs/ft --format gguf --quant q8_0 --output exports/ft-q8_0.gguf"),
    "evaluate": ("score a run, checkpoint or export on lm-evaluation-harness tasks (pip install -e '.[eval]')",
                 "llm-toolkit evaluate --from runs/ft --tasks arc_easy,hellaswag --limit 500"),
    "plan": ("which strategy, checkpointing and micro-batch fit a config on your GPUs, before a launch",
             "llm-toolkit plan --config pretrain_llama_1b --gpus 8 --gpu-memory 80GB"),
    "chat": ("talk to a run, an export or a GGUF with its own chat template",
             'llm-toolkit chat --from runs/ft --prompt "How do I reverse a list in Python?"'),
}


def help_text() -> str:
    width = max(map(len, COMMANDS))
    rows = [f"  {name:<{width}}  {what}\n  {'':<{width}}  {example}" for name, (what, example) in COMMANDS.items()]
    return "\n".join([
        "usage: llm-toolkit COMMAND [options]   the toolkit's recipes, from any folder; shipped configs by name",
        "",
        "commands:",
        *rows,
        "",
        "llm-toolkit COMMAND --help: that command's own options (pretrain and finetune: every key of their config,",
        "with its type and default). accelerate launch's options (--num_processes 2, --config_file zero3) go anywhere",
        "on a pretrain or finetune line. More: README.md.",
    ])
