"""A GGUF Gemma 4 vocabulary (`tokenizer.ggml.model` "gemma4": tokens, `tokenizer.ggml.merges`,
`tokenizer.ggml.token_type`, as llama.cpp's convert_hf_to_gguf.py writes it) as a `tokenizers`
Tokenizer that tokenizes as llama.cpp does (src/llama-vocab.cpp: a BPE vocabulary whose
pre-tokenizer is "gemma4"):

- control, unknown and user-defined tokens are cut out of the raw text first (added tokens);
- every space becomes U+2581, and no space is put in front;
- the text is split into runs of newlines and runs of anything else;
- each run is merged pairwise by the file's merge ranks; a character that is no token is written as
  its UTF-8 bytes' <0xXX> tokens (byte fallback);
- llama.cpp looks a run of newlines up whole before merging it: where a newline-only token is one
  its merges do not build, that lookup is not reproduced, and the file is refused by name;
- BOS is always added (llama.cpp forces it for Gemma 4).
"""

from __future__ import annotations

from typing import Any

from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from .gguf_sentencepiece import add_typed_tokens

_SPACE = "\u2581"
# what llama.cpp takes as ending generation in a Gemma 4 vocabulary, by the token's text
GEMMA4_END_TEXTS = ("<eos>", "<turn|>", "<|tool_response>")


def build_gemma4_tokenizer(meta: dict[str, Any]) -> HFTokenizer:
    """The `tokenizers` Tokenizer of the Gemma 4 vocabulary in GGUF metadata `meta`."""
    tokens: list[str] = [str(t) for t in meta["tokenizer.ggml.tokens"]]
    types = [int(t) for t in meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)]
    if len(types) != len(tokens):
        raise ValueError(f"GGUF gemma4 vocabulary: {len(types)} token types for {len(tokens)} tokens")
    if meta.get("tokenizer.ggml.add_space_prefix"):
        raise ValueError("GGUF gemma4 vocabulary with tokenizer.ggml.add_space_prefix=true is not supported")
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # llama.cpp's text -> id map keeps the first
    merges: list[tuple[str, str]] = []
    seen: set[tuple[str, str]] = set()
    for m in meta.get("tokenizer.ggml.merges") or []:
        left, space, right = str(m)[1:].partition(" ")  # split at the first space after the first character
        pair = (str(m)[0] + left, right)
        if space and pair not in seen:  # a repeated pair keeps its first rank
            seen.add(pair)
            merges.append(pair)
    bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=True, ignore_merges=False)
    _check_newline_runs(bpe, vocab)
    tok = HFTokenizer(bpe)
    tok.normalizer = normalizers.Replace(" ", _SPACE)
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("\n+"), behavior="isolated")
    tok.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    add_typed_tokens(tok, tokens, types)
    return tok


def _check_newline_runs(bpe: models.BPE, vocab: dict[str, int]) -> None:
    """llama.cpp takes a run of newlines that is a token whole; the merges give the same where they
    build each such token from its newlines."""
    for text, token_id in vocab.items():
        if text and set(text) == {"\n"}:
            got = [t.id for t in bpe.tokenize(text)]
            if got != [token_id]:
                raise ValueError(
                    f"GGUF gemma4 vocabulary: the newline run {text!r} is token {token_id}, which its merges do not "
                    f"build (they give {got}); llama.cpp's whole-run lookup is not reproduced here"
                )
