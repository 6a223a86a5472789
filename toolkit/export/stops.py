"""Whether an export stops where its source stops: the export report's check.

On the run's sample prompts, greedy generation of at most NEW_TOKENS tokens from the source and from the export as
written (a GGUF read by llama.cpp where llama-cpp-python is installed, else by transformers' GGUF loader) is
compared token by token up to the stop (toolkit.data.template_check.stop_ids). A quantised export may differ: that is
reported. What would make a deployment stop elsewhere is refused, nothing put in place: a GGUF without final/'s
template or EOS/EOT ids, a Modelfile whose TEMPLATE renders another prompt or that lacks a stop (docs/export.md).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from toolkit.data.chat import own_template
from toolkit.data.template_check import stop_ids
from toolkit.export.modelfile import fill, read_modelfile, render, stop_strings, turn_shape

NEW_TOKENS = 32  # per prompt and model: enough to reach a short answer's stop, seconds on a CPU
DEFAULT_PROMPTS = ["What is the capital of France?", "Write one sentence about the sea."]
TRAINING_CONFIG = "## Training config\n```yaml\n"  # where final/'s card holds the run's config (toolkit.export.hf_folder)


def run_prompts(source_path: Path, run_dir: Path | None = None) -> tuple[list[str], str, bool]:
    """(prompts, where they come from, whether they are chat turns): the run's samples.prompts, read from its final/
    card, chat turns where it trained on chat or preference data and text to go on from otherwise, as its samples.md
    was made; else DEFAULT_PROMPTS, as chat turns."""
    folders = [source_path, run_dir and run_dir / "final", source_path.parent / "final"]
    for folder in [f for f in folders if f is not None]:
        card = folder / "README.md"
        try:
            text = card.read_text(encoding="utf-8")
            config = yaml.safe_load(text.split(TRAINING_CONFIG, 1)[1].split("```", 1)[0]) if TRAINING_CONFIG in text else None
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            continue
        if not isinstance(config, dict):
            continue
        prompts = (config.get("samples") or {}).get("prompts")
        if isinstance(prompts, list) and prompts and all(isinstance(p, str) and p.strip() for p in prompts):
            chat = (config.get("data") or {}).get("format") in ("chat", "preference")
            return prompts, f"samples.prompts of the run ({card}){'' if chat else ', as text to go on from'}", chat
    return DEFAULT_PROMPTS, "default prompts (no run config with samples.prompts found)", True


def gguf_runtime() -> str | None:
    """llama-cpp-python's name where it is importable, else None (the GGUF is then read by transformers)."""
    return "llama.cpp (llama-cpp-python)" if importlib.util.find_spec("llama_cpp") else None


@dataclass
class StopCheck:
    prompts_from: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # what makes the export stop elsewhere: the export fails
    notes: list[str] = field(default_factory=list)

    def markdown(self) -> str:
        lines = ["## Stops", "", f"Greedy, at most {NEW_TOKENS} new tokens, on the {self.prompts_from}; each model "
                 "against the source, token by token up to the stop.", "",
                 "| prompt | " + " | ".join(self.columns) + " |", "|---" * (len(self.columns) + 1) + "|"]
        lines += ["| " + " | ".join(cell.replace("|", "\\|").replace("\n", "\\n") for cell in row) + " |"
                  for row in self.rows]
        lines += ["", *[f"- {n}" for n in self.notes]] if self.notes else []
        lines += ["", *[f"- FAILED: {p}" for p in self.problems]] if self.problems else []
        return "\n".join(lines) + "\n"


def prompt_ids(tokenizer, prompt: str, template: str | None) -> list[int]:
    """The ids generation starts from, as samples.md's are made: the prompt as a user turn where there is a template."""
    if template is None:
        return tokenizer(prompt).input_ids
    text = render(tokenizer, template, [{"role": "user", "content": prompt}], True)
    return tokenizer(text, add_special_tokens=False).input_ids


@torch.no_grad()
def greedy(model, ids: list[int], stops: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    """transformers' greedy generation, the new ids up to and with the first stop."""
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=stops or None,
                              pad_token_id=stops[0] if stops else 0)
    out = model.generate(input_ids=torch.tensor([ids], device=device), attention_mask=torch.ones(1, len(ids), device=device,
                         dtype=torch.long), generation_config=config)[0, len(ids):].tolist()
    return _up_to_stop(out, stops)


def greedy_llama_cpp(gguf_file: Path, prompts: list[list[int]], stops: list[int], new_tokens: int = NEW_TOKENS):
    """llama.cpp's greedy generation (top-k 1, no repeat penalty) of each prompt's ids, up to and with a stop."""
    import llama_cpp

    llm = llama_cpp.Llama(str(gguf_file), n_ctx=max(len(p) for p in prompts) + new_tokens + 8, verbose=False)
    outputs = []
    for ids in prompts:
        out = []
        for token in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(token)
            if token in stops or len(out) >= new_tokens:
                break
        outputs.append(out)
    llm.close()
    return outputs


def _up_to_stop(ids: list[int], stops: list[int]) -> list[int]:
    cut = next((i for i, t in enumerate(ids) if t in stops), None)
    return ids if cut is None else ids[: cut + 1]


def describe(tokenizer, ids: list[int], stops: list[int]) -> str:
    if ids and ids[-1] in stops:
        return f"{len(ids)} tokens up to {tokenizer.convert_ids_to_tokens(ids[-1])}"
    return f"{len(ids)} tokens, no stop within {NEW_TOKENS}"


SAME = "same tokens up to the same stop"


def compare(tokenizer, source: list[int], other: list[int], stops: list[int]) -> str:
    """SAME, or the same tokens where neither stopped (which proves nothing of the stop), or where they first differ."""
    if source == other:
        return SAME if source and source[-1] in stops else f"same {len(source)} tokens, neither stopped within {NEW_TOKENS}"
    i = next((i for i, (a, b) in enumerate(zip(source, other, strict=False)) if a != b), min(len(source), len(other)))
    token = lambda ids: repr(tokenizer.decode([ids[i]])) if i < len(ids) else "(ended)"  # noqa: E731
    return f"differs at token {i}: {token(source)} vs {token(other)}"


def gguf_problems(gguf_file: Path, tokenizer) -> list[str]:
    """What the GGUF's metadata lacks of final/'s: the chat template, the EOS id, the end-of-turn id."""
    from toolkit.export.gguf import end_of_turn_id
    from toolkit.models.gguf_base import read_gguf

    reader = read_gguf(gguf_file)
    value = lambda key: reader.fields[key].contents() if key in reader.fields else None  # noqa: E731
    problems = []
    template = own_template(tokenizer)
    if value("tokenizer.chat_template") != template:
        problems.append(f"{gguf_file.name}: tokenizer.chat_template is not the chat template of the source's tokenizer")
    for key, expected in (("eos", tokenizer.eos_token_id), ("eot", end_of_turn_id(tokenizer))):
        if expected is not None and value(f"tokenizer.ggml.{key}_token_id") != expected:
            problems.append(f"{gguf_file.name}: tokenizer.ggml.{key}_token_id is {value(f'tokenizer.ggml.{key}_token_id')}, "
                            f"not {expected} ({tokenizer.convert_ids_to_tokens(expected)}) as in the source")
    return problems


def modelfile_cells(modelfile: Path, tokenizer, prompts: list[str]) -> tuple[list[str], list[str], list[str]]:
    """(one cell per prompt, problems, notes): the Modelfile's TEMPLATE filled for each prompt against the Jinja
    render, and its stops against the stops final/ needs."""
    template = own_template(tokenizer)
    shape = turn_shape(tokenizer, template) if template else None
    written = read_modelfile(modelfile)
    missing = [s for s in stop_strings(tokenizer, shape) if s not in written["stops"]]
    problems = [f"{modelfile.name} lacks PARAMETER stop \"{s}\", where the source stops" for s in missing]
    notes = []
    if template is not None and written["template"] is None:
        notes.append(f"{modelfile.name} has no TEMPLATE ({shape.note or 'none written'}): Ollama renders the GGUF's "
                     "tokenizer.chat_template itself, which this check cannot run")
    cells = []
    for prompt in prompts:
        if template is None or written["template"] is None:
            cells.append("no template; " + ("stops missing" if missing else "stops as the source's"))
            continue
        expected = render(tokenizer, template, [{"role": "user", "content": prompt}], True, shape.bos)
        got = fill(written["template"], written["system"], prompt)
        if got != expected:
            i = next((i for i, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b), min(len(expected), len(got)))
            problems.append(f"{modelfile.name}: TEMPLATE renders {got[i:i + 20]!r} where the chat template renders "
                            f"{expected[i:i + 20]!r} (character {i} of the prompt {prompt!r})")
        cells.append(("same prompt text" if got == expected else f"prompt differs at character {i}")
                     + ("; stops missing" if missing else "; stops as the source's"))
    return cells, problems, notes


@dataclass
class Reference:
    """The source's side: its prompts' ids, its stop ids and its greedy tokens (taken before an export casts it)."""

    tokenizer: object
    prompts: list[str]
    prompts_from: str
    ids: list[list[int]]
    stops: list[int]
    tokens: list[list[int]]


def source_reference(model, tokenizer, prompts: list[str], prompts_from: str, chat: bool = True) -> Reference:
    template = own_template(tokenizer)
    stops = stop_ids(tokenizer, template)
    ids = [prompt_ids(tokenizer, p, template if chat else None) for p in prompts]
    return Reference(tokenizer, prompts, prompts_from, ids, stops, [greedy(model, i, stops) for i in ids])


def check_stops(ref: Reference, exported, label: str, gguf_file: Path | None = None, modelfile: Path | None = None,
                lossy: bool = False) -> StopCheck:
    """The source's tokens against `exported`'s (a transformers model; a GGUF is run by llama.cpp where it is
    installed), the GGUF's metadata and the Modelfile."""
    tokenizer, stops = ref.tokenizer, ref.stops
    runtime = gguf_runtime() if gguf_file is not None else None
    columns = ["the source", f"{label}, {runtime or 'transformers'}"] + (["Modelfile"] if modelfile else [])
    check = StopCheck(ref.prompts_from, columns)
    others = greedy_llama_cpp(gguf_file, ref.ids, stops) if runtime else [greedy(exported, i, stops) for i in ref.ids]
    cells = [[] for _ in ref.prompts]
    if modelfile is not None:
        cells, check.problems, check.notes = modelfile_cells(modelfile, tokenizer, ref.prompts)
        cells = [[c] for c in cells]
    if gguf_file is not None:
        check.problems = gguf_problems(gguf_file, tokenizer) + check.problems
        if runtime is None:
            check.notes.append("llama-cpp-python is not installed here: the GGUF was read by transformers' GGUF "
                               "loader (dequantised), not by llama.cpp; pip install llama-cpp-python for the real runtime")
    for prompt, mine, theirs, extra in zip(ref.prompts, ref.tokens, others, cells, strict=True):
        check.rows.append([prompt, describe(tokenizer, mine, stops), compare(tokenizer, mine, theirs, stops), *extra])
    if lossy and any(s != o for s, o in zip(ref.tokens, others, strict=True)):
        check.notes.append(f"{label} is quantised: greedy tokens may part from the source's where two were close")
    return check
