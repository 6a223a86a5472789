"""What an export costs in quality and buys in size and speed, measured on this machine.

Perplexity is measured on held-out text the same way for the source and the export, so the
difference is the export's doing: by default the validation documents of the embedded CPython
docs (the held-out split of the default pretraining corpus), cut into blocks.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from toolkit.export.destination import REPORT_FIRST_LINE
from toolkit.models.loss import token_loss_sum

EVAL_TOKENS = 2048  # held-out tokens per perplexity measurement
EVAL_BLOCK = 256
PROMPT = "The for statement"


def held_out_ids(tokenizer, text: str | None = None, n_tokens: int = EVAL_TOKENS) -> torch.Tensor:
    """(blocks, EVAL_BLOCK) token ids of held-out text."""
    if text is None:
        from toolkit.data.corpus import DataConfig, load_corpus, split_documents

        cfg = DataConfig()
        corpus, _ = load_corpus(cfg)
        _, val = split_documents(corpus, cfg.val_fraction, 1234)
        text = "\n\n".join(val["text"])
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:n_tokens]
    usable = len(ids) // EVAL_BLOCK * EVAL_BLOCK
    if usable == 0:
        raise ValueError(f"the held-out text has {len(ids)} tokens; it needs at least {EVAL_BLOCK}")
    return torch.tensor(ids[:usable]).view(-1, EVAL_BLOCK)


@torch.no_grad()
def perplexity(model, blocks: torch.Tensor, batch: int = 4) -> float:
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for start in range(0, blocks.shape[0], batch):
        ids = blocks[start : start + batch].to(device)
        total += token_loss_sum(model(input_ids=ids).logits, ids).item()
        count += ids.numel() - ids.shape[0]
    return math.exp(total / count)


@torch.no_grad()
def tokens_per_second(model, tokenizer, new_tokens: int = 32) -> float:
    """Greedy generation speed, one sequence, after one warm-up call."""
    model.eval()
    device = next(model.parameters()).device
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"].to(device)
    kwargs = {"do_sample": False, "pad_token_id": tokenizer.pad_token_id or tokenizer.eos_token_id}
    model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kwargs)
    start = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
    return (out.shape[1] - ids.shape[1]) / (time.perf_counter() - start)


def size_on_disk(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@dataclass
class ExportReport:
    output: Path
    fmt: str
    source: str
    size_bytes: int
    source_ppl: float
    export_ppl: float
    tokens_per_s: float
    notes: list[str]
    text: str = "the CPython docs' held-out documents"  # what the perplexities were measured on
    trained_ppl: float | None = None  # the run's own held-out perplexity at its last evaluation, if it had one
    stops: str = ""  # toolkit.export.stops' section: the export stops where the source stops

    def speed_by(self) -> str:
        """What generated: a GGUF is measured through transformers, on its weights dequantised."""
        runner = "transformers on the GGUF's weights, dequantised" if self.fmt.startswith("gguf") else "transformers"
        return f"{runner}, {'GPU' if torch.cuda.is_available() else 'CPU'}"

    @property
    def ppl_change(self) -> float:
        return self.export_ppl / self.source_ppl - 1

    def markdown(self) -> str:
        lines = [
            f"{REPORT_FIRST_LINE}{self.output.name}",
            "",
            "| | |",
            "|---|---|",
            f"| format | {self.fmt} |",
            f"| source | {self.source} |",
            f"| size on disk | {self.size_bytes / 1e6:.2f} MB |",
            f"| perplexity on {self.text}: the source, fp32 | {self.source_ppl:.4f} |",
            f"| perplexity on {self.text}: the export | {self.export_ppl:.4f} |",
            f"| change | {self.ppl_change:+.3%} |",
            *([f"| held-out perplexity at training time (the run's own held-out blocks) | {self.trained_ppl:.4f} |"]
              if self.trained_ppl is not None else []),
            f"| generation speed here ({self.speed_by()}) | {self.tokens_per_s:.1f} tokens/s |",
            "",
            f"Perplexity on the first {EVAL_TOKENS} tokens of {self.text}, in blocks of {EVAL_BLOCK}: the source and "
            "the export on the same tokens"
            + (", which are not the run's own held-out blocks (another text, another count)" if self.trained_ppl
               is not None else "") + "; speed: greedy, one sequence, this machine.",
        ]
        if self.stops:
            lines += ["", self.stops.rstrip("\n")]
        if self.notes:
            lines += ["", "## Notes", "", *[f"- {n}" for n in self.notes]]
        return "\n".join(lines) + "\n"
