"""Tokenize documents and pack them into fixed-length blocks that keep documents apart.

Each document becomes `tokens + [EOS]`; documents are laid end to end and cut every `seq_len`
tokens. Every block carries `position_ids` that restart at 0 where a document starts (and at
the start of each block), which is all a model needs to keep attention inside documents, told
in the way each attention implementation reads it (`attention_inputs`):

- sdpa: `block_causal_mask` turns position ids into a 4-D boolean block-diagonal causal mask.
  Position ids alone are NOT enough under sdpa/eager when the model keeps a KV cache
  (measured: logit error 0.41).
- flex_attention: transformers reads the boundaries from `position_ids` and builds a document
  BlockMask (sparse: blocks across documents are skipped, not computed and masked). Only when
  the forward runs without a KV cache, which is why `toolkit.models.loss` passes `use_cache=False`.
- flash_attention_2/3: transformers' varlen path reads the boundaries from `position_ids`, but
  only for a batch of one row; with more rows it silently runs plain causal attention over each
  row. The micro-batch is therefore flattened into one row of B x seq_len tokens (each block
  starts a document, so the rows stay apart too).

Nothing is dropped: the last block is padded, and padding is a separate segment that no real
token attends to and no loss is computed on (`num_tokens` says where real tokens end).
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import torch

from toolkit.config import UserError

IGNORE_INDEX = -100
PACKING_VERSION = "1"
# Attention implementations that can keep packed documents apart, and how they are told.
MASKED_ATTENTION = {"sdpa"}  # a 4-D boolean mask
POSITION_ATTENTION = {"flex_attention"}  # position ids, one row per block
VARLEN_ATTENTION = {"flash_attention_2", "flash_attention_3"}  # position ids, the blocks in one row


def check_attention(attn_implementation: str) -> None:
    if attn_implementation not in MASKED_ATTENTION | POSITION_ATTENTION | VARLEN_ATTENTION:
        raise UserError(
            f"model.attn_implementation={attn_implementation} cannot keep packed documents apart "
            "(eager ignores boolean 4-D masks, measured logit error 0.48); use sdpa, flex_attention, or "
            "flash_attention_2 on GPU"
        )


def tokenize_documents(
    docs: datasets.Dataset, tokenizer, num_proc: int = 1, cache_file: str | None = None
) -> datasets.Dataset:
    """`text` -> `input_ids` (each document followed by EOS), batched and multi-process."""
    eos = tokenizer.eos_token_id
    backend = getattr(tokenizer, "backend_tokenizer", None)

    def encode(batch):
        if backend is not None and hasattr(backend, "encode_batch_fast"):
            # The Rust tokenizer directly: the transformers wrapper also builds attention masks
            # and a BatchEncoding per batch that packing throws away (measured: 25% of the time).
            ids = [e.ids for e in backend.encode_batch_fast(batch["text"], add_special_tokens=False)]
        else:
            ids = tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
        return {"input_ids": [x + [eos] for x in ids]}

    num_proc = num_proc if len(docs) >= 2 * num_proc and num_proc > 1 else None
    return docs.map(
        encode,
        batched=True,
        batch_size=256,
        num_proc=num_proc,
        remove_columns=docs.column_names,
        cache_file_name=cache_file,
        desc="tokenizing",
    )


def pack_documents(tokenized: datasets.Dataset, seq_len: int, pad_id: int) -> datasets.Dataset:
    """Lay token lists end to end and cut into blocks of `seq_len` (vectorized, no Python loop)."""
    # `[:]` through the arrow format honours an indices mapping (select/shuffle); `.data` would not
    column = tokenized.with_format("arrow")[:].column("input_ids").combine_chunks()
    flat = column.flatten().to_numpy(zero_copy_only=False).astype(np.int32)
    offsets = column.offsets.to_numpy()
    lengths = np.diff(offsets)
    total = int(flat.size)
    if total == 0:
        raise UserError("the corpus tokenized to 0 tokens; check data.path and data.text_column")
    n_blocks = -(-total // seq_len)
    padded = n_blocks * seq_len

    index = np.arange(padded, dtype=np.int64)
    doc_start = np.repeat(offsets[:-1], lengths)
    pad = padded - total
    if pad:  # the padding tail is a segment of its own
        doc_start = np.concatenate([doc_start, np.full(pad, total)])
        flat = np.concatenate([flat, np.full(pad, pad_id, dtype=np.int32)])
    block_start = (index // seq_len) * seq_len
    position_ids = (index - np.maximum(doc_start, block_start)).astype(np.int32)
    num_tokens = np.full(n_blocks, seq_len, dtype=np.int32)
    num_tokens[-1] = seq_len - pad

    table = pa.table(
        {
            "input_ids": pa.FixedSizeListArray.from_arrays(pa.array(flat), seq_len),
            "position_ids": pa.FixedSizeListArray.from_arrays(pa.array(position_ids), seq_len),
            "num_tokens": pa.array(num_tokens),
        }
    )
    return datasets.Dataset(table)


def packed_dataset(
    docs: datasets.Dataset, tokenizer, seq_len: int, cache_root: Path, source_fingerprint: str, num_proc: int = 1
) -> datasets.Dataset:
    """Tokenize + pack, cached on disk under a fingerprint of (source, tokenizer, seq_len)."""
    key = _fingerprint(source_fingerprint, tokenizer, seq_len, len(docs))
    target = cache_root / f"packed-{key}"
    if (target / "dataset_info.json").is_file():
        return datasets.load_from_disk(str(target))
    tokenized = tokenize_documents(docs, tokenizer, num_proc)
    blocks = pack_documents(tokenized, seq_len, tokenizer.pad_token_id)
    tmp = cache_root / f".packed-{key}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    blocks.save_to_disk(str(tmp))
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return datasets.load_from_disk(str(target))


def packed_splits(train_docs: datasets.Dataset, val_docs: datasets.Dataset | None, tokenizer, cfg, source: str, seed: int):
    """(train blocks, held-out blocks or None) of a split corpus, packed once into the cache.

    `cfg` is the recipe's data section (seq_len, val_fraction, num_proc, cache_dir); the cache
    key names the corpus, the split seed and the held-out fraction."""
    cache = cfg.resolved_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    split_key = f"{source}-seed{seed}-val{cfg.val_fraction}"
    train = packed_dataset(train_docs, tokenizer, cfg.seq_len, cache, f"{split_key}-train", cfg.num_proc)
    val = None
    if val_docs is not None:
        val = packed_dataset(val_docs, tokenizer, cfg.seq_len, cache, f"{split_key}-val", cfg.num_proc)
    return train, val


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, L) position ids -> which document of its row each token is in (positions restart at 0 per document)."""
    return torch.cumsum(position_ids == 0, dim=1)


def block_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, L) position ids -> (B, 1, L, L) boolean mask: causal, and only within a document."""
    segment = document_ids(position_ids)
    same = segment[:, :, None] == segment[:, None, :]
    length = position_ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    return (same & causal)[:, None]


def labels_for(input_ids: torch.Tensor, position_ids: torch.Tensor, num_tokens: torch.Tensor) -> torch.Tensor:
    """Next-token labels (unshifted, as transformers expects) with cross-document targets masked.

    A token that starts a document cannot be predicted from the previous document, and padding
    is never a target.
    """
    labels = input_ids.long().clone()
    labels[position_ids == 0] = IGNORE_INDEX
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    labels[positions[None, :] >= num_tokens[:, None]] = IGNORE_INDEX
    return labels


def target_counts(blocks: datasets.Dataset) -> np.ndarray:
    """Number of loss targets per block (what the loss is normalised by)."""
    pos = column(blocks, "position_ids")
    n = column(blocks, "num_tokens")
    idx = np.arange(pos.shape[1])
    valid = (pos != 0) & (idx[None, :] < n[:, None])
    valid[:, 0] = False  # the first label of a block has no prediction (shifted away)
    return valid.sum(axis=1).astype(np.int64)


def column(blocks: datasets.Dataset, name: str) -> np.ndarray:
    """One column of a packed dataset as a numpy array ((n, seq_len) for token columns)."""
    return blocks.select_columns([name]).with_format("numpy")[:][name]


def collate(columns: dict, attn_implementation: str) -> dict[str, torch.Tensor]:
    """Columns of packed blocks (`blocks[indices]`) -> model inputs for the attention kind."""
    input_ids = torch.as_tensor(np.asarray(columns["input_ids"]), dtype=torch.long)
    position_ids = torch.as_tensor(np.asarray(columns["position_ids"]), dtype=torch.long)
    num_tokens = torch.as_tensor(np.asarray(columns["num_tokens"]), dtype=torch.long)
    batch = {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "labels": labels_for(input_ids, position_ids, num_tokens),
    }
    return attention_inputs(batch, attn_implementation)


def attention_inputs(batch: dict[str, torch.Tensor], attn_implementation: str) -> dict[str, torch.Tensor]:
    """A collated batch (input_ids, position_ids, labels; B x L) as the attention kind needs it."""
    if attn_implementation in MASKED_ATTENTION:
        batch["attention_mask"] = block_causal_mask(batch["position_ids"])
    elif attn_implementation in VARLEN_ATTENTION:
        # A row's first label is never a target (the shift drops it); ignoring it keeps the last
        # token of one row from predicting the first of the next once the rows are one.
        batch["labels"][:, 0] = IGNORE_INDEX
        batch = {k: v.reshape(1, -1) for k, v in batch.items()}
    return batch


def _fingerprint(source: str, tokenizer, seq_len: int, n_docs: int) -> str:
    vocab = tokenizer.backend_tokenizer.to_str() if hasattr(tokenizer, "backend_tokenizer") else repr(tokenizer)
    h = hashlib.sha256()
    for part in (PACKING_VERSION, source, vocab, str(tokenizer.eos_token_id), str(seq_len), str(n_docs)):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]
