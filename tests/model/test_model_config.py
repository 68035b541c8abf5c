"""ModelConfig from GGUF metadata: a file that cannot say its vocabulary size is refused by name."""

from __future__ import annotations

import pytest

from prefixkv.model.config import ModelConfig

META = {
    "general.architecture": "llama",
    "llama.embedding_length": 64,
    "llama.attention.head_count": 4,
    "llama.block_count": 2,
    "llama.feed_forward_length": 128,
}


def test_vocab_size_from_the_token_list():
    config = ModelConfig.from_gguf_metadata({**META, "tokenizer.ggml.tokens": ["a", "b", "c"]}, set())
    assert config.vocab_size == 3 and config.head_dim == 16


def test_no_vocab_size_and_no_token_list_is_a_value_error():
    with pytest.raises(ValueError, match="neither llama.vocab_size nor tokenizer.ggml.tokens"):
        ModelConfig.from_gguf_metadata(META, set())
