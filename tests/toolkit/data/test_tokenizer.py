"""The tokenizer: a byte-level BPE trained on the corpus, saved, and loaded back by path."""

from __future__ import annotations

import datasets
import pytest

from toolkit.config.errors import UserError
from toolkit.data.tokenizer import TokenizerConfig, get_tokenizer, load_tokenizer, train_bpe

TEXT = "def main():\n    print('héllo, wörld')  # ünïcode and emoji 🙂\n"


@pytest.fixture(scope="module")
def corpus():
    from pydoc_data.topics import topics

    return datasets.Dataset.from_dict({"text": [topics[k] for k in sorted(topics)][:20]})


def test_trained_bpe_round_trips_any_text_and_has_the_asked_size(corpus):
    tok = train_bpe(corpus, vocab_size=600)
    assert len(tok) == 600
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == TEXT  # byte-level: nothing is <unk>, even unseen characters
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token_id != tok.eos_token_id


def test_saved_tokenizer_loads_by_path_with_the_same_ids(corpus, tmp_path):
    tok = train_bpe(corpus, vocab_size=600)
    tok.save_pretrained(tmp_path / "tok")
    loaded = get_tokenizer(TokenizerConfig(path=str(tmp_path / "tok")), corpus, tmp_path / "unused")
    assert loaded(TEXT)["input_ids"] == tok(TEXT)["input_ids"]
    assert not (tmp_path / "unused").exists()


def test_training_happens_once_per_cache_key(corpus, tmp_path, monkeypatch):
    cfg = TokenizerConfig(vocab_size=600)
    first = get_tokenizer(cfg, corpus, tmp_path / "tok-key")
    monkeypatch.setattr("toolkit.data.tokenizer.train_bpe", lambda *a, **k: pytest.fail("trained twice"))
    again = get_tokenizer(cfg, corpus, tmp_path / "tok-key")
    assert again(TEXT)["input_ids"] == first(TEXT)["input_ids"]


def test_missing_tokenizer_path_is_one_clear_error(tmp_path):
    with pytest.raises(UserError, match="tokenizer.path=.*could not be loaded"):
        load_tokenizer(str(tmp_path / "nope"))


@pytest.mark.parametrize("left", [["tokenizer_config.json"], []])
def test_a_folder_without_the_vocabulary_names_what_it_holds(corpus, tmp_path, left):
    """A tokenizer folder copied without tokenizer.json was 'could not be loaded (Couldn't instantiate the backend
    tokenizer from one of: )' (issue 44's probe)."""
    train_bpe(corpus, vocab_size=600).save_pretrained(tmp_path / "tok")
    for f in (tmp_path / "tok").iterdir():
        if f.name not in left:
            f.unlink()
    with pytest.raises(UserError) as refused:
        load_tokenizer(str(tmp_path / "tok"))
    assert str(refused.value) == (
        f"tokenizer.path={tmp_path / 'tok'} holds no tokenizer's vocabulary (tokenizer.json or vocab.json or "
        f"tokenizer.model; it has {', '.join(left) or 'nothing'}); copy the whole folder save_pretrained wrote, or give "
        "another")


def test_a_bpe_can_learn_from_a_seeded_sample_of_the_documents(corpus, tmp_path, monkeypatch):
    """tokenizer.train_documents: a corpus of billions of tokens trains its BPE on a sample, the same on every run."""
    seen, train = [], train_bpe
    monkeypatch.setattr("toolkit.data.tokenizer.train_bpe", lambda c, *a: (seen.append(c["text"]), train(c, *a))[1])
    cfg = TokenizerConfig(vocab_size=600, train_documents=7)
    get_tokenizer(cfg, corpus, tmp_path / "a")
    get_tokenizer(cfg, corpus, tmp_path / "b")
    assert len(seen[0]) == 7 and seen[0] == seen[1]
    assert seen[0] == [t for t in corpus["text"] if t in seen[0]]  # in corpus order
    assert cfg.key() != TokenizerConfig(vocab_size=600).key()  # a sample is cached apart from the whole
    get_tokenizer(TokenizerConfig(vocab_size=600, train_documents=50), corpus, tmp_path / "c")
    assert seen[2] == corpus["text"]  # more than there are: all of them


@pytest.fixture
def no_network(monkeypatch):
    """The Hub unreachable, without HF_HUB_OFFLINE=1 (a laptop on a train): connections fail."""
    import socket
    import time

    import huggingface_hub

    from toolkit.data import tokenizer

    def refused(*args, **kwargs):
        time.sleep(0.1)
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(socket, "create_connection", refused)
    tokenizer.hub_unreachable.cache_clear()
    yield
    tokenizer.hub_unreachable.cache_clear()


def test_a_hub_tokenizer_while_offline_is_one_line_at_once(no_network):
    """It took ~45 s of the hub client's retries before the error; one connection tried, then the cache."""
    import time

    start = time.monotonic()
    with pytest.raises(UserError) as err:
        load_tokenizer("nobody-org/no-such-tokenizer")
    assert time.monotonic() - start < 5
    assert str(err.value) == (
        "tokenizer.path=nobody-org/no-such-tokenizer is read as a hub id, but the Hub cannot be reached (huggingface.co: "
        "Name or service not known) and it is not in the local hub cache; give a local folder, or load it once with a "
        "network (it is then cached)")


def test_two_runs_training_one_tokenizer_at_once_train_it_once(corpus, tmp_path, monkeypatch, at_once):
    """Two runs started together on one data.cache_dir (~/.cache/llm-toolkit by default): both trained the BPE into
    one `.tmp` folder, and the second crashed with `OSError: Directory not empty`, leaving it (issue 44). The second
    now waits for the first and reads its tokenizer."""
    import time

    trained, train = [], train_bpe
    monkeypatch.setattr("toolkit.data.tokenizer.train_bpe",
                        lambda *a: (trained.append(1), time.sleep(0.3), train(*a))[2])
    got, failed = at_once(lambda: get_tokenizer(TokenizerConfig(vocab_size=600), corpus, tmp_path / "tok-key"))
    assert not failed, failed
    assert len(trained) == 1
    assert got[0](TEXT)["input_ids"] == got[1](TEXT)["input_ids"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tok-key"]  # no .tmp, no lock file
