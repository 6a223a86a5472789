"""The export report's stop check: on the run's prompts, the export's greedy tokens against the source's up to the
stop; a GGUF's metadata and a Modelfile that would stop elsewhere are failures. A tiny LLaMA with ChatML as special
tokens; llama.cpp where llama-cpp-python is installed."""

from __future__ import annotations

import pytest
import yaml
from stopping import stopping_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from toolkit.export.gguf import write_gguf
from toolkit.export.modelfile import write_modelfile
from toolkit.export.stops import (
    DEFAULT_PROMPTS,
    TRAINING_CONFIG,
    check_stops,
    compare,
    gguf_problems,
    greedy,
    modelfile_cells,
    run_prompts,
    source_reference,
)

PROMPTS = ["Where is Paris?", "def main"]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory, tiny_model, chat_tokenizer):
    """(folder, model, tokenizer): a tiny LLaMA whose tokenizer has ChatML's markers, answering one token and then
    <|im_end|> (a random one never stops), saved as final/ is."""
    model = stopping_model(tiny_model, chat_tokenizer, chat_tokenizer("hello")["input_ids"][0]).eval()
    folder = tmp_path_factory.mktemp("run") / "final"
    model.save_pretrained(folder)
    chat_tokenizer.save_pretrained(folder)
    return folder, model, AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def exported_gguf(chat_model, tmp_path_factory):
    folder = chat_model[0]
    out = write_gguf(folder, tmp_path_factory.mktemp("gguf") / "tiny.gguf", "f32")
    return out, write_modelfile(out, folder)


def test_an_hf_export_stops_where_its_source_stops(chat_model):
    folder, model, tokenizer = chat_model
    ref = source_reference(model, tokenizer, PROMPTS, "the test's prompts")
    check = check_stops(ref, AutoModelForCausalLM.from_pretrained(folder).eval(), "the export")
    assert not check.problems
    assert [row[2] for row in check.rows] == ["same tokens up to the same stop"] * 2
    table = check.markdown()
    assert "| prompt | the source | the export, transformers |" in table and "Where is Paris?" in table
    # the prompt was the user turn of the template, and generation stops at its end of turn
    assert ref.ids[0][:1] == tokenizer.convert_tokens_to_ids(["<|im_start|>"])
    assert ref.stops == tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])  # the EOS, the end of turn
    text = source_reference(model, tokenizer, PROMPTS, "a text run's prompts", chat=False)  # as its samples.md's
    assert text.ids == [tokenizer(p).input_ids for p in PROMPTS] and text.stops == ref.stops


def test_generation_ends_at_the_first_stop_and_a_difference_is_located(chat_model):
    _, model, tokenizer = chat_model
    ids = tokenizer("Where is", add_special_tokens=False).input_ids
    free = greedy(model, ids, [], new_tokens=6)
    assert len(free) == 6
    assert greedy(model, ids, [free[2]], new_tokens=6) == free[: free.index(free[2]) + 1]
    other = [*free[:3], (free[3] + 1) % len(tokenizer), *free[4:]]
    assert compare(tokenizer, free, other, []) == (f"differs at token 3: {tokenizer.decode([free[3]])!r} vs "
                                               f"{tokenizer.decode([other[3]])!r}")
    assert compare(tokenizer, free, free[:4], []).startswith("differs at token 4: ") and "(ended)" in compare(
        tokenizer, free, free[:4], [])


def test_the_prompts_are_the_runs_own(tmp_path):
    final = tmp_path / "run" / "final"
    final.mkdir(parents=True)
    assert run_prompts(final) == (DEFAULT_PROMPTS, "default prompts (no run config with samples.prompts found)", True)
    config = yaml.safe_dump({"samples": {"prompts": ["Hello?", "Bye?"]}, "data": {"format": "chat"}})
    (final / "README.md").write_text(f"# card\n\n{TRAINING_CONFIG}{config}```\n")
    assert run_prompts(final)[::2] == (["Hello?", "Bye?"], True)
    (tmp_path / "run" / "adapter").mkdir()  # a LoRA run's adapter/ finds them in its final/
    assert run_prompts(tmp_path / "run" / "adapter")[::2] == (["Hello?", "Bye?"], True)
    # a run on text (continued pretraining, or pretraining, whose config has no data.format): text to go on from, as
    # its samples.md was made
    config = yaml.safe_dump({"samples": {"prompts": ["def f("]}, "data": {"path": None}})
    (final / "README.md").write_text(f"# card\n\n{TRAINING_CONFIG}{config}```\n")
    prompts, said, chat = run_prompts(final)
    assert (prompts, chat) == (["def f("], False) and said.endswith("as text to go on from")


def test_the_gguf_and_modelfile_stop_as_the_source(chat_model, exported_gguf):
    _, _, tokenizer = chat_model
    gguf_file, modelfile = exported_gguf
    assert gguf_problems(gguf_file, tokenizer) == []
    cells, problems, notes = modelfile_cells(modelfile, tokenizer, PROMPTS)
    assert problems == [] and notes == []
    assert cells == ["same prompt text; stops as the source's"] * 2


def test_a_planted_modelfile_or_gguf_mismatch_is_reported(chat_model, exported_gguf, tmp_path):
    _, _, tokenizer = chat_model
    gguf_file, modelfile = exported_gguf
    text = modelfile.read_text()
    wrong_stop = tmp_path / "stop.Modelfile"
    wrong_stop.write_text(text.replace('PARAMETER stop "<|im_end|>"', 'PARAMETER stop "</s>"'))
    _, problems, _ = modelfile_cells(wrong_stop, tokenizer, PROMPTS)
    assert problems == ['stop.Modelfile lacks PARAMETER stop "<|im_end|>", where the source stops']
    wrong_template = tmp_path / "template.Modelfile"
    wrong_template.write_text(text.replace("<|im_start|>assistant\n", "<|im_start|>model\n"))
    cells, problems, _ = modelfile_cells(wrong_template, tokenizer, PROMPTS)
    assert cells[0] == "prompt differs at character 55; stops as the source's"
    assert problems[0] == ("template.Modelfile: TEMPLATE renders 'model\\n' where the chat template renders "
                           "'assistant\\n' (character 55 of the prompt 'Where is Paris?')")
    # a tokenizer with another template than the one the GGUF holds, and another EOS
    other = AutoTokenizer.from_pretrained(chat_model[0])
    other.chat_template = other.chat_template.replace("assistant", "model")
    other.eos_token = "<|im_end|>"
    assert gguf_problems(gguf_file, other) == [
        "tiny.gguf: tokenizer.chat_template is not the chat template of the source's tokenizer",
        f"tiny.gguf: tokenizer.ggml.eos_token_id is {tokenizer.eos_token_id}, not {other.eos_token_id} (<|im_end|>) "
        "as in the source"]


def test_llama_cpp_stops_where_the_source_stops(chat_model, exported_gguf):
    pytest.importorskip("llama_cpp", reason="needs llama.cpp's Python binding: pip install llama-cpp-python")
    _, model, tokenizer = chat_model
    gguf_file, modelfile = exported_gguf
    check = check_stops(source_reference(model, tokenizer, PROMPTS, "the test's prompts"), None, "the GGUF",
                        gguf_file, modelfile)
    assert check.columns[1] == "the GGUF, llama.cpp (llama-cpp-python)"
    assert not check.problems and [row[2] for row in check.rows] == ["same tokens up to the same stop"] * 2
