"""A chat's turns and stops (toolkit/export/conversation.py): the stops are those training labels, the history is
rendered whole and shortened from its oldest exchange, a template that cannot chat is one line before any weight
loads. The command around it: tests/recipes/test_chat_recipe.py."""

from __future__ import annotations

import pytest
from recipe_runner import CHATML

from toolkit.config.errors import UserError
from toolkit.export.conversation import Conversation, check_prompts


# ChatML whose turns end with a newline alone, and a GLM-style one whose turn ends where the next role's marker begins
def test_the_history_is_rendered_whole_and_loses_its_oldest_exchange_first(chat_tokenizer):
    talk = Conversation(chat_tokenizer, CHATML, system="Be brief.")
    for k in range(3):
        talk.answered(f"question {k}", f"answer {k}")
    assert talk.prompt("next") == chat_tokenizer.apply_chat_template(
        talk.messages("next"), tokenize=False, add_generation_prompt=True)
    assert "question 0" in talk.prompt("next") and talk.prompt("next").startswith("<|im_start|>system\nBe brief.")
    whole = len(talk.ids("next"))
    assert talk.fit("next", whole + 8, 8) == 0 and len(talk.turns) == 6  # fits: nothing dropped
    assert talk.fit("next", whole + 7, 8) == 1 and [t["content"] for t in talk.turns][:1] == ["question 1"]
    alone = Conversation(chat_tokenizer, CHATML, system="Be brief.")
    assert talk.fit("next", len(alone.ids("next")) + 8, 8) == 2 and talk.turns == []
    assert talk.prompt("next").startswith("<|im_start|>system\nBe brief.")  # the system prompt stays
    with pytest.raises(UserError, match=r"the prompt is \d+ tokens, and with --max-new-tokens 8 the answer would pass "
                                        r"the model's 10 positions; give a shorter prompt or a smaller --max-new-tokens"):
        talk.fit("next", 10, 8)
    talk.reset()
    assert talk.turns == []


REFUSALS = {
    "does not parse": ("{% for m in messages %}{{ m['content'] }", None,
                       "the chat template of T does not parse (unexpected '}'); give --chat-template FILE"),
    "refuses a system prompt": ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system') }}"
                                "{% endif %}{{ m['content'] }}{% endfor %}", "Be brief.",
                                "the chat template of T refuses a system prompt (no system); leave --system out"),
    "refuses a user turn": ("{{ raise_exception('roles must alternate') }}", None,
                            "the chat template of T refuses a plain user turn (roles must alternate); give "
                            "--chat-template FILE"),
    "ignores add_generation_prompt": (  # answers would begin with the role header training read before each answer
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}", None,
        "the chat template of T: the conversation renders '<|im_start|>assistant\\n' between the generation prompt"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_a_template_that_cannot_chat_is_one_line(case, chat_tokenizer):
    template, system, said = REFUSALS[case]
    with pytest.raises(UserError) as refused:
        check_prompts(chat_tokenizer, template, "T", system)
    assert str(refused.value).startswith(said) and "\n" not in str(refused.value)
    check_prompts(chat_tokenizer, CHATML, "T", "Be brief.")  # ChatML takes both
