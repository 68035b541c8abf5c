"""A Gemma 4 GGUF vocabulary ("gemma4") tokenized by llama.cpp's rules (src/llama-vocab.cpp), on a
small vocabulary whose expected ids follow those rules by hand: spaces as U+2581 with none put in
front, runs of newlines apart from the rest, merges by rank, bytes for what is no token, control
and user-defined tokens cut out first, BOS always added, <turn|> ending generation; a newline run
that is a token its merges do not build is refused by name."""

from __future__ import annotations

import pytest

from prefixkv.model.tokenizer import Tokenizer

CONTROL, USER_DEFINED, BYTE, NORMAL = 3, 4, 6, 1
SPECIAL = ["<pad>", "<eos>", "<bos>", "<turn|>", "<|channel>"]
WORDS = ["a", "b", "c", "\u2581", "\n", "ab", "\u2581a", "\n\n", "abc", "\u2581c"]
MERGES = ["a b", "\u2581 a", "\n \n", "ab c", "\u2581 c"]


def vocabulary(words: list[str] = WORDS, merges: list[str] = MERGES) -> dict:
    tokens = SPECIAL + [f"<0x{b:02X}>" for b in range(256)] + words
    types = [CONTROL] * 4 + [USER_DEFINED] + [BYTE] * 256 + [NORMAL] * len(words)
    return {
        "tokenizer.ggml.model": "gemma4",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_space_prefix": False,
    }


def ids(tok: Tokenizer, *texts: str) -> list[int]:
    index = {t: i for i, t in enumerate(vocabulary()["tokenizer.ggml.tokens"])}
    return [index[t] for t in texts]


def test_tokenized_as_llama_cpp_does():
    tok = Tokenizer.from_gguf_metadata(vocabulary())
    # "ab c" -> a b U+2581 c: a+b first (rank 0), then U+2581+c (rank 4); ab+c never meets c
    assert tok.encode("ab c") == ids(tok, "ab", "\u2581c")
    assert tok.encode("abc") == ids(tok, "abc")
    assert tok.encode(" a") == ids(tok, "\u2581a")  # no space put in front, the leading one kept
    # newline runs apart: three newlines merge leftmost into \n\n then \n; they never merge with letters
    assert tok.encode("a\n\n\nb") == ids(tok, "a", "\n\n", "\n", "b")
    assert tok.encode("é") == ids(tok, "<0xC3>", "<0xA9>")  # no token: its UTF-8 bytes
    assert tok.encode("a<|channel>b") == ids(tok, "a", "<|channel>", "b")
    assert tok.encode("ab", add_special_tokens=True) == ids(tok, "<bos>", "ab")  # BOS always
    assert tok.decode(tok.encode("ab c\n\né a")) == "ab c\n\né a"
    assert set(tok.eos_token_ids) == set(ids(tok, "<eos>", "<turn|>"))


def test_a_newline_token_its_merges_do_not_build_is_refused():
    meta = vocabulary(WORDS + ["\n\n\n"])  # llama.cpp would take three newlines whole; merges give \n\n, \n
    with pytest.raises(ValueError, match="newline run"):
        Tokenizer.from_gguf_metadata(meta)
