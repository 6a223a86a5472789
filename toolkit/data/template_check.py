"""The chat template checked before any weight loads: its stop token trained, its prompt what training saw.

A two-turn conversation is rendered through the `render_conversation` training uses; the run is refused in one line
unless (a) every answer's last target is a token generation stops on (the EOS, the template's end-of-turn token, a
base's generation EOS ids; data.append_stop=true trains the EOS where a template has none), (b) the generation prompt
is a prefix of the conversation with nothing but whitespace before the answer, and (c) a system message is rendered
(or refused with raise_exception). Each check, and the shipped bases' verdicts: docs/data.md.
"""

from __future__ import annotations

from collections.abc import Collection

import jinja2

from toolkit.config.errors import UserError, first_line
from toolkit.data.chat import chat_template_for, looks_like_file, render_conversation, special_ids
from toolkit.data.packing import IGNORE_INDEX

SYSTEM = "You answer in one short sentence."  # distinctive enough to be found where a template renders it
TURNS = [
    {"role": "user", "content": "What does len() return?"},
    {"role": "assistant", "content": "The number of items in a container."},
    {"role": "user", "content": "And for a string?"},
    {"role": "assistant", "content": "The number of characters in it."},
]
REPAIR = "set data.append_stop=true to train the EOS after each answer"


def which_template(chat_template: str | None) -> str:
    """How a line names the template: the tokenizer's, or data.chat_template=... (a file's name, a text's start)."""
    if not chat_template:
        return "the tokenizer's chat template"
    shown = chat_template if looks_like_file(chat_template) or len(chat_template) <= 80 else f"{chat_template[:40]!r}..."
    return f"data.chat_template={shown}"


def _render(tokenizer, template: str, messages: list[dict], generation_prompt: bool = False) -> str | None:
    """The text, or None where the template refuses the conversation (raise_exception, say)."""
    return _try_render(tokenizer, template, messages, generation_prompt)[0]


def _try_render(tokenizer, template: str, messages: list[dict],
                generation_prompt: bool = False) -> tuple[str | None, Exception | None]:
    """(the text, None), or (None, what the template raised)."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                             chat_template=template), None
    except (jinja2.TemplateError, TypeError, ValueError) as exc:
        return None, exc


class Unrenderable(UserError):
    """A template that renders no plain user/assistant conversation: no data can be shown with it either."""


def _unrendered(named: str, exc: Exception | None) -> UserError:
    """The line for a template that renders no plain user/assistant conversation: it does not parse, or it raises."""
    if isinstance(exc, jinja2.TemplateSyntaxError):
        return Unrenderable(f"{named} does not parse ({first_line(exc)}, line {exc.lineno} of the template); fix its "
                         "Jinja, or give a data.chat_template that renders user and assistant turns")
    return Unrenderable(f"{named} refuses a plain user/assistant conversation ({first_line(exc)}); give a "
                     "data.chat_template that renders user and assistant turns")


def prompt_problem(tokenizer, template: str, messages: list[dict]) -> str | None:
    """(b): the first assistant turn whose generation prompt is not how the conversation renders it."""
    full = _render(tokenizer, template, messages) or ""
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = _render(tokenizer, template, messages[:k], generation_prompt=True) or ""
        if not full.startswith(prompt):
            at = next((i for i, (a, b) in enumerate(zip(prompt, full, strict=False)) if a != b), len(full))
            start = max(0, at - 20)
            return (f"the generation prompt before assistant turn {k} ends {prompt[start:]!r} where the conversation "
                    f"has {full[start:at + 10]!r}")
        # and it is all that comes before the answer: text between the two (a template that ignores
        # add_generation_prompt, its role header never written) is read in training and never given to generation
        through = _render(tokenizer, template, messages[:k + 1]) or ""
        answer = through.find(message["content"].strip(), len(prompt))
        if answer > len(prompt) and through[len(prompt):answer].strip():
            return (f"the conversation renders {through[len(prompt):answer]!r} between the generation prompt "
                    f"({prompt[-20:]!r}) and assistant turn {k}'s answer, which generation is never given (does "
                    "the template ignore add_generation_prompt?)")
    return None


def end_of_turn(tokenizer, template: str) -> int | None:
    """The special token the template closes a user's turn with (ChatML's <|im_end|>), if it closes it with one."""
    text = _render(tokenizer, template, TURNS[:1]) or ""
    ids = tokenizer(text.rstrip(), add_special_tokens=False)["input_ids"]
    return ids[-1] if ids and ids[-1] in special_ids(tokenizer) and ids[-1] != tokenizer.bos_token_id else None


def stop_ids(tokenizer, template: str | None, generation_eos: int | list[int] | None = None) -> list[int]:
    """Every token an answer stops at, each once: the tokenizer's EOS, the model's generation EOS ids, and the
    template's end-of-turn token (what check (a) lets an answer's targets end with, so what training trains)."""
    extra = generation_eos if isinstance(generation_eos, list) else [generation_eos]
    ids = [tokenizer.eos_token_id, *extra, end_of_turn(tokenizer, template) if template else None]
    return list(dict.fromkeys(i for i in ids if i is not None))


def check_template(tokenizer, chat_template: str | None = None, append_stop: bool = False,
                   stops: Collection[int] = ()) -> list[str]:
    """Refuses, in one line, a template that fails (a), (b) or (c) (module docstring); else lines for the log."""
    template = chat_template_for(tokenizer, chat_template)
    named, notes = which_template(chat_template), []
    with_system = [{"role": "system", "content": SYSTEM}, *TURNS]
    messages = with_system
    full = _render(tokenizer, template, with_system)
    if full is None:  # no system role: records carrying one are refused
        messages = TURNS
        text, exc = _try_render(tokenizer, template, TURNS)
        if text is None:
            raise _unrendered(named, exc)
    else:
        prompt = _render(tokenizer, template, with_system[:2], generation_prompt=True) or ""
        if SYSTEM not in full and SYSTEM not in prompt:
            raise UserError(f"{named} fails check (c): it renders nothing of a system message, so training and "
                            "generation ignore it; give a data.chat_template that renders the system message (or "
                            "refuses it with raise_exception)")
        if SYSTEM not in full or (prompt_problem(tokenizer, template, with_system)
                                  and not prompt_problem(tokenizer, template, TURNS)):
            # Mistral-style: the system message rendered in the last user turn only, which training never sees
            notes.append(f"{named} renders a system message only in the prompt, not where training sees it: records "
                         "with a system message are refused as they are read")
            messages = TURNS
    if problem := prompt_problem(tokenizer, template, messages):
        raise UserError(f"{named} fails check (b): {problem}, so generation would not see what training saw; give a "
                        "data.chat_template whose add_generation_prompt text is how an assistant turn begins")
    try:
        ids, labels = render_conversation(tokenizer, messages, template, append_stop=append_stop)
    except UserError as exc:  # it rewrites earlier turns, or does not render an answer verbatim
        raise UserError(f"{named} fails check (b): {exc}") from None
    eos, eot = tokenizer.eos_token_id, end_of_turn(tokenizer, template)
    allowed = {eos, *stops} | ({eot} if eot is not None else set())
    ends = [i for i, label in enumerate(labels) if label != IGNORE_INDEX
            and (i + 1 == len(labels) or labels[i + 1] == IGNORE_INDEX)]  # each answer's last target
    for turn, i in enumerate(ends):
        if ids[i] not in allowed:
            said = ", ".join(repr(tokenizer.convert_ids_to_tokens(t)) for t in sorted(allowed))
            raise UserError(
                f"{named} fails check (a): assistant turn {turn} ends its targets with "
                f"{tokenizer.convert_ids_to_tokens(ids[i])!r}, not a token generation stops on ({said}), so the model "
                f"would never learn to stop; {REPAIR}, or give a data.chat_template that ends the assistant turn with "
                f"{tokenizer.eos_token!r}")
    if eot is not None and eot != eos and eot not in stops and any(ids[i] == eot for i in ends):
        notes.append(f"{named} trains {tokenizer.convert_ids_to_tokens(eot)!r} as the stop, its end-of-turn token, not "
                     f"the EOS {tokenizer.eos_token!r}: a runtime stops on it where the model's generation_config (or "
                     "the export's) lists it")
    return notes
