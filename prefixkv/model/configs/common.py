"""What every family's readers share: the fields each GGUF file carries alike, config.json's
floats, and the joining of field sets."""

from __future__ import annotations

from typing import Any


def gguf_common_fields(meta: dict[str, Any], tensor_names: set[str], g_arch: str) -> dict[str, Any]:
    """The vocabulary size (`<arch>.vocab_size`, else the token list's length), the layer count
    (multi-token-prediction blocks, the last `nextn_predict_layers`, not counted: llama.cpp counts
    them in `block_count`), tied embeddings (no `output.weight`) and the BOS / EOS ids of a GGUF
    file."""
    p = g_arch + "."
    vocab = meta.get(p + "vocab_size")
    if vocab is None:
        if "tokenizer.ggml.tokens" not in meta:
            raise ValueError(f"GGUF metadata has neither {p}vocab_size nor tokenizer.ggml.tokens")
        vocab = len(meta["tokenizer.ggml.tokens"])
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return dict(
        vocab_size=int(vocab),
        num_hidden_layers=int(meta[p + "block_count"]) - int(meta.get(p + "nextn_predict_layers") or 0),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=[] if eos is None else [int(eos)],
    )


def json_float(v: Any) -> float:
    """A float from config.json, where transformers 5 writes infinity as {"__float__": "Infinity"}."""
    return float(v["__float__"] if isinstance(v, dict) else v)


def join_fields(*parts: dict[str, Any]) -> dict[str, Any]:
    """The fields of every part; two parts that set one field are a reader's bug, not a choice of
    which wins."""
    joined: dict[str, Any] = {}
    for part in parts:
        both = joined.keys() & part.keys()
        if both:
            raise TypeError(f"config fields set twice: {sorted(both)}")
        joined.update(part)
    return joined
