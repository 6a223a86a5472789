"""Bad input to the fine-tuning recipe: one line on stderr, exit code 2, nothing trained.

The recipe's main() runs in this process (one process, as `python recipes/finetune.py`), which
keeps each case to about a second.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
from recipe_runner import FT_TINY, ROOT, recipe_module

CONFIG = str(ROOT / "recipes" / "configs" / "finetune_smollm2_lora.yaml")


@pytest.fixture(scope="module")
def finetune():
    return recipe_module("finetune")


pytestmark = pytest.mark.usefixtures("recipe_in_process")


def run(finetune, capsys, tmp_path, *overrides) -> tuple[int, str, str]:
    code = finetune.main(["--config", CONFIG, *FT_TINY, "train.max_steps=1", f"output_dir={tmp_path / 'run'}", *overrides])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_error(finetune, capsys, tmp_path, *overrides) -> str:
    code, _, err = run(finetune, capsys, tmp_path, *overrides)
    lines = [line for line in err.splitlines() if line.startswith("error")]
    assert code == 2 and len(lines) == 1, err[-2000:]
    assert "Traceback" not in err
    assert not (tmp_path / "run" / "final").exists() and not (tmp_path / "run" / "adapter").exists()
    return lines[0]


def write_jsonl(path, records) -> str:
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return str(path)


def test_base_model_path_missing(finetune, capsys, tmp_path):
    err = one_error(finetune, capsys, tmp_path, f"model.path={tmp_path / 'nowhere'}")
    assert "model.path=" in err and "does not exist" in err


def test_gguf_file_missing(finetune, capsys, tmp_path):
    err = one_error(finetune, capsys, tmp_path, f"model.path={tmp_path}", "model.gguf_file=model.gguf")
    assert "model.gguf_file=model.gguf does not exist" in err


def test_gguf_file_that_is_not_gguf(finetune, capsys, tmp_path):
    (tmp_path / "model.gguf").write_text("not a gguf")
    err = one_error(finetune, capsys, tmp_path, f"model.gguf_file={tmp_path / 'model.gguf'}")
    assert "is not a GGUF file" in err


def test_base_model_of_an_architecture_without_a_causal_lm(finetune, capsys, tmp_path):
    from transformers import T5Config, T5ForConditionalGeneration

    T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8)).save_pretrained(
        tmp_path / "t5")
    err = one_error(finetune, capsys, tmp_path, f"model.path={tmp_path / 't5'}")
    assert err.startswith(f"error: model.path={tmp_path / 't5'} could not be loaded (Unrecognized configuration class")
    assert "AutoModelForCausalLM" in err


def test_chat_records_without_messages(finetune, capsys, tmp_path, tiny_base, chatml_file):
    data = write_jsonl(tmp_path / "chat.jsonl", [{"text": "hello"}] * 4)
    err = one_error(finetune, capsys, tmp_path, f"model.path={tiny_base}", "data.format=chat",
                    f"data.path={data}", f"data.chat_template={chatml_file}", "data.append_stop=true")
    assert "record 0 has keys ['text']" in err and "`messages`" in err


@pytest.mark.parametrize(("fmt", "record", "said"), [
    ("chat", {"text": "hello"}, "record 0 has keys ['text']; a chat record needs `messages`"),
    ("preference", {"prompt": "Hi", "chosen": "Hello"}, "record 0 lacks `rejected`"),
])
def test_records_that_cannot_train_are_refused_before_the_model_loads(finetune, capsys, tmp_path, fmt, record, said):
    """A wrong shape costs seconds, not a model load: the base named here is a folder transformers cannot load, and
    the error is still the records'."""
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "config.json").write_text("{}")
    data = write_jsonl(tmp_path / "records.jsonl", [record] * 4)
    err = one_error(finetune, capsys, tmp_path, f"model.path={tmp_path / 'base'}", f"data.format={fmt}",
                    f"data.path={data}", *(["train.objective=dpo", "model.loss=full"] if fmt == "preference" else []))
    assert said in err


@pytest.mark.parametrize("fmt", ["chat", "preference"])
def test_a_source_of_a_mixture_is_checked_before_the_model_loads_too(finetune, capsys, tmp_path, fmt):
    """Each of data.sources is read and checked before the base loads, as data.path is; the error names the source's
    key. The base named is a folder transformers cannot load."""
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "config.json").write_text("{}")
    good = write_jsonl(tmp_path / "good.jsonl", [{"prompt": "Hi", "chosen": "Hello", "rejected": "Go"} if fmt ==
                                                 "preference" else {"prompt": "Hi", "completion": "Hello"}] * 4)
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"conversation": [{"from": "human", "value": "Hi"}]}] * 4)
    err = one_error(finetune, capsys, tmp_path, f"model.path={tmp_path / 'base'}", f"data.format={fmt}",
                    f"data.sources=[{{name: good, path: {good}}}, {{name: bad, path: {bad}}}]",
                    *(["train.objective=dpo", "model.loss=full"] if fmt == "preference" else []))
    assert err.startswith(f"error: data.sources[1].path={bad}: record 0 ")


def test_chat_message_with_an_unknown_role(finetune, capsys, tmp_path, tiny_base, chatml_file):
    record = {"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "hello"}]}
    data = write_jsonl(tmp_path / "chat.jsonl", [record] * 4)
    err = one_error(finetune, capsys, tmp_path, f"model.path={tiny_base}", "data.format=chat",
                    f"data.path={data}", f"data.chat_template={chatml_file}", "data.append_stop=true")
    assert "turn 1 of `messages` has role 'bot'" in err and "system, user, assistant" in err


def test_chat_data_that_is_not_utf8(finetune, capsys, tmp_path, tiny_base, chatml_file):
    record = {"messages": [{"role": "user", "content": "caf\u00e9?"}, {"role": "assistant", "content": "yes"}]}
    data = tmp_path / "chat.jsonl"
    data.write_bytes((json.dumps(record, ensure_ascii=False) + "\n").encode("latin-1"))  # é is byte 0xe9
    err = one_error(finetune, capsys, tmp_path, f"model.path={tiny_base}", "data.format=chat",
                    f"data.path={data}", f"data.chat_template={chatml_file}", "data.append_stop=true")
    assert err == (
        f"error: data.path={data} is not UTF-8 text (byte 0xe9 at offset 46, line 1); re-encode it as UTF-8, "
        "e.g. iconv -f latin1 -t utf-8"
    )


def test_tokenizer_without_chat_template(finetune, capsys, tmp_path, tiny_base):
    err = one_error(finetune, capsys, tmp_path, f"model.path={tiny_base}", "data.format=chat")
    assert "has no chat template; set data.chat_template" in err


def test_lora_targets_that_match_nothing(finetune, capsys, tmp_path, tiny_base):
    err = one_error(finetune, capsys, tmp_path, f"model.path={tiny_base}", "adapter.target_modules=[c_attn,q_proj]")
    assert "adapter.target_modules ['c_attn'] match no layer of this LlamaForCausalLM" in err
    assert "q_proj" in err and "down_proj" in err  # what exists


def test_qlora_without_bitsandbytes(finetune, capsys, tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    err = one_error(finetune, capsys, tmp_path, "adapter.method=qlora")
    assert "adapter.method=qlora needs bitsandbytes; pip install -e '.[qlora]'" in err


def test_overlong_conversations_are_counted_in_the_log(finetune, capsys, tmp_path, tiny_base, chatml_file):
    short = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    long = {"messages": [{"role": "user", "content": "Explain"}, {"role": "assistant", "content": "word " * 200}]}
    data = write_jsonl(tmp_path / "chat.jsonl", [short] * 6 + [long] * 2)
    common = [f"model.path={tiny_base}", "data.format=chat", f"data.chat_template={chatml_file}", "data.append_stop=true",
              f"data.path={data}", "data.seq_len=64", "data.val_fraction=0", "train.global_batch_size=2"]
    code, out, err = run(finetune, capsys, tmp_path, *common, "data.overlong=drop")
    assert code == 0, err[-2000:]
    assert "2 training conversations are longer than data.seq_len=64 and were 2 dropped (data.overlong=drop)" in out + err
    assert "packed 6 of 8 conversations" in out + err
    code, out, err = run(finetune, capsys, tmp_path, *common, "data.overlong=truncate", "overwrite=true")
    assert code == 0, err[-2000:]
    assert "2 training conversations are longer than data.seq_len=64 and were 2 truncated (data.overlong=truncate)" \
        in out + err
    assert "packed 8 of 8 conversations" in out + err
    # a question longer than the block: truncated, nothing of its answer is left, so it is dropped, and said so (the
    # line said "truncated" of conversations the packing line counted as dropped)
    asks = {"messages": [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "Yes."}]}
    write_jsonl(tmp_path / "chat.jsonl", [short] * 6 + [long] * 2 + [asks])
    code, out, err = run(finetune, capsys, tmp_path, *common, "data.overlong=truncate", "overwrite=true")
    assert code == 0, err[-2000:]
    assert ("3 training conversations are longer than data.seq_len=64 and were 2 truncated and 1 dropped (no assistant "
            "token left within it) (data.overlong=truncate)") in out + err


def test_streaming_is_refused_for_fine_tuning(finetune, capsys, tmp_path):
    err = one_error(finetune, capsys, tmp_path, "data.streaming=true")
    assert err == ("error: data.streaming=true is for pretraining (recipes/pretrain.py); fine-tuning prepares its "
                   "corpus ahead: drop data.streaming")


@pytest.mark.parametrize("method", ["lora", "full"])
def test_a_base_model_the_machine_cannot_hold_or_train_is_refused_before_it_is_loaded(method, finetune, capsys,
                                                                                     tmp_path):
    """A folder with only a config.json: the refusal comes from the config alone, before any weight is read
    (loading would fail on the missing weights instead). LoRA keeps the base as it loads: 40x the free
    memory in fp32 weights is refused; a full fine-tune also trains gradients and AdamW state (16 bytes a
    weight in fp32): a base of 1/2 the free memory in weights loads, and is refused for training."""
    import psutil
    from transformers import LlamaConfig

    free = psutil.virtual_memory().available
    per_layer, ends = 4 * 4096**2 + 3 * 4096 * 11008, 2 * 32000 * 4096  # LLaMA-2-7B's widths
    weights = 40 * free if method == "lora" else free // 2
    layers = max(1, round((weights / 4 - ends) / per_layer))
    LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=layers, num_attention_heads=32,
                vocab_size=32000).save_pretrained(tmp_path / "big")
    err = one_error(finetune, capsys, tmp_path, f"model.path={tmp_path / 'big'}", f"adapter.method={method}")
    assert err.startswith(f"error: model.path={tmp_path / 'big'} has ")
    says = "loads it whole" if method == "lora" else "gradients and AdamW state"
    assert says in err and "GB available" in err, err


# --- preference tuning (data.format=preference, train.objective): docs/faults.md
PAIR = {"prompt": "How do I reverse a list?", "chosen": "Use items[::-1].", "rejected": "You cannot."}


@pytest.mark.parametrize(("overrides", "said"), [
    (["train.objective=dpo", "data.format=chat"], "train.objective=dpo trains on preference pairs; set "
                                                  "data.format=preference"),
    (["data.format=preference"], "data.format=preference holds pairs to prefer, not text to imitate; set "
                                 "train.objective to dpo, simpo or orpo"),
    (["train.objective=dpo", "data.format=preference", "train.beta=0"], "train.beta=0.0 must be > 0"),
    (["train.objective=dpo", "data.format=preference", "train.gamma=0.5"], "train.gamma=0.5 is simpo's; "
     "train.objective=dpo does not use it: drop it, or set train.objective=simpo"),
    (["train.objective=simpo", "data.format=preference", "train.orpo_lambda=0.2"], "train.orpo_lambda=0.2 is orpo's; "
     "train.objective=simpo does not use it: drop it, or set train.objective=orpo"),
    (["train.beta=0.1"], "train.beta=0.1 is a preference objective's; train.objective=sft does not use it: drop it, "
     "or set train.objective to dpo, simpo or orpo"),
    (["train.objective=dpo", "data.format=preference", "model.loss=chunked"],
     "train.objective=dpo scores each answer from the full logits: model.loss=chunked is not supported with it "
     "yet; use model.loss=full"),
])
def test_preference_settings_that_contradict(finetune, capsys, tmp_path, overrides, said):
    assert said in one_error(finetune, capsys, tmp_path, *overrides)


@pytest.mark.parametrize(("records", "said"), [
    ([PAIR, {"prompt": "Hi", "chosen": "Hello"}], "record 1 lacks `rejected` (has ['chosen', 'prompt']); a "
                                                  "preference record needs `prompt`, `chosen` and `rejected`"),
    ([{**PAIR, "prompt": [{"role": "assistant", "content": "Hi"}]}], "record 0: the prompt's last message is the "
                                                                     "assistant's; end it with the user's turn"),
    ([{**PAIR, "chosen": {"role": "user", "content": "x"}}], "record 0: the answer of `chosen` (its last "
                                                             "message) has role 'user'; an answer is the assistant's"),
    ([{**PAIR, "rejected": PAIR["chosen"]}, {**PAIR, "chosen": " "}], "2 preference records: 1 with chosen equal to "
                                                                      "rejected and 1 with an empty answer left out: "
                                                                      "none has two different, non-empty answers"),
])
def test_preference_records_that_cannot_train(finetune, capsys, tmp_path, records, said):
    path = write_jsonl(tmp_path / "pairs.jsonl", records)
    err = one_error(finetune, capsys, tmp_path, "train.objective=dpo", "data.format=preference", "model.loss=full",
                    f"data.path={path}")
    assert said in err


def test_samples_past_the_base_models_positions_are_refused_before_any_sample(finetune, capsys, tmp_path, tiny_base):
    """Generated before and after training: past the positions a model has, hours of generation or a failure."""
    err = one_error(finetune, capsys, tmp_path, f"model.path={tiny_base}", "samples.max_new_tokens=1000000")
    assert "samples.max_new_tokens=1000000 is more than the base model's" in err and "or 0 for no samples" in err
