import json

import pytest
from tokenizers import pre_tokenizers

from prefixkv.model import Tokenizer

# Strings on which llama.cpp's "smollm" pre-tokenizer and plain GPT-2 byte-level agree
# (no whitespace run directly before a digit).
PLAIN = [
    "Hello world!",
    "  leading spaces and trailing  ",
    "café ñ 日本語 🙂 emoji Ωmega",
    "<|im_start|>user\nhi there<|im_end|>\n",
    "price: $1,234.56 on 2024-01-02",
    "tab\there\nnew line\r\n",
    "don't you're we'll 7s 1st",
    "x 12 y 3.14159 z 1e-9",
    "def f(x):\n    return x**2 + 10\n",
    "",
]
# Strings where whitespace runs precede digits: the digit split changes the tokens.
DIGIT_SENSITIVE = ["x  1", "a\n\n2", "a   2 b\t\t3", "col1    22    333\n\n4444"]


def test_digits_split_one_by_one(default_lm):
    tok = default_lm.tokenizer
    ids = tok.encode("12345")
    assert ids == [tok.token_to_id(d) for d in "12345"]
    assert len(ids) == 5
    # SmolLM2's tokenizer.json splits digits BEFORE the byte-level regex, so the
    # whitespace run before a digit stays one piece instead of becoming "Ġ" + "Ġ1".
    assert [tok.id_to_token(i) for i in tok.encode("x  1")] == ["x", "ĠĠ", "1"]
    assert [tok.id_to_token(i) for i in tok.encode("a\n\n2")] == ["a", "ĊĊ", "2"]
    assert [tok.id_to_token(i) for i in tok.encode("year 2024")] == ["year", "Ġ", "2", "0", "2", "4"]


def test_matches_transformers_gguf_tokenizer(default_lm, hf_gguf_tokenizer):
    tok = default_lm.tokenizer
    for s in PLAIN:
        assert tok.encode(s) == hf_gguf_tokenizer.encode(s, add_special_tokens=False), s


def test_matches_documented_smollm_pretokenizer(default_lm, hf_gguf_tokenizer):
    """transformers' GGUF converter ignores tokenizer.ggml.pre == "smollm" (it keeps plain
    ByteLevel), so on DIGIT_SENSITIVE strings it differs from the original SmolLM2
    tokenizer.json. Give its backend the documented pre-tokenizer
    (Digits(individual_digits=True) + ByteLevel) and compare on everything."""
    tok = default_lm.tokenizer
    backend = hf_gguf_tokenizer.backend_tokenizer
    saved = backend.pre_tokenizer
    try:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
        for s in PLAIN + DIGIT_SENSITIVE:
            assert tok.encode(s) == hf_gguf_tokenizer.encode(s, add_special_tokens=False), s
    finally:
        backend.pre_tokenizer = saved


def test_special_tokens(default_lm):
    tok = default_lm.tokenizer
    assert tok.bos_token_id == 1 and tok.bos_token == "<|im_start|>"
    assert tok.eos_token_id == 2 and tok.eos_token == "<|im_end|>"
    assert tok.eos_token_ids == {2}
    assert tok.vocab_size == 49152
    assert tok.encode("<|im_start|>") == [1]
    # no BOS added automatically for this model
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi")
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


@pytest.mark.parametrize("s", PLAIN + DIGIT_SENSITIVE)
def test_roundtrip(default_lm, s):
    tok = default_lm.tokenizer
    assert tok.decode(tok.encode(s), skip_special_tokens=False) == s


def test_chat_template(default_lm, hf_gguf_tokenizer):
    tok = default_lm.tokenizer
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    msgs2 = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    for m, gen in ((msgs, True), (msgs2, False), (msgs2, True)):
        ours = tok.apply_chat_template(m, add_generation_prompt=gen)
        ref = hf_gguf_tokenizer.apply_chat_template(m, add_generation_prompt=gen, tokenize=False)
        assert ours == ref
        assert tok.apply_chat_template(m, add_generation_prompt=gen, tokenize=True) == tok.encode(ours)
    assert not tok.apply_chat_template(msgs2, add_generation_prompt=False).endswith("assistant\n")


def test_stream_decode_equals_full(default_lm):
    tok = default_lm.tokenizer
    text = "Emoji 🙂🎉 and 日本語, café 12 ñ — done.<|im_end|>"
    gen = tok.encode(text)
    # multi-byte characters really are split across several tokens here
    assert any("\ufffd" in tok.decode([t]) for t in gen)
    stream = tok.decode_stream()
    pieces = [stream.step(gen[:i]) for i in range(1, len(gen) + 1)]
    assert "".join(pieces) == tok.decode(gen)
    assert all("\ufffd" not in p for p in pieces)
    # with skip_special_tokens=False the stop token text is streamed too
    stream = tok.decode_stream(skip_special_tokens=False)
    text = "".join(stream.step(gen[:i]) for i in range(1, len(gen) + 1))
    assert text == tok.decode(gen, skip_special_tokens=False)


def test_hf_folder_tokenizer(tmp_path, default_lm):
    src = default_lm.tokenizer
    src.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|im_start|>",
                "eos_token": {"content": "<|im_end|>", "special": True},
                "chat_template": src.chat_template,
            }
        )
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = Tokenizer.from_hf_folder(str(tmp_path))
    assert tok.bos_token_id == 1 and tok.eos_token_id == 2 and tok.eos_token_ids == {0, 2}
    for s in PLAIN + DIGIT_SENSITIVE:
        assert tok.encode(s) == src.encode(s)
    msgs = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(msgs) == src.apply_chat_template(msgs)


def test_missing_tokenizer_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_hf_folder(str(tmp_path))
