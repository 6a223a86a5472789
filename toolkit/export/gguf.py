"""A Hugging Face model folder as one GGUF file, for llama.cpp and Ollama.

Everything about the format comes from the `gguf` package (names, metadata keys, block quantisers, the writer).
What this module decides: LLaMA's q/k rows interleaved for llama.cpp's rotary, which tensors stay f32 or fall
back to f16 or q8_0, tied embeddings, the byte-level BPE tokenizer (an unknown pre-tokenizer refused), and a
write under a temporary name, renamed at the end.
Each decision and why: docs/internals.md, toolkit/export/gguf.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from toolkit.config.errors import UserError, first_line
from toolkit.data.chat import own_template
from toolkit.data.template_check import end_of_turn
from toolkit.export.destination import EXPORTED_BY

try:
    import gguf
    from gguf import GGMLQuantizationType as QT
except ImportError:  # the module imports; write_gguf says what to install
    gguf = None

# output type -> (tensor type, llama.cpp file type); best quality first
GGUF_TYPES: dict[str, tuple] = (
    {
        "f32": (QT.F32, gguf.LlamaFileType.ALL_F32),
        "f16": (QT.F16, gguf.LlamaFileType.MOSTLY_F16),
        "bf16": (QT.BF16, gguf.LlamaFileType.MOSTLY_BF16),
        "q8_0": (QT.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
        "q5_1": (QT.Q5_1, gguf.LlamaFileType.MOSTLY_Q5_1),
        "q5_0": (QT.Q5_0, gguf.LlamaFileType.MOSTLY_Q5_0),
        "q4_1": (QT.Q4_1, gguf.LlamaFileType.MOSTLY_Q4_1),
        "q4_0": (QT.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0),
    }
    if gguf is not None
    else {}
)
# transformers class (config.json "architectures") -> llama.cpp architecture
SUPPORTED_ARCHITECTURES: dict[str, object] = (
    {"LlamaForCausalLM": gguf.MODEL_ARCH.LLAMA, "Qwen2ForCausalLM": gguf.MODEL_ARCH.QWEN2}
    if gguf is not None
    else {}
)

# transformers' tokenizer.json pre-tokenizers -> llama.cpp's `tokenizer.ggml.pre` names
_GPT2_BYTE_LEVEL = "gpt-2"
_DIGITS_THEN_BYTE_LEVEL = "smollm"
_LOW_BIT = ("q5_1", "q5_0", "q4_1", "q4_0")
_SKIPPED = ("rotary_emb.inv_freq",)  # recomputed by every runtime, not a weight


def write_gguf(model_dir: Path, out_file: Path, quant: str = "f16", notes: list[str] | None = None) -> Path:
    """Write `model_dir` (config.json, *.safetensors, tokenizer) as the GGUF `out_file`; returns it.

    Lines worth showing the user (fallback types, kept tensors) are appended to `notes` if given.
    """
    if gguf is None:
        raise UserError(
            "GGUF export needs the gguf package; pip install 'llm-toolkit[smollm2]' (or pip install gguf)"
        )
    model_dir, out_file = Path(model_dir).expanduser(), Path(out_file).expanduser()
    if quant not in GGUF_TYPES:
        raise UserError(f"GGUF type {quant!r} is not offered; use one of {', '.join(GGUF_TYPES)}")
    if out_file.is_dir():
        raise UserError(
            f"GGUF output {out_file} is a folder; give a file name such as {out_file / 'model.gguf'}"
        )
    config, arch = _read_config(model_dir)
    vocab = _read_vocab(model_dir, config.vocab_size)
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise UserError(
            f"{model_dir} has no *.safetensors weights; save the model with save_pretrained(safe_serialization=True)"
        )
    notes = notes if notes is not None else []

    out_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_file.with_name(f".{out_file.name}.{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(tmp, gguf.MODEL_ARCH_NAMES[arch])
    try:
        _add_model_metadata(writer, config, arch, model_dir, quant)
        _add_tokenizer(writer, vocab)
        _add_tensors(writer, shards, config, arch, quant, notes)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, out_file)
    finally:
        writer.close()
        tmp.unlink(missing_ok=True)
    return out_file


def _read_config(model_dir: Path) -> tuple[object, object]:
    """(transformers config, llama.cpp architecture), or a UserError saying what is missing."""
    from transformers import AutoConfig

    if not (model_dir / "config.json").is_file():
        if (model_dir / "final" / "config.json").is_file():
            hint = f"it looks like a run folder; use {model_dir / 'final'}"
        elif (model_dir / "adapter_config.json").is_file():
            hint = "it holds a LoRA adapter; export the merged model (the run's final/, written with adapter.merge=true)"
        else:
            hint = "give a Hugging Face model folder such as a run's final/"
        raise UserError(f"{model_dir} has no config.json, so it is not a Hugging Face model folder; {hint}")
    try:
        config = AutoConfig.from_pretrained(str(model_dir))
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(f"{model_dir}/config.json could not be read ({first_line(exc)})") from None
    return config, gguf_architecture(config, str(model_dir))


def gguf_architecture(config, where: str):
    """The llama.cpp architecture a transformers config exports as, or a UserError naming `where`
    (checked before any work: the export stages the model first)."""
    by_type = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}  # for a config without architectures
    found = (getattr(config, "architectures", None) or [by_type.get(config.model_type, config.model_type)])[0]
    if found not in SUPPORTED_ARCHITECTURES:
        raise UserError(
            f"{where} holds a {found}; GGUF export supports {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise UserError(f"{where} uses rope scaling {rope_type!r}; GGUF export writes only default rope")
    if getattr(config, "use_sliding_window", False):
        raise UserError(f"{where} uses sliding-window attention, which llama.cpp's qwen2 does not run")
    return SUPPORTED_ARCHITECTURES[found]


def _read_vocab(model_dir: Path, n_vocab: int) -> dict:
    """Tokens padded to the embedding rows, their types, merges, special ids and flags."""
    from transformers import AutoTokenizer

    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise UserError(
            f"{model_dir} has no tokenizer.json; save the (fast) tokenizer into it with tokenizer.save_pretrained"
        )
    spec = json.loads(path.read_text(encoding="utf-8"))
    model, decoder = spec.get("model") or {}, spec.get("decoder") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback") or decoder.get("type") != "ByteLevel":
        raise UserError(
            f"{path} is a {model.get('type')} tokenizer with a {decoder.get('type')} decoder; GGUF export "
            "writes byte-level BPE tokenizers (GPT-2 style) only"
        )
    pre = _pre_tokenizer_name(spec.get("pre_tokenizer"))
    if pre is None:
        raise UserError(
            f"{path}: pre-tokenizer {json.dumps(spec.get('pre_tokenizer'))[:120]} has no llama.cpp name known to "
            "the exporter, which would split text differently; use a GPT-2, SmolLM, Qwen2 or Llama-3 style tokenizer"
        )
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    ids = tokenizer.get_vocab()
    if max(ids.values()) >= n_vocab:
        raise UserError(
            f"{model_dir}: the tokenizer has ids up to {max(ids.values())} but the model only {n_vocab} embeddings; "
            "save the tokenizer the model was trained with"
        )
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]  # rows no token uses: llama.cpp wants one token per row
    types = [gguf.TokenType.UNUSED] * n_vocab
    for text, i in ids.items():
        tokens[i], types[i] = text, gguf.TokenType.NORMAL
    for i, added in tokenizer.added_tokens_decoder.items():
        types[i] = gguf.TokenType.CONTROL if added.special else gguf.TokenType.USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    with_special = tokenizer("a").input_ids
    plain = tokenizer("a", add_special_tokens=False).input_ids
    added_first = len(with_special) > len(plain) and with_special[0] != plain[0]
    added_last = len(with_special) > len(plain) and with_special[-1] != plain[-1]
    return {
        "pre": pre,
        "tokens": tokens,
        "types": types,
        "merges": merges,
        "special": {**{k: getattr(tokenizer, f"{k}_token_id") for k in ("bos", "eos", "unk", "pad")},
                    "eot": end_of_turn_id(tokenizer)},
        "add_bos": added_first and with_special[0] == tokenizer.bos_token_id,
        "add_eos": added_last and with_special[-1] == tokenizer.eos_token_id,
        "chat_template": _chat_template(tokenizer),
    }


def end_of_turn_id(tokenizer) -> int | None:
    """The id of the chat template's end-of-turn token where it is not the EOS (Llama-3's `<|eot_id|>`): llama.cpp
    stops a chat turn at it. None where the EOS ends a turn (ChatML on SmolLM2) or no special token does."""
    template = own_template(tokenizer)
    end = end_of_turn(tokenizer, template) if template else None
    return end if end != tokenizer.eos_token_id else None


def _chat_template(tokenizer) -> str | list[dict[str, str]] | None:
    """The template text, or llama.cpp's list of named templates where the tokenizer has several."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return [{"name": name, "template": text} for name, text in template.items()]
    return template or None


def _pre_tokenizer_name(pre: dict | None) -> str | None:
    if pre is None:
        return None
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return _GPT2_BYTE_LEVEL
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
    kinds = [s.get("type") for s in steps]
    if (
        kinds == ["Digits", "ByteLevel"]
        and steps[0].get("individual_digits")
        and steps[1].get("use_regex", True)
    ):
        return _DIGITS_THEN_BYTE_LEVEL
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        return _split_names().get((steps[0].get("pattern") or {}).get("Regex"))
    return None


def _split_names() -> dict[str, str]:
    """Split regex -> llama.cpp pre-tokenizer name, as transformers' GGUF loader maps them back."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
    except ImportError:  # transformers before 5.x has no table: only the byte-level ones above
        return {}
    names: dict[str, str] = {}
    for name, regex in GGUF_PRE_TOKENIZER_SPLITS.items():
        names.setdefault(regex, name)  # the first name of each regex is llama.cpp's usual one
    return names


def _add_model_metadata(writer, config, arch, model_dir: Path, quant: str) -> None:
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rope = getattr(config, "rope_parameters", None) or {}
    name = model_dir.parent.name if model_dir.name == "final" else model_dir.name
    writer.add_name(name or "model")
    writer.add_quantized_by(EXPORTED_BY)  # what lets a later --overwrite replace this file (toolkit.export.destination)
    writer.add_file_type(GGUF_TYPES[quant][1])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", None) or heads)
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(config.vocab_size)
    if arch == gguf.MODEL_ARCH.LLAMA:
        writer.add_rope_dimension_count(head_dim)
    if head_dim != config.hidden_size // heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)


def _add_tokenizer(writer, vocab: dict) -> None:
    writer.add_tokenizer_model("gpt2")  # llama.cpp's name for byte-level BPE
    writer.add_tokenizer_pre(vocab["pre"])
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types(vocab["types"])
    writer.add_token_merges(vocab["merges"])
    for kind, token_id in vocab["special"].items():
        if token_id is not None:
            getattr(writer, f"add_{kind}_token_id")(token_id)
    writer.add_add_bos_token(vocab["add_bos"])
    writer.add_add_eos_token(vocab["add_eos"])
    if vocab["chat_template"]:
        writer.add_chat_template(vocab["chat_template"])


def _add_tensors(writer, shards: list[Path], config, arch, quant: str, notes: list[str]) -> None:
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    output = "token_embd.weight" if tied else "output.weight"
    fell_back, kept = [], []
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            for hf_name in f.keys():
                if hf_name.endswith(_SKIPPED) or (tied and hf_name == "lm_head.weight"):
                    continue
                name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
                if name is None:
                    raise UserError(
                        f"{shard.name}: tensor {hf_name} has no llama.cpp {gguf.MODEL_ARCH_NAMES[arch]} name; "
                        "the model differs from a plain one of its class and cannot be exported"
                    )
                data = f.get_tensor(hf_name).to(torch.float32).numpy()
                if arch == gguf.MODEL_ARCH.LLAMA and ".attn_q." in name:
                    data = _interleave_rope_rows(data, heads)
                elif arch == gguf.MODEL_ARCH.LLAMA and ".attn_k." in name:
                    data = _interleave_rope_rows(data, kv_heads)
                qtype = _tensor_type(data, name == output or name.endswith(_SENSITIVE), quant)
                if data.ndim > 1 and qtype == QT.F16 and quant != "f16":
                    fell_back.append(name)
                elif data.ndim > 1 and qtype == QT.Q8_0 and quant != "q8_0":
                    kept.append(name)
                writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    if fell_back:
        block = gguf.GGML_QUANT_SIZES[GGUF_TYPES[quant][0]][0]
        notes.append(
            f"GGUF {quant}: {len(fell_back)} matrices (e.g. {fell_back[0]}) have rows that are not a multiple of "
            f"{block} values, the {quant} block, and are stored as f16"
        )
    if kept:
        notes.append(
            f"GGUF {quant}: {len(kept)} matrices kept at q8_0 (the output projection {output} and the attention-value "
            "and MLP-down matrices), as llama.cpp's mixed 4-bit types keep them wider: on SmolLM2 this takes q4_0 "
            "from +16.5% to +3.2% held-out perplexity for 21% more bytes"
        )


# Kept at q8_0 under 4-5 bits as well: the attention values and MLP down projections, the
# matrices llama.cpp's mixed types (Q4_K_M) also keep wider, and the ones whose error shows most.
_SENSITIVE = (".attn_v.weight", ".ffn_down.weight")


def _tensor_type(data: np.ndarray, is_output: bool, quant: str):
    """f32 for 1-D tensors, q8_0 for the output and the _SENSITIVE matrices under 4-5 bits, f16 where
    rows do not fill whole blocks."""
    if data.ndim < 2:
        return QT.F32  # norms and biases: tiny, and llama.cpp computes them in f32
    qtype = QT.Q8_0 if is_output and quant in _LOW_BIT else GGUF_TYPES[quant][0]
    if data.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
        return QT.F16
    return qtype


def _interleave_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Per head, rows [x0..x(d/2-1), y0..y(d/2-1)] -> [x0, y0, x1, y1, ...] (rotate-half -> adjacent pairs)."""
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, head_dim // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
