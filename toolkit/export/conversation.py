"""A chat with what training made: the turns rendered with the source's own template, the stops it trained, the
answer streamed by the libraries' own generation (transformers' generate and TextStreamer; llama-cpp-python for a
GGUF file). recipes/chat.py is its command line.

The history is kept as messages and rendered whole for every turn, as training rendered a conversation, so the
model sees each turn as it saw it in training; an answer is kept as its decoded text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jinja2
import torch

from toolkit.config.errors import UserError, first_line
from toolkit.data.template_check import TURNS, prompt_problem

PROBE = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]


def check_prompts(tokenizer, template: str, where: str, system: str | None = None) -> None:
    """Refuse, before any weight loads, a template that does not parse or refuses a plain turn (or the system
    prompt, when one is given), or whose generation prompt is not what training saw before an answer
    (toolkit.data.template_check's check (b)): one line naming `where` the template came from."""
    def refusal(messages: list[dict]) -> jinja2.TemplateError | None:
        try:
            tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, chat_template=template)
        except jinja2.TemplateError as exc:
            return exc
        return None

    system_turn = [{"role": "system", "content": system}] if system is not None else []
    exc = refusal([*system_turn, *PROBE[:1]])
    if exc is None:
        if problem := prompt_problem(tokenizer, template, TURNS):
            raise UserError(f"the chat template of {where}: {problem}, so the model would not be prompted as it was "
                            "trained; give --chat-template FILE whose add_generation_prompt text is how an assistant "
                            "turn begins")
        return
    if isinstance(exc, jinja2.TemplateSyntaxError):
        said = "does not parse"
    elif system_turn and refusal(PROBE[:1]) is None:
        raise UserError(f"the chat template of {where} refuses a system prompt ({first_line(exc)}); leave --system out, "
                        "or give --chat-template FILE with a template that renders one")
    else:
        said = "refuses a plain user turn"
    raise UserError(f"the chat template of {where} {said} ({first_line(exc)}); give --chat-template FILE with a Jinja "
                    "template that renders user and assistant turns")


@dataclass
class Conversation:
    """The turns so far, rendered with `template` for the next answer."""

    tokenizer: object
    template: str
    system: str | None = None
    turns: list[dict] = field(default_factory=list)

    def messages(self, user: str) -> list[dict]:
        system = [{"role": "system", "content": self.system}] if self.system is not None else []
        return [*system, *self.turns, {"role": "user", "content": user}]

    def prompt(self, user: str) -> str:
        """The text the model continues: every turn so far, the user's new one and the template's generation prompt."""
        return self.tokenizer.apply_chat_template(self.messages(user), tokenize=False, add_generation_prompt=True,
                                                  chat_template=self.template)

    def ids(self, user: str) -> list[int]:
        # as training and samples.md tokenize a rendered conversation: the template writes its own special tokens
        return self.tokenizer(self.prompt(user), add_special_tokens=False)["input_ids"]

    def fit(self, user: str, positions: int | None, max_new_tokens: int) -> int:
        """Drop the oldest exchanges until the prompt and the answer fit `positions`; how many were dropped. A turn
        that does not fit alone is a UserError."""
        dropped = 0
        while positions is not None and len(self.ids(user)) + max_new_tokens > positions:
            if not self.turns:
                n = len(self.ids(user))
                raise UserError(f"the prompt is {n} tokens, and with --max-new-tokens {max_new_tokens} the answer would "
                                f"pass the model's {positions} positions; give a shorter prompt or a smaller "
                                "--max-new-tokens")
            self.turns = self.turns[2:]
            dropped += 1
        return dropped

    def answered(self, user: str, answer: str) -> None:
        self.turns += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]

    def reset(self) -> None:
        self.turns = []


class TransformersChat:
    """A model in this process: transformers' generate, streamed by its TextStreamer."""

    def __init__(self, model, tokenizer, stops: list[int]):
        self.model, self.tokenizer, self.stops = model.eval(), tokenizer, stops
        self.positions = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions",
                                                                                           None)

    @torch.no_grad()
    def answer(self, prompt: str, max_new_tokens: int, temperature: float) -> tuple[str, bool]:
        """(the answer's text, whether it ended at a stop token), printed to stdout as it is generated."""
        from transformers import TextStreamer

        ids = self.tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        streamer = TextStreamer(self.tokenizer, skip_prompt=True, skip_special_tokens=True)
        sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else \
            {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        generated = self.model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, eos_token_id=self.stops,
            pad_token_id=self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.stops[0],
            streamer=streamer, use_cache=True, **sampling,
        )[0, ids.shape[1]:]
        stopped = len(generated) > 0 and int(generated[-1]) in self.stops
        return self.tokenizer.decode(generated, skip_special_tokens=True).strip(), stopped


class LlamaCppChat:
    """A GGUF file in llama.cpp's own runtime (llama-cpp-python): it stops at the file's end-of-generation tokens
    (its EOS and end of turn), greedy at temperature 0."""

    def __init__(self, path, stops: list[int]):
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(path), n_ctx=0, verbose=False)  # n_ctx=0: the context the model was trained to
        self.positions = self.llm.n_ctx()
        self.stops = stops

    def answer(self, prompt: str, max_new_tokens: int, temperature: float) -> tuple[str, bool]:
        ids = self.llm.tokenize(prompt.encode(), add_bos=False, special=True)
        pieces, finish = [], None
        for chunk in self.llm.create_completion(ids, max_tokens=max_new_tokens, temperature=temperature, top_k=0,
                                                top_p=1.0, min_p=0.0, repeat_penalty=1.0, stream=True):
            choice = chunk["choices"][0]
            pieces.append(choice["text"])
            print(choice["text"], end="", flush=True)
            finish = choice.get("finish_reason") or finish
        print(flush=True)
        return "".join(pieces).strip(), finish == "stop"
