"""The tokenizer: load one, or train a byte-level BPE on the corpus with `tokenizers`."""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from toolkit.config.declarations import ALWAYS, IDS, Need, refused
from toolkit.config.errors import ConfigError, UserError, first_line
from toolkit.config.files import read_json
from toolkit.config.load import field
from toolkit.config.values import path_problems
from toolkit.data.hub import hub_unreachable
from toolkit.data.packing import document_pieces
from toolkit.run.lock import one_writer
from toolkit.run.paths import READ
from toolkit.run.writes import writing

EOS = "<|endoftext|>"
PAD = "<|pad|>"
STREAM_DOCUMENTS = 10_000  # a streamed corpus cannot be read whole first: its BPE learns from its head


TRAINED = Need("tokenizer.path", (None,), "for a tokenizer the run trains")  # a BPE's settings


@dataclass
class TokenizerConfig:
    path: str | None = field(None, help="tokenizer folder or hub id; empty = train a byte-level BPE on the corpus",
                             resume=refused(IDS), used_when=ALWAYS, path=READ,
                             accepts={"unset": "a BPE trained on the corpus: the default"})
    vocab_size: int = field(4096, help="vocabulary size when training a BPE", resume=refused(IDS), used_when=TRAINED)
    min_frequency: int = field(2, help="minimum pair frequency for a BPE merge", resume=refused(IDS),
                               used_when=TRAINED, accepts={"0": "no minimum: as 1", "2**31": "no pair merges: a "
                                                           "byte-level vocabulary, whose size the run says"})
    train_documents: int = field(
        0, help="documents a BPE learns from: a seeded sample of the training split (0 = all of it; with "
        f"data.streaming, the {STREAM_DOCUMENTS:,} after the held-out ones)", resume=refused(IDS), used_when=TRAINED,
        accepts={"0": "all of them, as documented", "2**31": "all of them"},
    )

    def validate(self) -> list[str]:
        problems = path_problems(self, ("path",))
        if self.path is None and not 256 + 2 <= self.vocab_size <= 1_000_000:
            problems.append(f"vocab_size={self.vocab_size} must be between 258 (bytes + special tokens) and 1000000")
        if self.min_frequency < 0:  # the BPE trainer takes an unsigned count: a traceback once the corpus is read
            problems.append(f"min_frequency={self.min_frequency} must be 0 or more")
        if self.train_documents < 0:
            problems.append(f"train_documents={self.train_documents} must be 0 (all) or more")
        return problems

    def key(self) -> str:
        """What a trained BPE depends on besides the corpus (its cache folder's name)."""
        sample = f"-d{self.train_documents}" if self.train_documents else ""
        return f"v{self.vocab_size}-f{self.min_frequency}{sample}"


def train_bpe(corpus: datasets.Dataset, vocab_size: int, min_frequency: int = 2) -> PreTrainedTokenizerFast:
    """Byte-level BPE (GPT-2 style): every byte is reachable, so no text is ever <unk>."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def batches():
        # a long document in pieces (as packing tokenizes it): the trainer pre-tokenizes a string whole
        for start in range(0, len(corpus), 1000):
            yield [piece for text in corpus[start : start + 1000]["text"] for piece in document_pieces(text)]

    tok.train_from_iterator(batches(), trainer=trainer, length=len(corpus))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=PAD)


def local_files_only(path: str) -> bool:
    """Load `path` (a folder or a hub id) from local files only: a hub id while the Hub cannot be reached,
    so that a copy in the hub cache loads at once and a missing one fails at once."""
    hub_id = re.fullmatch(r"[\w.-]+(/[\w.-]+)?", path) and not path.startswith((".", "~"))
    return bool(hub_id) and not Path(path).expanduser().exists() and hub_unreachable() is not None


def offline_hint(key: str, path: str) -> str:
    return (f"{key}={path} is read as a hub id, but the Hub cannot be reached ({hub_unreachable()}) and it is not "
            "in the local hub cache; give a local folder, or load it once with a network (it is then cached)")


# the JSON files of a tokenizer folder, read strictly before transformers reads them: not UTF-8 (UTF-16 named), binary,
# truncated, of another top-level type, a key twice, each one line naming the file (transformers raises whatever
# json, tokenizers or its own code meets first: a TypeError for a list where an object is)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


# the files one of which holds a tokenizer's vocabulary (fast; GPT-2-style BPE; sentencepiece; WordPiece): a folder
# with none (tokenizer_config.json alone, a copy cut short) was "Couldn't instantiate the backend tokenizer from one of: "
VOCABULARY_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model", "spiece.model", "vocab.txt")


def check_tokenizer_files(path: str, key: str = "tokenizer.path") -> None:
    folder = Path(path).expanduser()
    for name in TOKENIZER_FILES if folder.is_dir() else ():
        if (folder / name).is_file():
            try:
                read_json(folder / name, f"a tokenizer's {name}")
            except ConfigError as exc:
                raise UserError(f"{key}={path}: {exc}; save the tokenizer again (save_pretrained) or give "
                                "another folder") from None


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    check_tokenizer_files(path)
    folder = Path(path).expanduser()
    if folder.is_dir() and not any((folder / name).is_file() for name in VOCABULARY_FILES):
        found = sorted(p.name for p in folder.iterdir())
        raise UserError(f"tokenizer.path={path} holds no tokenizer's vocabulary ({' or '.join(VOCABULARY_FILES[:3])}; "
                        f"it has {', '.join(found[:6]) or 'nothing'}{', …' if len(found) > 6 else ''}); copy the whole "
                        "folder save_pretrained wrote, or give another")
    offline = local_files_only(path)
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=offline)
    except Exception as exc:  # OSError, ValueError, and whatever a file of the right JSON but wrong fields raises
        if offline:
            raise UserError(offline_hint("tokenizer.path", path)) from None
        raise UserError(f"tokenizer.path={path} could not be loaded ({first_line(exc)}); give a tokenizer folder or hub "
                        "id") from None
    if tok.eos_token_id is None:
        raise UserError(f"tokenizer.path={path} has no EOS token; packing needs one to separate documents")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token  # only fills the tail of the last block, which is masked out
    return tok


def get_tokenizer(cfg: TokenizerConfig, corpus: datasets.Dataset, cache: Path) -> PreTrainedTokenizerBase:
    """Load `cfg.path`, or train a BPE once per (corpus, cfg.key()) and reuse it from `cache`."""
    if cfg.path:
        return load_tokenizer(cfg.path)
    if (cache / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(str(cache))
    with one_writer(cache.with_name(f".{cache.name}.lock")):  # another run may be training this one now
        if (cache / "tokenizer.json").is_file():  # ... and has finished it
            return AutoTokenizer.from_pretrained(str(cache))
        if 0 < cfg.train_documents < len(corpus):  # in corpus order, for the memory map's sake
            pick = np.random.default_rng(0).choice(len(corpus), cfg.train_documents, replace=False)
            corpus = corpus.select(np.sort(pick))
        tok = train_bpe(corpus, cfg.vocab_size, cfg.min_frequency)
        tmp = cache.with_name(cache.name + ".tmp")
        for left in (tmp, cache):  # what a run killed while saving left (no tokenizer.json in `cache`: not read)
            shutil.rmtree(left, ignore_errors=True)
        with writing("tokenizer cache", tmp):  # a failed write: one line, the .tmp removed
            tok.save_pretrained(str(tmp))
            tmp.rename(cache)
        return tok
