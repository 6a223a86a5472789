"""The Modelfile is made from the chat template for any template: its TEMPLATE, filled as Ollama fills it, renders
the prompt the Jinja template renders (with and without a system message), and its stops are the template's end of
turn and the EOS."""

from __future__ import annotations

import copy

import pytest

from toolkit.export.modelfile import fill, render, stop_strings, turn_shape

LLAMA3 = ("{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
          " + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
ZEPHYR = ("{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")
# the system prompt inside the first user turn, as Gemma's template puts it
GEMMA = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first = messages[0]['content'] + '\n\n' %}"
         "{% set rest = messages[1:] %}{% else %}{% set first = '' %}{% set rest = messages %}{% endif %}"
         "{% for message in rest %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
         "{{ '<start_of_turn>' + role + '\n' + (first if loop.first else '') + message['content'] | trim + "
         "'<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")
# a turn that ends with the next role's marker (GLM): nothing after an answer
GLM = ("{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] }}{% endfor %}"
       "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")
DROPS_SYSTEM = ("{% for message in messages %}{% if message['role'] != 'system' %}{{ '<|im_start|>' + message['role'] + "
                "'\n' + message['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
DEFAULT_SYSTEM = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
                  "{{ '<|im_start|>system\nYou are kind.<|im_end|>\n' }}{% endif %}{{ '<|im_start|>' + message['role'] + "
                  "'\n' + message['content'] + '<|im_end|>\n' }}{% endfor %}"
                  "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.fixture(scope="module")
def tokenizer(chat_tokenizer):
    """The tiny BPE with the special tokens of the templates above; `<|endoftext|>` is its EOS."""
    tok = copy.deepcopy(chat_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": [
        "<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<start_of_turn>",
        "<end_of_turn>"]})
    return tok


def _fills_back(tokenizer, template, shape):
    for system in ("", "Answer in French."):
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": "Where is Paris?"})
        expected = render(tokenizer, template, messages, True, shape.bos)
        assert fill(shape.go_template, system or shape.default_system, "Where is Paris?") == expected, system


@pytest.mark.parametrize(("template", "end"), [(LLAMA3, "<|eot_id|>"), (ZEPHYR, "<|endoftext|>"),
                                               (GEMMA, "<end_of_turn>"), (DEFAULT_SYSTEM, "<|im_end|>")],
                         ids=["llama3", "zephyr", "gemma", "default-system"])
def test_a_template_fills_back_to_its_jinja_render(tokenizer, template, end):
    shape = turn_shape(tokenizer, template)
    assert shape.go_template is not None, shape.note
    _fills_back(tokenizer, template, shape)
    assert shape.end_of_turn == end
    assert stop_strings(tokenizer, shape) == list(dict.fromkeys([end, "<|endoftext|>"]))
    assert shape.go_template.count("{{ .Response }}") == 1 and shape.go_template.endswith("{{ .Response }}" + {
        LLAMA3: "<|eot_id|>", ZEPHYR: "<|endoftext|>\n", GEMMA: "<end_of_turn>\n", DEFAULT_SYSTEM: "<|im_end|>\n"}[template])


def test_a_built_in_system_prompt_becomes_the_system_line(tokenizer):
    shape = turn_shape(tokenizer, DEFAULT_SYSTEM)
    assert shape.default_system == "You are kind."
    assert shape.go_template.startswith("{{ if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}")


def test_a_template_without_an_end_of_turn_stops_at_eos_only(tokenizer):
    shape = turn_shape(tokenizer, GLM)
    _fills_back(tokenizer, GLM, shape)
    assert shape.end_of_turn is None and stop_strings(tokenizer, shape) == ["<|endoftext|>"]


def test_a_template_that_drops_the_system_prompt_says_so(tokenizer):
    shape = turn_shape(tokenizer, DROPS_SYSTEM)
    assert shape.note == "the template renders no system prompt" and "System" not in shape.go_template
    assert fill(shape.go_template, "", "hi") == render(tokenizer, DROPS_SYSTEM, [{"role": "user", "content": "hi"}], True)


def test_a_template_with_go_marks_has_no_go_form(tokenizer):
    shape = turn_shape(tokenizer, "{{ '{{' }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert shape.go_template is None and "Go template marks" in shape.note
