"""GGUF `tokenizer.ggml.pre`: each supported name splits text as llama.cpp does (its regexes
applied one after another, each splitting every piece the last one left, matches and gaps
alike), a missing key is "default", and an unknown name is refused by name."""

from __future__ import annotations

import pytest
import regex

from prefixkv.model.tokenizer import GGUF_PRE_TOKENIZERS, Tokenizer, _bytes_to_unicode, gguf_pre_tokenizer_spec

TEXTS = [
    "Hello, world! It's 2024-11-27 (12345678 items) at 3.14159.",
    "  leading  and trailing   \n\n\tTabs\ttoo \r\n",
    "I'LL say we'Re done; you'd've known <tag>$x+=y^2|z~w</tag>",
    "Ünïcödé: 日本語のテキスト, Ελληνικά, ١٢٣ and ①②③ ½",
    "code: def f(x):\n    return x**2  # 100%!!\n\n\n",
    "emoji 👍🏽 and 'quotes' \"double\" — dashes… 1,000,000",
]


def llama_cpp_split(text: str, splits: tuple[str, ...]) -> list[str]:
    """llama.cpp's unicode_regex_split, written from its description with Python's `regex`."""
    pieces = [text]
    for expr in splits:
        pattern = regex.compile(expr)
        out = []
        for piece in pieces:
            at = 0
            for m in pattern.finditer(piece):
                if m.start() > at:
                    out.append(piece[at : m.start()])
                if m.end() > m.start():
                    out.append(m.group())
                at = m.end()
            if at < len(piece):
                out.append(piece[at:])
        pieces = out
    return pieces


@pytest.mark.parametrize("name", sorted({spec.splits: name for name, spec in GGUF_PRE_TOKENIZERS.items()}.values()))
def test_split_matches_llama_cpp(name: str) -> None:
    spec = GGUF_PRE_TOKENIZERS[name]
    pre = spec.build()
    spell = _bytes_to_unicode()
    for text in TEXTS:
        got = [p for p, _ in pre.pre_tokenize_str(text)]
        want = ["".join(spell[b] for b in piece.encode("utf-8")) for piece in llama_cpp_split(text, spec.splits)]
        assert got == want, (name, text)


def test_default_is_not_the_gpt2_split() -> None:
    """llama.cpp's "default" isolates punctuation runs and cuts digit runs in threes: a file that
    says "default" (or nothing) must not get plain GPT-2 pieces."""
    text = "f(x) = 1234567"
    default = [p for p, _ in GGUF_PRE_TOKENIZERS["default"].build().pre_tokenize_str(text)]
    gpt2 = [p for p, _ in GGUF_PRE_TOKENIZERS["gpt-2"].build().pre_tokenize_str(text)]
    assert default == ["f", "(", "x", ")", "Ġ", "=", "Ġ", "123", "456", "7"]
    assert gpt2 == ["f", "(", "x", ")", "Ġ=", "Ġ1234567"]


def test_gpt_4o_keeps_contractions_and_splits_at_capitals() -> None:
    """o200k (gpt-oss's "gpt-4o"): a capital starts a new word, a contraction stays with its
    word, and digits go in threes, unlike Llama 3's split of the same text."""
    text = "HelloWorld I'M here: 12345 don't"
    o200k = [p for p, _ in GGUF_PRE_TOKENIZERS["gpt-4o"].build().pre_tokenize_str(text)]
    llama3 = [p for p, _ in GGUF_PRE_TOKENIZERS["llama3"].build().pre_tokenize_str(text)]
    assert o200k == ["Hello", "World", "ĠI'M", "Ġhere", ":", "Ġ", "123", "45", "Ġdon't"]
    assert llama3 == ["HelloWorld", "ĠI", "'M", "Ġhere", ":", "Ġ", "123", "45", "Ġdon", "'t"]


def test_qwen35_keeps_combining_marks_in_words() -> None:
    """Qwen3.5's split: a decomposed accent stays in its word, where Qwen2's cuts it out."""
    text = "cafe\u0301 nai\u0308ve"
    qwen35 = [p for p, _ in GGUF_PRE_TOKENIZERS["qwen35"].build().pre_tokenize_str(text)]
    qwen2 = [p for p, _ in GGUF_PRE_TOKENIZERS["qwen2"].build().pre_tokenize_str(text)]
    assert qwen35 == ["cafeÌģ", "ĠnaiÌĪve"] and qwen2 == ["cafe", "Ìģ", "Ġnai", "ÌĪve"]


def _meta(pre: str | None, **extra: object) -> dict[str, object]:
    tokens = sorted(_bytes_to_unicode().values()) + ["ab", "abc", "<s>"]
    meta: dict[str, object] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * (len(tokens) - 1) + [3],
        "tokenizer.ggml.merges": ["a b"],  # "abc" is in the vocabulary but no merge makes it
        "tokenizer.ggml.bos_token_id": len(tokens) - 1,
        **extra,
    }
    if pre is not None:
        meta["tokenizer.ggml.pre"] = pre
    return meta


def test_missing_key_reads_as_default() -> None:
    missing = Tokenizer.from_gguf_metadata(_meta(None))
    default = Tokenizer.from_gguf_metadata(_meta("default"))
    text = "x(1234)+y"
    assert missing.encode(text) == default.encode(text)
    assert [missing.id_to_token(i) for i in missing.encode("(12345)")] == ["(", "1", "2", "3", "4", "5", ")"]


@pytest.mark.parametrize("name", ["nonsense", "gpt2", "tekken", "deepseek-llm", "llama4", "minerva"])
def test_unknown_or_unimplemented_name_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match=rf"tokenizer\.ggml\.pre='{name}'.*Supported: .*smollm"):
        Tokenizer.from_gguf_metadata(_meta(name))
    with pytest.raises(ValueError, match=name):
        gguf_pre_tokenizer_spec(name)


def test_llama3_names_take_whole_words_and_add_bos() -> None:
    """llama.cpp's LLAMA3 type: a piece found whole in the vocabulary is one token (merges
    ignored), and BOS is added unless the file says otherwise."""
    llama3 = Tokenizer.from_gguf_metadata(_meta("llama-bpe"))
    qwen2 = Tokenizer.from_gguf_metadata(_meta("qwen2"))
    assert [llama3.id_to_token(i) for i in llama3.encode("abc")] == ["abc"]
    assert [qwen2.id_to_token(i) for i in qwen2.encode("abc")] == ["ab", "c"]
    assert llama3.add_bos_token and not qwen2.add_bos_token
    said_no = Tokenizer.from_gguf_metadata(_meta("llama-bpe", **{"tokenizer.ggml.add_bos_token": False}))
    assert not said_no.add_bos_token
