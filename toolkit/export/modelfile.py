"""A chat template's shape, read by rendering it, and the Ollama Modelfile made from it for any template.

The Jinja template is rendered with sentinel strings for the system prompt, the user prompt and the answer
(with and without a system message, with and without the generation prompt); what surrounds the sentinels
is the Go TEMPLATE Ollama fills with `.System`, `.Prompt` and `.Response`, so that `fill` (plain
substitution) gives back the text the Jinja template renders, and toolkit.export.stops can check it does.
The end-of-turn text (what follows an answer) and the EOS are the Modelfile's stop parameters.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import jinja2

from toolkit.config.errors import UserError, first_line
from toolkit.data.chat import own_template
from toolkit.export.destination import MODELFILE_FIRST_LINE, modelfile_path

SYSTEM, PROMPT, ANSWER, PROMPT2 = "Sys7qZx", "Prm7qZx", "Ans7qZx", "Nxt7qZx"  # text no template alters
_BRANCH = re.compile(r"\{\{ if \.(System|Prompt) \}\}(.*?)(?:\{\{ else \}\}(.*?))?\{\{ end \}\}", re.S)


@dataclass
class TurnShape:
    """What rendering a template showed: its Go form (None where it has none), built-in system prompt,
    end-of-turn text, and the BOS text left to the runtime (which adds it, as the tokenizer does)."""

    go_template: str | None
    default_system: str = ""
    end_of_turn: str | None = None
    bos: str = ""
    note: str = ""


def render(tokenizer, template: str, messages: list[dict], generation_prompt: bool, bos: str = "") -> str | None:
    """The template's text for `messages`, less a leading `bos`; None where the template refuses them."""
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                             chat_template=template)
    except (jinja2.TemplateError, ValueError, TypeError, KeyError, IndexError):
        return None
    return text[len(bos):] if bos and text.startswith(bos) else text


def adds_bos(tokenizer) -> bool:
    bos = tokenizer.bos_token_id
    return bos is not None and tokenizer("a").input_ids[:1] == [bos] != tokenizer("a", add_special_tokens=False).input_ids[:1]


def turn_shape(tokenizer, template: str) -> TurnShape:
    bos = tokenizer.bos_token if adds_bos(tokenizer) else ""
    user, answer = {"role": "user", "content": PROMPT}, {"role": "assistant", "content": ANSWER}
    gen = render(tokenizer, template, [user], True, bos)
    full = render(tokenizer, template, [user, answer], False, bos)
    after = full.rsplit(ANSWER, 1)[1] if full and full.count(ANSWER) == 1 else None
    eot = _end_of_turn(tokenizer, after)
    if gen is None or gen.count(PROMPT) != 1:
        return TurnShape(None, end_of_turn=eot, bos=bos, note="the template does not render one user turn")
    head, tail = gen.split(PROMPT)
    alone = render(tokenizer, template, [user], False, bos) or ""
    user_end = alone[len(head) + len(PROMPT):] if alone.startswith(head + PROMPT) else ""
    header = tail[len(user_end):] if tail.startswith(user_end) else tail
    user_end = user_end if tail.startswith(user_end) else ""
    # the answer's place: only where the conversation continues the prompt as it was rendered
    response = "{{ .Response }}" + after if full and after is not None and full.startswith(gen + ANSWER) else ""
    three = render(tokenizer, template, [user, answer, {"role": "user", "content": PROMPT2}], True, bos) or ""
    between = three.split(ANSWER, 1)[1].split(PROMPT2, 1)[0] if three.count(ANSWER) == three.count(PROMPT2) == 1 else None
    user_head = between[len(after):] if between is not None and after is not None and between.startswith(after) else None

    shape = TurnShape(None, end_of_turn=eot, bos=bos)
    with_system = render(tokenizer, template, [{"role": "system", "content": SYSTEM}, user], True, bos)
    if not with_system or with_system.count(SYSTEM) != 1 or with_system.count(PROMPT) != 1 or \
            with_system.split(PROMPT)[1] != tail:
        shape.note = "the template renders no system prompt"
        go = head + "{{ .Prompt }}" + tail + response
    else:
        system_head, prompt_tail = with_system.split(PROMPT)[0].split(SYSTEM)
        default = _default_system(head, system_head, prompt_tail, user_head)
        if default is not None:  # a system block, then the user's turn (ChatML's shape); a built-in prompt is SYSTEM
            shape.default_system = default
            close = prompt_tail[: len(prompt_tail) - len(user_head)]
            go = ("{{ if .System }}" + system_head + "{{ .System }}" + close + "{{ end }}{{ if .Prompt }}" + user_head
                  + "{{ .Prompt }}" + user_end + "{{ end }}" + header + response)
        else:  # any other placement (e.g. the system prompt inside the first user turn)
            go = ("{{ if .System }}" + system_head + "{{ .System }}" + prompt_tail + "{{ else }}" + head
                  + "{{ end }}{{ .Prompt }}" + tail + response)
    if any(mark in text for text in (gen, full or "", with_system or "") for mark in ("{{", "}}", '"""')):
        shape.note = "its text holds Go template marks or Modelfile quotes"
        return shape
    shape.go_template = go
    return shape


def _default_system(head: str, system_head: str, prompt_tail: str, user_head: str | None) -> str | None:
    """The built-in system prompt ("" for none) where the prompt without a system message is the system block
    (with that prompt, or absent) followed by the user's turn; None where it is not."""
    if not user_head or not prompt_tail.endswith(user_head) or not head.endswith(user_head):
        return None
    close, before = prompt_tail[: len(prompt_tail) - len(user_head)], head[: len(head) - len(user_head)]
    if not before:
        return ""
    fits = before.startswith(system_head) and before.endswith(close) and len(before) > len(system_head) + len(close)
    return before[len(system_head): len(before) - len(close)] if fits else None


def _end_of_turn(tokenizer, after: str | None) -> str | None:
    """The first special token after an answer (`<|im_end|>`, `<|eot_id|>`, `</s>`), else that text's first line;
    None where nothing follows an answer (the turn ends with the next role's marker)."""
    if not after or not after.strip():
        return None
    special = [t.content for t in tokenizer.added_tokens_decoder.values()]
    found = [(after.find(t), t) for t in special if t and t in after]
    return min(found)[1] if found else after.strip().splitlines()[0]


def stop_strings(tokenizer, shape: TurnShape | None) -> list[str]:
    """The stops a runtime needs: the template's end of turn, then the EOS."""
    stops = [shape.end_of_turn] if shape and shape.end_of_turn else []
    return stops + [tokenizer.eos_token] if tokenizer.eos_token and tokenizer.eos_token not in stops else stops


def fill(go_template: str, system: str, prompt: str) -> str:
    """The prompt Ollama renders from `go_template` (the part before `.Response`), by plain substitution."""
    text = go_template.split("{{ .Response }}")[0]
    text = _BRANCH.sub(lambda m: m[2] if {"System": system, "Prompt": prompt}[m[1]] else m[3] or "", text)
    return text.replace("{{ .System }}", system).replace("{{ .Prompt }}", prompt)


def read_modelfile(path: Path) -> dict:
    """{"template": str | None, "system": str, "stops": [str]} of a Modelfile."""
    text = Path(path).read_text(encoding="utf-8")
    quoted = {k: re.search(rf'^{k} """(.*?)"""', text, re.S | re.M) for k in ("TEMPLATE", "SYSTEM")}
    return {"template": quoted["TEMPLATE"] and quoted["TEMPLATE"][1],
            "system": quoted["SYSTEM"][1] if quoted["SYSTEM"] else "",
            "stops": re.findall(r'^PARAMETER stop "(.*)"$', text, re.M)}


def write_modelfile(gguf_file: Path, tokenizer_dir: Path) -> Path:
    """An Ollama Modelfile beside `gguf_file`, `<stem>.Modelfile`: `ollama create NAME -f <stem>.Modelfile`,
    then `ollama run NAME`. Its TEMPLATE, SYSTEM and stops come from the folder's chat template (any template);
    a template with no Go form is left to Ollama, which reads the GGUF's own chat template."""
    from transformers import AutoTokenizer

    gguf_file = Path(gguf_file)
    if not gguf_file.is_file():
        raise UserError(f"{gguf_file} does not exist; write it first with write_gguf")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    except (OSError, ValueError) as exc:
        raise UserError(
            f"{tokenizer_dir} has no usable tokenizer ({first_line(exc)}); give the exported model folder"
        ) from None
    template = own_template(tokenizer)
    shape = turn_shape(tokenizer, template) if template else None
    path = modelfile_path(gguf_file)
    lines = [f"{MODELFILE_FIRST_LINE}{gguf_file.stem} -f {path.name}", f"FROM ./{gguf_file.name}"]
    if shape is not None and shape.go_template is not None:
        lines.append(f'TEMPLATE """{shape.go_template}"""')
        if shape.default_system:
            lines.append(f'SYSTEM """{shape.default_system}"""')
    else:
        why = "no chat template" if shape is None else f"no Ollama form of the chat template ({shape.note})"
        lines.append(f"# {why}: Ollama uses the GGUF's tokenizer.chat_template if it knows it")
    lines += [f'PARAMETER stop "{stop}"' for stop in stop_strings(tokenizer, shape)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
