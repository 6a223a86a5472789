"""The stop token proven trained, for any template: the shipped bases' templates and SmolLM2's pass (or need
data.append_stop, as docs/data.md records), planted bad ones are refused with the line that says which check failed
and the fix, and data.append_stop trains the EOS where a template ends a turn with the next role's marker."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from recipe_runner import CHATML

from toolkit.config.errors import UserError
from toolkit.data.chat import render_conversation
from toolkit.data.packing import IGNORE_INDEX
from toolkit.data.template_check import TURNS, check_template, end_of_turn, stop_ids

BASES = Path(__file__).resolve().parents[3] / "recipes" / "configs" / "bases"

# GLM-4's shape: a turn is its role's marker and the content; nothing ends it but the next role's marker.
GLM_STYLE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{% endfor %}"
             "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
# ChatML that leaves the system message out: the user's system prompt is silently never seen.
DROPS_SYSTEM = ("{% for m in messages if m['role'] != 'system' %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# ChatML whose generation prompt is not how an assistant turn begins (a space for the newline).
NOT_A_PREFIX = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")

# Mistral v0.3's shape: the system message goes into the last user turn only, so never where an answer is trained.
MISTRAL_STYLE = ("{% if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] %}{% set msgs = "
                 "messages[1:] %}{% else %}{% set msgs = messages %}{% endif %}{% for m in msgs %}"
                 "{% if m['role'] == 'user' and loop.last and sys is defined %}[INST] {{ sys }}\n\n{{ m['content'] }}"
                 "[/INST]{% elif m['role'] == 'user' %}[INST] {{ m['content'] }}[/INST]{% else %} {{ m['content'] }}"
                 "{{ eos_token }}{% endif %}{% endfor %}")


@pytest.fixture(scope="module")
def smol(smollm2_gguf_path):
    """SmolLM2-135M-Instruct's tokenizer (ChatML, <|im_end|> its EOS), read from the GGUF as the toolkit reads it."""
    from transformers import AutoTokenizer

    from toolkit.models.gguf_base import _parse_gguf_once

    with _parse_gguf_once():
        return AutoTokenizer.from_pretrained(str(smollm2_gguf_path.parent), gguf_file=smollm2_gguf_path.name)


@pytest.fixture(scope="module")
def with_markers(smol):
    """SmolLM2's tokenizer with every shipped base's and GLM's turn markers as special tokens."""
    tok = copy.deepcopy(smol)
    tok.add_special_tokens({"additional_special_tokens": [
        "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|begin_of_text|>",  # Llama 3.1
        "<start_of_turn>", "<end_of_turn>",  # Gemma 2
        "<|system|>", "<|user|>", "<|assistant|>",  # GLM
    ]})
    return tok


def test_smollm2s_own_template_passes(smol):
    assert check_template(smol) == []


@pytest.mark.parametrize("base, note", [
    ("meta-llama/Llama-3.1-8B-Instruct", "trains '<|eot_id|>' as the stop, its end-of-turn token"),
    ("Qwen/Qwen2.5-7B-Instruct", None),
    ("google/gemma-2-9b-it", "trains '<end_of_turn>' as the stop, its end-of-turn token"),
])
def test_the_shipped_bases_templates_pass_as_they_are(with_markers, base, note):
    """Rendered with SmolLM2's tokenizer (the bases' own are not offline), their markers special tokens: each ends an
    answer with its end-of-turn token; Gemma refuses a system turn, which is no failure."""
    template = str(BASES / base / "chat_template.jinja")
    notes = check_template(with_markers, template)
    assert [note in n for n in notes] == ([True] if note else [])


def test_a_turn_ended_by_the_next_roles_marker_is_refused_with_its_fix(with_markers):
    with pytest.raises(UserError, match=r"^data.chat_template=.*fails check \(a\): assistant turn 0 ends its targets "
                                        r"with '\.', not a token generation stops on .*; set data.append_stop=true"):
        check_template(with_markers, GLM_STYLE)


def test_append_stop_trains_the_eos_after_each_answer_and_the_check_passes(with_markers):
    assert check_template(with_markers, GLM_STYLE, append_stop=True) == []
    ids, labels = render_conversation(with_markers, TURNS, GLM_STYLE, append_stop=True)
    before, _ = render_conversation(with_markers, TURNS, GLM_STYLE)
    eos = with_markers.eos_token_id
    assert len(ids) == len(before) + 2 and ids.count(eos) == 2  # one EOS after each of the two answers
    for i in (i for i, t in enumerate(ids) if t == eos):
        assert labels[i] == eos and labels[i - 1] != IGNORE_INDEX  # a target, right after the answer's last token
    assert [t for t in ids if t != eos] == before


def test_append_stop_changes_nothing_where_the_turn_already_ends_with_the_eos(smol):
    """ChatML ends each answer with <|im_end|>, SmolLM2's EOS: the same tokens and labels, key on or off."""
    messages = [{"role": "system", "content": "Be brief."}, *TURNS]
    assert render_conversation(smol, messages, append_stop=True) == render_conversation(smol, messages)


def test_a_template_that_drops_the_system_message_is_refused(smol):
    with pytest.raises(UserError, match=r"fails check \(c\): it renders nothing of a system message.*give a "
                                        r"data.chat_template that renders the system message"):
        check_template(smol, DROPS_SYSTEM)


def test_a_generation_prompt_that_is_not_a_prefix_is_refused(smol):
    with pytest.raises(UserError, match=r"fails check \(b\): the generation prompt before assistant turn 2 ends "
                                        r"'.*im_start\|>assistant ' where the conversation has "
                                        r"'.*im_start\|>assistant\\nThe num.*add_generation_prompt"):
        check_template(smol, NOT_A_PREFIX)


@pytest.mark.parametrize("template, said", [
    ("{% for m in messages %}{{ m['content'] }", r"does not parse \(unexpected '}', line 1 of the template\); fix its "
                                                 "Jinja"),
    ("{{ raise_exception('no turns here') }}", r"refuses a plain user/assistant conversation \(no turns here\)"),
    ("{{ undefined_filter() }}", r"refuses a plain user/assistant conversation \('undefined_filter' is undefined\)"),
])
def test_a_template_that_renders_no_conversation_says_why(smol, tmp_path, template, said):
    """A syntax error is not a raise_exception: the line names what the template said, and where."""
    path = tmp_path / "bad.jinja"
    path.write_text(template)
    with pytest.raises(UserError, match=rf"^data.chat_template={path} {said}"):
        check_template(smol, str(path))


def test_a_template_that_ignores_add_generation_prompt_is_refused(smol):
    """ChatML without its generation prompt: the prompt is a prefix of the conversation, but the assistant's header
    that training reads before each answer is never given to generation."""
    no_prompt = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}")
    with pytest.raises(UserError, match=r"fails check \(b\): the conversation renders '<\|im_start\|>assistant\\n' "
                                        r"between the generation prompt .* and assistant turn \d's answer, which "
                                        r"generation is never given \(does the template ignore add_generation_prompt"):
        check_template(smol, no_prompt)


def test_a_template_file_is_named_by_its_path(smol, tmp_path):
    path = tmp_path / "glm.jinja"
    path.write_text(GLM_STYLE)
    with pytest.raises(UserError, match=rf"^data.chat_template={path} fails check \(a\)"):
        check_template(smol, str(path))


def test_preference_answers_train_the_eos_under_append_stop(with_markers):
    """A pair's answers are rendered as chat turns are: each ends with a trained EOS, its last target."""
    from toolkit.data.preference import render_answer

    prompt, eos = TURNS[:1], with_markers.eos_token_id
    ids, labels = render_answer(with_markers, prompt, "Its length.", GLM_STYLE, append_stop=True)
    assert ids[-1] == labels[-1] == eos
    before, _ = render_answer(with_markers, prompt, "Its length.", GLM_STYLE)
    assert ids[:-1] == before and eos not in before


def test_a_system_message_rendered_only_in_the_prompt_is_said_not_refused(smol):
    """Training never sees it (records carrying one are refused as they are read); the template itself is sound."""
    notes = check_template(smol, MISTRAL_STYLE)
    assert len(notes) == 1 and "renders a system message only in the prompt, not where training sees it" in notes[0]


NEWLINE_ENDS = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
NEXT_ROLE_ENDS = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_the_stops_are_the_eos_and_the_end_of_turn_that_training_labels(chat_tokenizer):
    eos, im_end = chat_tokenizer.eos_token_id, chat_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn(chat_tokenizer, CHATML) == im_end
    assert stop_ids(chat_tokenizer, CHATML) == [eos, im_end]
    assert stop_ids(chat_tokenizer, CHATML, [eos, 7]) == [eos, 7, im_end]  # the model's generation EOS ids too
    for template in (NEWLINE_ENDS, NEXT_ROLE_ENDS):  # no special token ends the turn: the EOS alone
        assert end_of_turn(chat_tokenizer, template) is None and stop_ids(chat_tokenizer, template) == [eos]
