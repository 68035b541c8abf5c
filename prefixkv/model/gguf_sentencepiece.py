"""A GGUF SentencePiece vocabulary (`tokenizer.ggml.model` "llama": tokens, `tokenizer.ggml.scores`,
`tokenizer.ggml.token_type`, as llama.cpp's convert_hf_to_gguf.py writes Gemma, Llama 2, Mistral,
TinyLlama ...) as a `tokenizers` Tokenizer that tokenizes as llama.cpp's llm_tokenizer_spm does.

llama.cpp's algorithm, and how it is expressed here:
- control, unknown and user-defined tokens are cut out of the raw text first (added tokens; control
  and unknown ones special), the rest is tokenized fragment by fragment;
- a fragment at the start or right after such a token gets a space in front when
  `tokenizer.ggml.add_space_prefix` (default true; Gemma's files say false): the normalizer's
  Prepend, which `tokenizers` applies to each piece between added tokens;
- every space becomes U+2581;
- the fragment's characters are merged pairwise, always the adjacent pair whose concatenation is
  the vocabulary token of highest score: BPE merges, one per way of cutting a token into two
  tokens, ranked by the whole token's score;
- a character that is no token is written as its UTF-8 bytes' <0xXX> tokens (byte fallback).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from tokenizers import AddedToken, decoders, models, normalizers
from tokenizers import Tokenizer as HFTokenizer

# llama.cpp token types (gguf.TokenType)
TT_NORMAL = 1
TT_UNKNOWN = 2
TT_CONTROL = 3
TT_USER_DEFINED = 4
TT_UNUSED = 5
TT_BYTE = 6

logger = logging.getLogger("prefixkv")

_SPACE = "\u2581"
# llama.cpp's defaults for a SentencePiece vocabulary whose file names no such token
SPM_DEFAULT_IDS = {"bos": 1, "eos": 2}
# tokens llama.cpp takes as end of turn when the file names no eot_token_id (it looks them up by text)
EOT_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "<end_of_utterance>",
)


def _check_supported(meta: dict[str, Any], tokens: list[str], scores: list[float], types: list[int]) -> None:
    """Refuse by name what would make these ids differ from llama.cpp's / sentencepiece's."""
    if len(scores) != len(tokens) or len(types) != len(tokens):
        raise ValueError(
            "GGUF SentencePiece vocabulary: tokenizer.ggml.scores and tokenizer.ggml.token_type must give one "
            f"value per token ({len(tokens)} tokens, {len(scores)} scores, {len(types)} types)"
        )
    if meta.get("tokenizer.ggml.precompiled_charsmap"):
        raise ValueError(
            "GGUF SentencePiece vocabulary with a tokenizer.ggml.precompiled_charsmap: its text normalization "
            "is not implemented here"
        )
    if meta.get("tokenizer.ggml.remove_extra_whitespaces"):
        raise ValueError(
            "GGUF SentencePiece vocabulary with tokenizer.ggml.remove_extra_whitespaces: collapsing whitespace "
            "is not implemented here"
        )
    name = str(meta.get("general.name") or "").lower()
    if "phi-3" in name or "phi3" in name:
        raise ValueError(
            f"GGUF SentencePiece vocabulary of a model named {meta.get('general.name')!r}: llama.cpp strips the "
            "whitespace after special tokens for models named phi-3 (RSTRIP), which is not implemented here"
        )
    known = {f"<0x{b:02X}>" for b in range(256)}
    missing = known - set(tokens)
    if missing:
        raise ValueError(
            "GGUF SentencePiece vocabulary without byte fallback: "
            f"{len(missing)} of the tokens <0x00>..<0xFF> are missing (e.g. {min(missing)}); a character "
            "outside the vocabulary could not be encoded"
        )


def _merges(vocab: dict[str, int], scores: list[float], added: set[int]) -> list[tuple[str, str]]:
    """Every cut of a token into two tokens, best-scoring whole token first. llama.cpp breaks a
    tie between equal scores by position (the leftmost pair); a rank cannot, so equal-score tokens
    go in id order (a SentencePiece BPE model's merge order; its pieces' scores all differ), and
    the cuts of one token longer left part first (of two overlapping pairs making that token, the
    leftmost). A vocabulary with equal-score tokens is logged, but for the `added` ones (cut out of
    the text before any merge)."""
    ranked: list[tuple[float, int, int, int, str, str]] = []
    for token, i in vocab.items():
        n = len(token)
        for k in range(1, n):
            left = token[:k]
            if left in vocab:
                right = token[k:]
                if right in vocab:
                    ranked.append((-scores[i], i, -k, k - n, left, right))
    ranked.sort()
    per_score = Counter(score for score, i in {(r[0], r[1]) for r in ranked} if i not in added)
    tied = sum(n for n in per_score.values() if n > 1)
    if tied:
        logger.warning(
            "GGUF SentencePiece vocabulary: %d merge-made tokens share a score with another; they merge in id "
            "order, where llama.cpp takes the leftmost pair, so a text where two of them overlap may get other ids",
            tied,
        )
    return [(left, right) for *_, left, right in ranked]


def build_spm_tokenizer(meta: dict[str, Any]) -> HFTokenizer:
    """The `tokenizers` Tokenizer of the SentencePiece vocabulary in GGUF metadata `meta`."""
    tokens: list[str] = [str(t) for t in meta["tokenizer.ggml.tokens"]]
    scores = [float(s) for s in meta.get("tokenizer.ggml.scores") or []]
    types = [int(t) for t in meta.get("tokenizer.ggml.token_type") or []]
    _check_supported(meta, tokens, scores, types)
    add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))

    # a text that appears twice keeps its last id, as llama.cpp's token_to_id map does
    vocab = {t: i for i, t in enumerate(tokens)}
    added = {i for i, ty in enumerate(types) if ty in (TT_CONTROL, TT_UNKNOWN, TT_USER_DEFINED)}
    unk = next((t for t, ty in zip(tokens, types) if ty == TT_UNKNOWN), None)
    tok = HFTokenizer(
        models.BPE(vocab=vocab, merges=_merges(vocab, scores, added), unk_token=unk, fuse_unk=False, byte_fallback=True)
    )
    replace = normalizers.Replace(" ", _SPACE)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE), replace]) if add_space_prefix else replace
    steps: list[Any] = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:  # the prefix added in front of the text is not part of it
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    add_typed_tokens(tok, tokens, types)
    return tok


def add_typed_tokens(tok: HFTokenizer, tokens: list[str], types: list[int]) -> None:
    """Cut control and unknown tokens (special) and user-defined ones out of the raw text before
    the model sees it, as llama.cpp's tokenizer_st_partition does."""
    special = [
        AddedToken(t, normalized=False, special=True)
        for t, ty in zip(tokens, types)
        if ty in (TT_CONTROL, TT_UNKNOWN) and t
    ]
    if special:
        tok.add_special_tokens(special)
    user = [
        AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types) if ty == TT_USER_DEFINED and t
    ]
    if user:
        tok.add_tokens(user)
