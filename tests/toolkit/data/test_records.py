"""toolkit/data/records.py: chat records in the shapes and files users keep them in, read into role/content messages."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest

from toolkit.config.errors import UserError
from toolkit.data.chat import ChatDataConfig, chat_blocks, tokenize_conversations
from toolkit.data.packing import IGNORE_INDEX
from toolkit.data.records import FORMATS, read_records, shape_of, shapes_said, to_messages

CONVERSATION = [
    {"role": "system", "content": "You answer questions about Python."},
    {"role": "user", "content": "How do I reverse a list?"},
    {"role": "assistant", "content": "items[::-1] gives a reversed copy; items.reverse() reverses in place."},
    {"role": "user", "content": "And a string?"},
    {"role": "assistant", "content": "text[::-1]: strings have no reverse method."},
]
SHAREGPT_FROM = {"system": "system", "user": "human", "assistant": "gpt"}

# the same conversation in each shape, as the data sets in the wild write it
SHAPES = {
    "messages": {"messages": CONVERSATION, "source": "kept as it is"},
    "sharegpt": {"id": "a1", "conversations": [{"from": SHAREGPT_FROM[m["role"]], "value": m["content"]}
                                               for m in CONVERSATION]},
    "alpaca": {"system": CONVERSATION[0]["content"], "instruction": CONVERSATION[1]["content"], "input": "",
               "output": CONVERSATION[2]["content"]},
    "prompt_completion": {"prompt": CONVERSATION[:4], "completion": CONVERSATION[4:]},
}


def test_every_shape_is_listed_and_named_by_the_config():
    import typing

    from toolkit.training.recipe_config import FinetuneDataConfig

    assert set(SHAPES) == set(FORMATS)
    for config in (ChatDataConfig, FinetuneDataConfig):
        assert typing.get_args(typing.get_type_hints(config)["record_format"]) == ("auto", *FORMATS)
    from toolkit.data.mixture import SourceConfig  # a mixture source's own (empty: data.record_format)

    own, none = typing.get_args(typing.get_type_hints(SourceConfig)["record_format"])
    assert typing.get_args(own) == ("auto", *FORMATS) and none is type(None)


@pytest.mark.parametrize("shape", FORMATS)
def test_each_shape_becomes_the_conversation_it_holds(shape):
    expected = {"messages": CONVERSATION, "sharegpt": CONVERSATION, "alpaca": CONVERSATION[:3],
                "prompt_completion": CONVERSATION}[shape]
    assert shape_of(SHAPES[shape]) == shape
    assert to_messages(SHAPES[shape], 0, shape) == to_messages(SHAPES[shape], 0) == expected


def test_prompt_and_completion_as_strings_are_a_user_and_an_assistant_turn():
    assert to_messages({"prompt": "2 + 2?", "completion": "4"}, 0) == [
        {"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}]


def test_under_auto_each_record_is_read_by_its_own_shape_and_the_log_counts_them():
    records = [SHAPES["sharegpt"], SHAPES["alpaca"], SHAPES["sharegpt"]]
    assert [to_messages(r, i) for i, r in enumerate(records)] == [CONVERSATION, CONVERSATION[:3], CONVERSATION]
    assert shapes_said(records) == "3 records: 2 ShareGPT (conversations of from/value), 1 Alpaca (instruction/input/output)"
    assert shapes_said(records[:1], "sharegpt") == "1 records, ShareGPT (conversations of from/value) (data.record_format)"


@pytest.mark.parametrize(("records", "named", "says"), [
    ([SHAPES["sharegpt"], SHAPES["alpaca"]], "sharegpt",
     r"record 1 has keys \['input', 'instruction', 'output', 'system'\], not a ShareGPT \(conversations of from/value\) "
     r"record \(data.record_format\); use record_format=auto"),
    ([{"conversations": [{"from": "narrator", "value": "Once"}]}], "auto",
     r"record 0: turn 0 of `conversations` has from 'narrator'; use one of system, human, user, gpt"),
    ([{"conversations": [{"from": "human", "value": 3}]}], "auto", r"record 0: turn 0 of `conversations` \(human\) has no text"),
    ([{"text": "a"}], "auto", r"record 0 has keys \['text'\]; a chat record needs `messages`"),
    (["just a string"], "auto", r"record 0 has no keys \(a str\); a chat record needs"),
    # a parquet whose writer took its columns from another record's shape: the columns are there, their values null
    ([{"messages": None, "instruction": "Hi", "output": None}], "auto",
     r"record 0 has keys \['instruction'\] \(messages, output: null\) \(nearly Alpaca \(instruction/input/output\): "
     r"it lacks `output`\); a chat record needs"),
    # the shape that nearly fits: a key one slip away, a list of turns under a name of its own
    ([{"conversation": [{"from": "human", "value": "Hi"}]}], "auto",
     r"record 0 has keys \['conversation'\] \(did you mean `conversations` for `conversation`\?\)"),
    ([{"prompt": "Hi", "chosen": "Hello", "rejected": "Go away"}], "auto",
     r"\(a preference pair: train on it with data.format=preference and a train.objective\)"),
    ([{"dialog": [{"speaker": "A", "text": "Hi"}]}], "auto",
     r"\(`dialog` holds a list of turns: name it with data.columns.conversation, and its keys with columns.role and "
     r"columns.content\)"),
])
def test_a_record_that_does_not_fit_is_one_line_naming_it(records, named, says):
    with pytest.raises(UserError, match=says) as info:
        for i, record in enumerate(records):
            to_messages(record, i, None if named == "auto" else named)
    assert "\n" not in str(info.value)


def write(tmp_path, kind: str, records: list[dict]) -> str:
    """`records` in a file or folder of `kind`, as users keep them."""
    ds = datasets.Dataset.from_list(records)
    if kind == "save_to_disk":
        ds.save_to_disk(str(tmp_path / "saved"))
        return str(tmp_path / "saved")
    path = tmp_path / f"records.{kind}"
    if kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    elif kind == "json":
        path.write_text(json.dumps(records))
    elif kind == "parquet":
        ds.to_parquet(str(path))
    elif kind == "csv":
        ds.to_csv(str(path), index=False)
    else:  # arrow: datasets' own file format
        import pyarrow as pa

        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, ds.data.table.schema) as writer:
            writer.write_table(ds.data.table)
    return str(path)


@pytest.mark.parametrize(("kind", "shape"), [("jsonl", "sharegpt"), ("parquet", "messages"), ("json", "alpaca"),
                                             ("csv", "alpaca"), ("arrow", "prompt_completion"),
                                             ("save_to_disk", "sharegpt")])
def test_records_are_read_from_the_files_users_keep(tmp_path, kind, shape, capfd):
    """A ShareGPT jsonl, an OpenAI messages parquet, Alpaca json and csv, prompt/completion arrow, a save_to_disk
    folder: the same conversations come back (parquet and arrow add the columns other records have, as None), and
    datasets' progress bar for a file read in a moment is not printed."""
    records = [SHAPES[shape], SHAPES[shape]]
    path = write(tmp_path, kind, records)
    capfd.readouterr()
    read = read_records(path, "chat")
    assert [to_messages(r, i) for i, r in enumerate(read)] == \
        [to_messages(r, i) for i, r in enumerate(records)]
    assert capfd.readouterr().err == ""


@pytest.mark.parametrize("kind", ["jsonl", "json", "csv"])
def test_records_saved_with_a_utf8_byte_order_mark_are_read(tmp_path, kind):
    """Notepad and Excel's "CSV UTF-8" begin a file with a byte-order mark; the corpus reader and the config take it,
    and json.loads refused it: 'line 1 is not valid JSON: Unexpected UTF-8 BOM' for a good chat file (issue 44)."""
    records = [SHAPES["sharegpt"], SHAPES["alpaca"]] if kind != "csv" else [SHAPES["alpaca"]] * 2
    path = Path(write(tmp_path, kind, records))
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    read = read_records(str(path), "chat")
    assert [to_messages(r, i) for i, r in enumerate(read)] == [to_messages(r, i) for i, r in enumerate(records)]


def test_a_file_that_is_not_its_suffix_is_one_line(tmp_path):
    (tmp_path / "broken.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(UserError, match=r"broken.parquet is not a parquet file: it is text") as info:
        read_records(str(tmp_path / "broken.parquet"), "chat")
    assert "\n" not in str(info.value)
    with pytest.raises(UserError, match=r"has suffix .txt; use one of .jsonl, .json, .parquet, .csv, .arrow"):
        (tmp_path / "chats.txt").write_text("hi")
        read_records(str(tmp_path / "chats.txt"), "chat")


def test_a_sharegpt_file_trains_on_the_assistants_turns_only(tmp_path, chat_tokenizer):
    """The loss goes on the assistant's content and end of turn, as for the same conversation in `messages`: token
    for token the same labels; the log says the shape it found."""
    path = write(tmp_path, "jsonl", [SHAPES["sharegpt"]] * 4)
    train, _, notes = chat_blocks(ChatDataConfig(path=path, seq_len=256, val_fraction=0), chat_tokenizer, 0)
    assert notes[0] == "4 records: 4 ShareGPT (conversations of from/value)"
    same = tokenize_conversations([SHAPES["messages"]], chat_tokenizer)
    ids, labels = same[0]["input_ids"], same[0]["labels"]
    targets = [t for t, y in zip(ids, labels, strict=True) if y != IGNORE_INDEX]
    assert chat_tokenizer.decode(targets).count("<|im_end|>") == 2  # both assistant turns, nothing else
    block = train[0]
    assert block["input_ids"][: len(ids)] == ids and block["labels"][: len(ids)] == labels


def test_a_folder_or_glob_of_files_is_read_in_name_order(tmp_path, monkeypatch):
    """Shards as users keep them (part-0.parquet, part-1.parquet, ...): one source, every file in name order."""
    (tmp_path / "shards").mkdir()
    datasets.Dataset.from_list([SHAPES["sharegpt"]]).to_parquet(str(tmp_path / "shards" / "part-1.parquet"))
    datasets.Dataset.from_list([SHAPES["messages"]]).to_parquet(str(tmp_path / "shards" / "part-0.parquet"))
    (tmp_path / "shards" / "notes.txt").write_text("not read")
    expected = [shape_of(SHAPES["messages"]), shape_of(SHAPES["sharegpt"])]
    assert [shape_of(r) for r in read_records(str(tmp_path / "shards"), "chat")] == expected
    assert [shape_of(r) for r in read_records(str(tmp_path / "shards" / "part-*.parquet"), "chat")] == expected
    with pytest.raises(UserError, match=r"data.path=.*part-\*.jsonl matches no file; give a .jsonl/"):
        read_records(str(tmp_path / "shards" / "part-*.jsonl"), "chat")
    with pytest.raises(UserError, match=r"data.path=.*nowhere.jsonl does not exist; give a"):
        read_records(str(tmp_path / "nowhere.jsonl"), "chat")
    with pytest.raises(UserError, match=r"data.path=shards/part-2 does not exist; give a"):  # a typo, not a hub id
        monkeypatch.chdir(tmp_path)
        read_records("shards/part-2", "chat")


def test_a_held_out_file_of_its_own_is_read_whole_and_checked_before_the_model(tmp_path, chat_tokenizer):
    """data.val_path in place of val_fraction: every record of data.path trains, every one of data.val_path is held
    out (said in the log); a bad held-out record is refused naming data.val_path, before any model loads."""
    from toolkit.data.records import check_first_records
    from toolkit.training.recipe_config import FinetuneDataConfig

    train = write(tmp_path, "jsonl", [SHAPES["sharegpt"]] * 6)
    (tmp_path / "held").mkdir()
    held = write(tmp_path / "held", "parquet", [SHAPES["messages"]] * 2)
    cfg = ChatDataConfig(path=train, val_path=held, seq_len=256, val_fraction=0.5)
    blocks, val, notes = chat_blocks(cfg, chat_tokenizer, 0)
    assert notes[1:3] == ["left out, the chat template rendering nothing of them: `id` in 6 records",
                          "held-out (data.val_path): left out, the chat template rendering nothing of them: `source` "
                          "in 2 records"]
    assert notes[3].startswith("train: packed 6 of 6 conversations")
    assert notes[4].startswith(f"held-out (data.val_path={held}): packed 2 of 2 conversations")
    bad = write(tmp_path, "json", [SHAPES["messages"], {"text": "hi"}])
    with pytest.raises(UserError, match=rf"^data.val_path={bad}: record 1 has keys \['text'\]; a chat record needs"):
        check_first_records(FinetuneDataConfig(format="chat", path=train, val_path=bad))


def test_a_hub_dataset_is_read_by_its_split_from_a_folder_laid_out_as_the_hub_lays_it(tmp_path, monkeypatch):
    """Offline, a local copy of a hub dataset repository (its README.md card, data/<split>-*.parquet): the split asked
    for, and only it; a hub id that cannot be reached is one line."""
    repo = tmp_path / "org--chats"
    (repo / "data").mkdir(parents=True)
    (repo / "README.md").write_text("---\nlicense: mit\n---\n# chats\n")
    datasets.Dataset.from_list([SHAPES["sharegpt"]] * 3).to_parquet(str(repo / "data" / "train-00000-of-00001.parquet"))
    test = {"id": "t", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]}
    datasets.Dataset.from_list([test] * 2).to_parquet(str(repo / "data" / "test-00000-of-00001.parquet"))
    assert read_records(str(repo), "chat") == [SHAPES["sharegpt"]] * 3
    assert read_records(str(repo), "chat", split="test") == [test] * 2
    with pytest.raises(UserError, match=r"could not be read as a hub dataset \(split=validation\): .*validation"):
        read_records(str(repo), "chat", split="validation")
    import huggingface_hub

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # as HF_HUB_OFFLINE=1 at start-up sets them
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UserError, match=r"^data.path=nobody/no-such-chats \(no local file or folder has that name\) ") \
            as info:
        read_records("nobody/no-such-chats", "chat")
    assert "\n" not in str(info.value)


def test_records_of_another_shape_are_read_by_the_columns_named():
    """data.columns: the turns' column, the keys of a turn, and the speakers' own names (a support-desk export here)."""
    from toolkit.data.records import ColumnsConfig

    columns = ColumnsConfig(conversation="dialog", role="speaker", content="text", user="customer", assistant="agent")
    record = {"ticket": 7, "dialog": [{"speaker": "customer", "text": "My order is late."},
                                      {"speaker": "agent", "text": "It ships today."}]}
    assert to_messages(record, 0, None, columns) == [{"role": "user", "content": "My order is late."},
                                                     {"role": "assistant", "content": "It ships today."}]
    assert shapes_said([record], "auto", columns) == "1 records, turns in `dialog` (data.columns)"
    with pytest.raises(UserError, match=r"record 3 has keys \['ticket'\], no `dialog` \(data.columns.conversation\)"):
        to_messages({"ticket": 8}, 3, None, columns)
    with pytest.raises(UserError, match=r"record 0: turn 1 of `dialog` has speaker 'bot'; use one of system, customer, "
                                        r"agent"):
        to_messages({"dialog": [record["dialog"][0], {"speaker": "bot", "text": "x"}]}, 0, None, columns)
    with pytest.raises(UserError, match=r"record 0 has no 'agent' turn \(data.columns.assistant\)"):
        to_messages({"dialog": record["dialog"][:1]}, 0, None, columns)


def test_the_first_records_check_reads_a_held_out_hub_folder_as_training_does(tmp_path):
    """data.split names data.path's hub split; data.val_path is read whole as its train split, by the blocks and by the
    check before the model alike (the check asked the held-out folder for data.split's split, which it need not have)."""
    from toolkit.data.records import check_first_records
    from toolkit.training.recipe_config import FinetuneDataConfig

    repo = tmp_path / "held"
    (repo / "data").mkdir(parents=True)
    (repo / "README.md").write_text("# held-out chats\n")
    datasets.Dataset.from_list([SHAPES["sharegpt"]] * 2).to_parquet(str(repo / "data" / "train-00000-of-00001.parquet"))
    check_first_records(FinetuneDataConfig(format="chat", path=write(tmp_path, "jsonl", [SHAPES["messages"]]),
                                           val_path=str(repo), split="test"))


# Records as the sets users bring write them: a ShareGPT jsonl (SlimOrca's shape: a system turn, ids), OpenAI messages
# in a parquet, Alpaca jsonl (alpaca-cleaned's, one with a system prompt), TRL's preference parquet (ultrafeedback
# binarized: whole conversations and their scores), and UltraChat 200k laid out as the hub lays it out (its card's
# configs name the split train_sft; its records hold `prompt` and `prompt_id` beside `messages`).
QUESTIONS = [("How do I reverse a list?", "items[::-1] gives a reversed copy."),
             ("And a string?", "text[::-1]: strings have no reverse method."),
             ("What does zip do?", "It pairs the items of its arguments: zip([1, 2], 'ab') gives (1, 'a'), (2, 'b').")]
SYSTEM = "You answer questions about Python."


def _as_users_keep_them(folder: Path, fmt: str) -> tuple[str, dict, list[list[dict]]]:
    """(data path, the ChatDataConfig's other settings, each record's conversation as the template renders it)."""
    turns = [[{"role": "user", "content": q}, {"role": "assistant", "content": a}] for q, a in QUESTIONS]
    chats = [[{"role": "system", "content": SYSTEM}, *turns[0], *turns[1]], turns[2]]
    if fmt == "sharegpt_jsonl":
        said = {"system": "system", "user": "human", "assistant": "gpt"}
        records = [{"id": f"orca-{i}", "conversations": [{"from": said[m["role"]], "value": m["content"]} for m in c]}
                   for i, c in enumerate(chats)]
        return write(folder, "jsonl", records), {}, chats
    if fmt == "messages_parquet":
        return write(folder, "parquet", [{"messages": c, "source": "written here"} for c in chats]), {}, chats
    if fmt == "alpaca_jsonl":
        records = [{"instruction": "Reverse this list.", "input": "[1, 2, 3]", "output": "[3, 2, 1]"},
                   {"system": SYSTEM, "instruction": QUESTIONS[2][0], "input": "", "output": QUESTIONS[2][1]}]
        return write(folder, "jsonl", records), {}, [
            [{"role": "user", "content": "Reverse this list.\n\n[1, 2, 3]"}, {"role": "assistant", "content": "[3, 2, 1]"}],
            [{"role": "system", "content": SYSTEM}, *turns[2]]]
    if fmt == "hub_folder":
        repo = folder / "HuggingFaceH4--ultrachat_200k"
        (repo / "data").mkdir(parents=True)
        (repo / "README.md").write_text("---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train_sft\n"
                                        "    path: data/train_sft-*\n  - split: test_sft\n    path: data/test_sft-*\n"
                                        "---\n# UltraChat 200k\n")
        for split, these in (("train_sft", chats), ("test_sft", [turns[0]])):
            datasets.Dataset.from_list([{"prompt": c[-2]["content"], "prompt_id": str(i), "messages": c}
                                        for i, c in enumerate(these)]).to_parquet(
                str(repo / "data" / f"{split}-00000-of-00001-0a1b2c3d.parquet"))
        return str(repo), {"split": "train_sft"}, chats
    # TRL's preference parquet: each answer after the conversation both share
    records = [{"chosen": [*c[:-1], c[-1]], "rejected": [*c[:-1], {"role": "assistant", "content": "No idea."}],
                "score_chosen": 9.0, "score_rejected": 2.0} for c in chats]
    write(folder, "parquet", records)
    return str(folder / "records.parquet"), {}, [[*r[k][:-1], r[k][-1]] for r in records for k in ("chosen", "rejected")]


def _labels_as_the_template_marks_them(tokenizer, messages: list[dict], last_only: bool) -> tuple[list, list]:
    """(ids, labels) found apart from toolkit.data.chat: the template's text, tokenized; a token is a target when its
    characters lie inside an assistant turn's content and its <|im_end|> (the last turn's only, for a pair's answer,
    whose sequence ends there)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans, at = [], 0
    for m in messages:
        at = text.index(f"<|im_start|>{m['role']}\n", at) + len(f"<|im_start|>{m['role']}\n")
        if m["role"] == "assistant":
            assert text.startswith(m["content"] + "<|im_end|>", at)
            spans.append((at, at + len(m["content"]) + len("<|im_end|>")))
    spans = spans[-1:] if last_only else spans
    if last_only:
        text = text[:spans[-1][1]]
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    labels = [t if any(s <= a and b <= e for s, e in spans) else IGNORE_INDEX
              for t, (a, b) in zip(enc["input_ids"], enc["offset_mapping"], strict=True)]
    return enc["input_ids"], labels


@pytest.mark.parametrize("fmt", ["sharegpt_jsonl", "messages_parquet", "alpaca_jsonl", "trl_preference_parquet",
                                 "hub_folder"])
def test_each_format_users_bring_packs_its_records_with_loss_on_the_assistants_turns_only(tmp_path, fmt,
                                                                                         chat_tokenizer):
    """Issue 43's formats, read as a fine-tune reads them (chat_blocks, preference_blocks): every packed document is
    its record as the chat template renders it, token for token, and its targets are exactly the assistant's
    turns' tokens (content and <|im_end|>; a pair's answer only), found here from the template's text. The chat LoRA
    trains on each: tests/recipes/test_mixture_training.py::test_a_fine_tune_mixes_chat_sets_by_weight (ShareGPT and
    messages parquets, the latter in a hub-layout folder, Alpaca jsonl) and test_preference_training.py::
    test_simpo_and_orpo_train_without_a_reference[orpo] (a TRL preference parquet)."""
    from toolkit.data.preference import preference_blocks

    path, settings, conversations = _as_users_keep_them(tmp_path, fmt)
    pairs = fmt == "trl_preference_parquet"
    cfg = ChatDataConfig(path=path, seq_len=512, val_fraction=0, **settings)
    blocks, _, notes = (preference_blocks if pairs else chat_blocks)(cfg, chat_tokenizer, 0)
    expected = {}
    for messages in conversations:
        ids, labels = _labels_as_the_template_marks_them(chat_tokenizer, messages, last_only=pairs)
        expected[tuple(ids)] = labels
    documents = []
    for block in blocks:
        used, positions = block["num_tokens"], block["position_ids"]
        starts = [i for i in range(used) if positions[i] == 0] + [used]
        documents += [(block["input_ids"][a:b], block["labels"][a:b]) for a, b in zip(starts[:-1], starts[1:], strict=True)]
    assert len(documents) == len(conversations) == len(expected)
    for ids, labels in documents:
        assert tuple(ids) in expected  # the template's own rendering, token for token
        assert labels[1:] == expected[tuple(ids)][1:]  # a document's first token has nothing before it to predict
        assert any(y != IGNORE_INDEX for y in labels)
    said = {"sharegpt_jsonl": "2 records: 2 ShareGPT (conversations of from/value)",
            "messages_parquet": "2 records: 2 messages (role/content)", "hub_folder": "2 records: 2 messages (role/content)",
            "alpaca_jsonl": "2 records: 2 Alpaca (instruction/input/output)",
            "trl_preference_parquet": "2 preference records: 0 with chosen equal to rejected and 0 with an empty answer "
                                      "left out; TRL's 2 conversational (messages), implicit prompt"}[fmt]
    assert notes[0] == said


def test_each_source_of_a_chat_mixture_reads_its_records_by_its_own_shape_or_mapping(tmp_path, chat_tokenizer):
    """data.sources for chat as for text (where each source names its text_column): a source names its own
    record_format or columns (a support-desk export mixed with ShareGPT and Alpaca sets); one naming neither reads by
    data.record_format and data.columns. Each is checked before the model and packed by its own."""
    from toolkit.config.load import load_config
    from toolkit.data.records import check_first_records
    from toolkit.training.recipe_config import FinetuneConfig

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    desk = {"ticket": 7, "dialog": [{"speaker": "customer", "text": "My order is late."},
                                    {"speaker": "agent", "text": "It ships today."}]}
    paths = {"sharegpt": write(tmp_path / "a", "jsonl", [SHAPES["sharegpt"]] * 3),
             "desk": write(tmp_path / "b", "jsonl", [desk] * 2),
             "alpaca": write(tmp_path, "parquet", [SHAPES["alpaca"]] * 2)}
    cfg = load_config(FinetuneConfig, None, [
        "data.format=chat", "data.record_format=alpaca", "data.seq_len=256", "data.val_fraction=0",
        f"data.sources=[{{name: sharegpt, path: {paths['sharegpt']}, record_format: sharegpt}}, {{name: desk, path: "
        f"{paths['desk']}, columns: {{conversation: dialog, role: speaker, content: text, user: customer, assistant: "
        f"agent}}}}, {{name: alpaca, path: {paths['alpaca']}}}]"]).data
    said = []
    for part in cfg.of_sources():
        check_first_records(part)
        said.append(chat_blocks(part.chat(), chat_tokenizer, 0)[2][0])
    assert said == ["3 records, ShareGPT (conversations of from/value) (data.record_format)",
                    "2 records, turns in `dialog` (data.columns)",
                    "2 records, Alpaca (instruction/input/output) (data.record_format)"]
