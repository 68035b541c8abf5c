"""ModelConfig from GGUF metadata: a file that cannot say its vocabulary size is refused by name;
the architecture registries agree."""

from __future__ import annotations

import pytest

from prefixkv.model.config import ModelConfig
from prefixkv.model.configs.registry import GGUF_ARCHITECTURES, SUPPORTED_ARCHITECTURES
from prefixkv.model.families import MODEL_CLASSES

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


def test_every_architecture_read_has_a_decoder_class():
    # the config registry and the decoder classes are registered apart (the decoders import the
    # config); neither may name an architecture the other lacks
    assert set(MODEL_CLASSES) == set(SUPPORTED_ARCHITECTURES)
    assert set(GGUF_ARCHITECTURES.values()) <= set(SUPPORTED_ARCHITECTURES)


def test_a_mamba2_without_a_state_is_refused_by_name():
    d = {"architectures": ["Mamba2ForCausalLM"], "hidden_size": 64, "num_heads": 8, "head_dim": 16, "n_groups": 2}
    assert ModelConfig.from_hf_dict(d).ssm_state_size == 128
    with pytest.raises(ValueError, match="Mamba2ForCausalLM with state_size=0"):
        ModelConfig.from_hf_dict({**d, "state_size": 0})
