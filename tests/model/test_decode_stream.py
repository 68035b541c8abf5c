"""Streaming detokenization (Tokenizer.decode_stream): on random token sequences - multi-byte
characters split over byte tokens, special tokens, invalid UTF-8 - the streamed text is, after
every token, exactly `decode` of the tokens so far up to its last complete character, for a
byte-level BPE tokenizer (the default model's) and a SentencePiece-style one (byte fallback,
"▁" for spaces, the first space stripped), with and without skip_special_tokens."""

from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend

from prefixkv.model.gguf_file import GGUFFile
from prefixkv.model.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def byte_level(default_gguf_path) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(GGUFFile(default_gguf_path).metadata)


@pytest.fixture(scope="module")
def sentencepiece_like() -> Tokenizer:
    """Llama-2 / Mistral tokenizer.json's decoder: Replace("▁", " "), ByteFallback, Fuse, Strip."""
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += ["▁", "▁Hello", "▁world", "Hello", ",", ".", "▁日本", "語", "é", "▁caf", "▁▁", "a", "b", "▁a", "!"]
    tok = Backend(
        models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[], byte_fallback=True, unk_token="<unk>")
    )
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    return Tokenizer(tok, bos_token_id=1, eos_token_ids=[2])


def _random_ids(tok: Tokenizer, rng: random.Random, n: int, any_token: bool) -> list[int]:
    """A mix of real text's tokens (multi-byte characters split), random tokens and special tokens.
    `any_token` False: random tokens only among those that are not single bytes (a byte-fallback
    decoder garbles a whole invalid run of bytes, see test_invalid_byte_run_does_not_fail)."""
    ids: list[int] = []
    specials = [i for i in (tok.bos_token_id, tok.eos_token_id) if i is not None]
    while len(ids) < n:
        r = rng.random()
        if r < 0.5:
            ids += tok.encode(rng.choice(TEXTS))
        elif r < 0.9:
            t = rng.randrange(tok.vocab_size)
            if any_token or not (tok.id_to_token(t) or "").startswith("<0x"):
                ids.append(t)
        else:
            ids.append(rng.choice(specials))
    return ids[:n]


TEXTS = ["Hello, world.", " café 🙂🎉 ", "日本語のテキスト", "Ελληνικά ٣ ½!", "\n\n  x", "a b", "👍🏽 é"]


def _check(tok: Tokenizer, ids: list[int], skip: bool) -> int:
    """The number of complete points compared."""
    stream = tok.decode_stream(skip_special_tokens=skip)
    text = ""
    complete = 0
    for i in range(1, len(ids) + 1):
        text += stream.step(ids[:i])
        full = tok.decode(ids[:i], skip_special_tokens=skip)
        # while the last character is incomplete the stream holds it back, and a whole decode may
        # garble the run of byte tokens it belongs to (byte fallback): compare at complete points
        if not full.endswith("\ufffd"):
            assert text == full, (ids[:i], text, full)
            complete += 1
    return complete


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("which", ["byte_level", "sentencepiece_like"])
def test_stream_equals_decode_on_random_sequences(request, which: str, skip: bool) -> None:
    tok = request.getfixturevalue(which)
    rng = random.Random(f"{which}-{skip}")
    compared = sum(
        _check(tok, _random_ids(tok, rng, rng.randrange(1, 40), which == "byte_level"), skip) for _ in range(60)
    )
    assert compared > 600


def test_several_tokens_in_one_step(byte_level: Tokenizer) -> None:
    ids = byte_level.encode("🙂🎉 日本語 done")
    stream = byte_level.decode_stream()
    text = stream.step(ids[:3]) + stream.step(ids)
    assert text == byte_level.decode(ids)


def test_invalid_byte_run_does_not_fail(sentencepiece_like: Tokenizer) -> None:
    """'[' then a lone continuation byte: the byte-fallback decode turns the whole run into U+FFFD,
    rewriting text already streamed; the stream goes on, and completes later text as decode does."""
    tok = sentencepiece_like
    ids = [tok.token_to_id("<0x5B>"), tok.token_to_id("<0x9F>"), tok.token_to_id("▁"), tok.token_to_id("▁world")]
    stream = tok.decode_stream()
    pieces = [stream.step(ids[:i]) for i in range(1, len(ids) + 1)]
    assert pieces[0] == "[" and pieces[-1] == " world"
    assert tok.decode(ids) == "\ufffd\ufffd  world"


@pytest.mark.parametrize("which", ["byte_level", "sentencepiece_like"])
def test_stream_after_a_prompt_equals_decode_after(request, which: str) -> None:
    """Read after the prompt's last tokens (vLLM's detokenizer): the streamed pieces joined equal
    `decode_after` of the tokens so far at every complete point."""
    tok = request.getfixturevalue(which)
    rng = random.Random(f"context-{which}")
    compared = 0
    for _ in range(40):
        context = tok.reading_context(tok.encode(rng.choice(TEXTS)))
        ids = _random_ids(tok, rng, rng.randrange(1, 30), which == "byte_level")
        stream = tok.decode_stream(context=context)
        text = ""
        for i in range(1, len(ids) + 1):
            text += stream.step(ids[:i])
            full = tok.decode_after(context, ids[:i])
            if not full.endswith("\ufffd"):
                assert text == full, (context, ids[:i], text, full)
                compared += 1
    assert compared > 300


def test_the_first_word_after_a_prompt_keeps_its_space(sentencepiece_like: Tokenizer) -> None:
    """A SentencePiece decoder strips the space before the text's first word; after a prompt the
    generated "▁world" reads " world", as vLLM gives it (and the whole decode says "world")."""
    tok = sentencepiece_like
    prompt, out = [tok.token_to_id("▁Hello")], [tok.token_to_id("▁world"), tok.token_to_id("!")]
    assert tok.decode(out) == "world!"
    assert tok.decode_after(prompt, out) == " world!"
    stream = tok.decode_stream(context=prompt)
    assert stream.step(out[:1]) + stream.step(out) == " world!"
