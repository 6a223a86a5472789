"""recipes/chat.py (`llm-toolkit chat`): the source's template and stops, the library's own greedy answer, the history
kept turn by turn, every kind of source, and bad input refused in one line before any weight loads."""

from __future__ import annotations

import io
import shutil
import sys
from pathlib import Path

import pytest
import torch
import wrong_arguments
from recipe_runner import recipe_module, saved_lora
from stopping import stopping_model
from transformers import AutoModelForCausalLM, AutoTokenizer


@pytest.fixture(scope="module")
def chat():
    return recipe_module("chat")


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_model, chat_tokenizer):
    """{"random": a random tiny LLaMA with ChatML, "stops": the stopping model}, each a saved HF folder."""
    root = tmp_path_factory.mktemp("chat")
    answer = chat_tokenizer("hello")["input_ids"][0]
    found = {}
    for name, model in (("random", tiny_model(tokenizer=chat_tokenizer, seed=3)),
                        ("stops", stopping_model(tiny_model, chat_tokenizer, answer))):
        model.save_pretrained(root / name)
        chat_tokenizer.save_pretrained(root / name)
        found[name] = root / name
    return found


def run(chat, capsys, *argv, stdin: str | None = None, monkeypatch=None) -> tuple[int, str, str]:
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = chat.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def greedy(model, tokenizer, messages: list[dict], max_new_tokens: int) -> str:
    """What transformers' generate answers, with the chat template, stopping at the EOS or <|im_end|>."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    stops = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]
    out = model.eval().generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                do_sample=False, eos_token_id=stops, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


def test_prompt_prints_the_greedy_answer_of_generate_alone(chat, capsys, folders):
    folder = folders["random"]
    code, out, err = run(chat, capsys, "--from", folder, "--prompt", "def f(x):", "--max-new-tokens", 12)
    assert code == 0, err
    expected = greedy(AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder),
                      [{"role": "user", "content": "def f(x):"}], 12)
    assert out.strip() == expected and out.endswith("\n") and expected
    assert "[chat] chat template: the tokenizer's own; stops at <|endoftext|>, <|im_end|>; greedy" in err


def test_the_answer_stops_at_the_templates_end_of_turn(chat, capsys, folders, chat_tokenizer):
    code, out, err = run(chat, capsys, "--from", folders["stops"], "--prompt", "hi", "--max-new-tokens", 20)
    assert code == 0, err
    assert out == chat_tokenizer.decode(chat_tokenizer("hello")["input_ids"][:1]).strip() + "\n"
    assert "reached --max-new-tokens" not in err  # it stopped at <|im_end|>, not at the limit
    # the same model with the EOS alone to stop at runs on to the limit, and says so
    code, _, err = run(chat, capsys, "--from", folders["stops"], "--prompt", "hi", "--max-new-tokens", 4,
                       "--chat-template", _template_without_end_of_turn(folders["stops"].parent))
    assert code == 0 and "the answer reached --max-new-tokens 4 before a stop token" in err, err


def _template_without_end_of_turn(folder: Path) -> Path:
    """ChatML with its turns ended by a plain newline: no special token ends a turn, so only the EOS stops."""
    path = folder / "no-end.jinja"
    path.write_text("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}\n{% endfor %}"
                    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return path


def test_a_piped_session_keeps_the_history_until_reset(chat, capsys, folders, monkeypatch, chat_tokenizer):
    code, out, err = run(chat, capsys, "--from", folders["stops"], "--show-prompt", "--system", "Be brief.",
                         stdin="hello\n\nagain\n/reset\nfresh\n/exit\nnever\n", monkeypatch=monkeypatch)
    assert code == 0, err
    answer = chat_tokenizer.decode(chat_tokenizer("hello")["input_ids"][:1]).strip()
    assert out == f"{answer}\n" * 3  # three turns answered: the empty line skipped, nothing after /exit
    prompts = [p.split("[chat]")[0] for p in err.split("[chat] prompt:\n")[1:]]
    system = [{"role": "system", "content": "Be brief."}]

    def rendered(*turns):
        messages = system + [{"role": r, "content": c} for r, c in zip(["user", "assistant"] * 3, turns, strict=False)]
        return chat_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + "\n"

    assert prompts == [rendered("hello"), rendered("hello", answer, "again"), rendered("fresh")]
    assert "[chat] history cleared" in err


def test_a_lora_adapter_on_its_base(chat, capsys, folders, tmp_path):
    from peft import PeftModel

    base = folders["random"]
    saved_lora(base, tmp_path / "adapter", std=0.5)
    code, out, err = run(chat, capsys, "--from", tmp_path / "adapter", "--base", base, "--prompt", "x = [",
                         "--max-new-tokens", 10)
    assert code == 0, err
    tokenizer = AutoTokenizer.from_pretrained(base)
    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "adapter")
    expected = greedy(with_adapter, tokenizer, [{"role": "user", "content": "x = ["}], 10)
    assert out.strip() == expected
    assert expected != greedy(AutoModelForCausalLM.from_pretrained(base), tokenizer,
                              [{"role": "user", "content": "x = ["}], 10)  # the adapter changed the answer


def a_run_with_a_checkpoint(model_folder: Path, run: Path) -> Path:
    """A run whose only save is a one-process checkpoint at step 3, as training writes it (no final/)."""
    from toolkit.checkpoint.trainer_state import TrainerState
    from toolkit.run.manifest import crc32, write_manifest

    folder = run / "checkpoints" / "step-3"
    (folder / "model_files").mkdir(parents=True)
    for f in model_folder.iterdir():
        shutil.copy(f, folder / ("" if f.name == "model.safetensors" else "model_files") / f.name)
    TrainerState(step=3, manifest_crc32=crc32(write_manifest(folder))).write(folder)
    return run


def test_a_runs_checkpoint(chat, capsys, folders, tmp_path):
    run_dir = a_run_with_a_checkpoint(folders["random"], tmp_path / "run")
    code, out, err = run(chat, capsys, "--from", run_dir, "--checkpoint", "step-3", "--prompt", "def f(x):",
                         "--max-new-tokens", 12)
    assert code == 0, err
    _, same, _ = run(chat, capsys, "--from", folders["random"], "--prompt", "def f(x):", "--max-new-tokens", 12)
    assert out == same and "(step 3)" in err


def test_a_gguf_without_llama_cpp_goes_through_transformers(chat, capsys, folders, tmp_path, monkeypatch):
    from toolkit.export.gguf import write_gguf

    gguf = write_gguf(folders["stops"], tmp_path / "stops.gguf", "f32")
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp: ImportError
    code, out, err = run(chat, capsys, "--from", gguf, "--prompt", "hi", "--max-new-tokens", 8)
    assert code == 0, err
    _, same, _ = run(chat, capsys, "--from", folders["stops"], "--prompt", "hi", "--max-new-tokens", 8)
    assert out == same and "llama-cpp-python is not installed" in err and "reached" not in err


def test_a_gguf_in_llama_cpp(chat, capsys, folders, tmp_path):
    pytest.importorskip("llama_cpp", reason="needs llama.cpp's Python binding: pip install llama-cpp-python")
    from toolkit.export.gguf import write_gguf

    gguf = write_gguf(folders["stops"], tmp_path / "stops.gguf", "f32")
    code, out, err = run(chat, capsys, "--from", gguf, "--prompt", "hi", "--max-new-tokens", 8)
    _, same, _ = run(chat, capsys, "--from", folders["stops"], "--prompt", "hi", "--max-new-tokens", 8)
    assert code == 0 and out == same and "reached" not in err, err


def test_ctrl_c_ends_the_chat_quietly(chat, capsys, folders, monkeypatch):
    from toolkit.export.conversation import TransformersChat

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(TransformersChat, "answer", interrupted)
    code, _, err = run(chat, capsys, "--from", folders["random"], stdin="hello\n", monkeypatch=monkeypatch)
    assert code == 130 and "Traceback" not in err


def test_a_closed_stdout_ends_the_chat_quietly(chat, capsys, folders, monkeypatch):
    """`llm-toolkit chat ... | head -c 3`: the streamer's print meets a closed pipe (a BrokenPipeError traceback)."""
    from toolkit.export.conversation import TransformersChat

    def closed(*args, **kwargs):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(TransformersChat, "answer", closed)
    code, _, err = run(chat, capsys, "--from", folders["random"], "--prompt", "hi")
    assert code == 141 and "Traceback" not in err and "error" not in err


# every bad input: argv (filled in) -> the start of its one line
BAD = {
    "no such --from": (["--from", "{tmp}/nowhere"], "--from {tmp}/nowhere does not exist"),
    "a text file": (["--from", "{tmp}/notes.txt"], "--from {tmp}/notes.txt is not a GGUF file"),
    "a .gguf that is not GGUF": (["--from", "{tmp}/fake.gguf"], "--from {tmp}/fake.gguf is not a GGUF file"),
    "an empty folder": (["--from", "{tmp}/empty"], "--from {tmp}/empty is not a model, run, checkpoint or adapter"),
    "a run with nothing saved": (["--from", "{tmp}/run"], "--from {tmp}/run is a run with neither final/ nor a complete "
                                                          "checkpoint; nothing to chat with"),
    "a run that has saved nothing yet": (["--from", "{tmp}/started"], "--from {tmp}/started is a run with nothing saved "
                                         "yet: it has neither final/ nor a checkpoint; wait for its first checkpoint "
                                         "(checkpoint.every) or its end, then chat with it"),
    "no chat template": (["--from", "{plain}"], "--from {plain}: its tokenizer has no chat template; give "
                                                "--chat-template FILE"),
    "a template that does not parse": (["--from", "{model}", "--chat-template", "{tmp}/broken.jinja"],
                                       "the chat template of --chat-template {tmp}/broken.jinja does not parse"),
    "a template that refuses a system prompt": (["--from", "{model}", "--chat-template", "{tmp}/nosystem.jinja",
                                                 "--system", "Be brief."], "the chat template of --chat-template "
                                                "{tmp}/nosystem.jinja refuses a system prompt"),
    "a checkpoint of a GGUF": (["--from", "{tmp}/real.gguf", "--checkpoint", "step-3"],
                               "--checkpoint applies to a run or adapter folder"),
    "an unknown option": (["--from", "{model}", "--nope"], "unrecognized arguments: --nope"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_line_before_any_weight_loads(case, chat, capsys, tmp_path, folders, model_folder, monkeypatch):
    (tmp_path / "notes.txt").write_text("hello\n")
    (tmp_path / "fake.gguf").write_text("not a model\n")
    (tmp_path / "real.gguf").write_bytes(b"GGUF" + bytes(20))
    (tmp_path / "empty").mkdir()
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "started").mkdir()
    (tmp_path / "started" / "metrics.jsonl").write_text("")
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}{{ m['content'] }")
    (tmp_path / "nosystem.jinja").write_text("{% for m in messages %}{% if m['role'] == 'system' %}"
                                             "{{ raise_exception('System role not supported') }}{% endif %}"
                                             "{{ m['content'] }}{% endfor %}")
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", None)  # any weight loaded fails the test
    argv, expected = BAD[case]
    fill = {"tmp": str(tmp_path), "model": str(folders["random"]), "plain": str(model_folder)}
    code, out, err = run(chat, capsys, *(a.format(**fill) for a in argv))
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and not out, err
    assert lines[0].startswith("error: " + expected.format(**fill)), lines[0]


def test_a_closed_stdin_without_prompt_is_one_line_before_any_weight_loads(chat, capsys, folders, monkeypatch):
    """`llm-toolkit chat --from RUN <&-`: sys.stdin is None, which the turns' loop would trip on after the load."""
    monkeypatch.setattr(sys, "stdin", None)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", None)  # any weight loaded fails the test
    code, out, err = run(chat, capsys, "--from", folders["random"])
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and not out, err
    assert lines[0].startswith("error: stdin is closed, and without --prompt"), lines[0]


# every option of chat.py by kind (tests/support/wrong_arguments.py lists each kind's wrong values)
KINDS = {"--from": "folder", "--checkpoint": "name", "--base": "folder", "--chat-template": "file", "--system": "text",
         "--prompt": "text", "--max-new-tokens": "count", "--temperature": "amount or zero", "--show-prompt": "switch",
         "-h": "help"}


def test_every_option_of_chat_has_a_kind(chat):
    """A new option fails here until KINDS says what it takes; every option naming a path expands ~ and $VAR."""
    assert {action.option_strings[0] for action in chat.parser()._actions} == set(KINDS)
    assert set(chat.PATH_OPTIONS) == {o for o, kind in KINDS.items() if kind in ("file", "folder", "output")}


@pytest.mark.parametrize("option, case", wrong_arguments.cases(KINDS))
def test_every_wrong_value_of_every_option_is_one_line(chat, capsys, tmp_path, folders, monkeypatch, option, case):
    monkeypatch.delenv(wrong_arguments.UNSET, raising=False)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", None)  # refused before any weight loads
    (tmp_path / "file.txt").write_text("x")
    fill = {"tmp": str(tmp_path), "file": str(tmp_path / "file.txt")}
    argv, value = wrong_arguments.argv_of(option, KINDS[option], case, fill)
    base = [a for o, v in {"--from": str(folders["random"])}.items() if o != option for a in (o, v)]
    code = chat.main([*base, *argv])
    out, err = capsys.readouterr()
    wrong_arguments.assert_one_line(code, out, err, option, value)
