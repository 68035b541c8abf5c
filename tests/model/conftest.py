"""Model-test fixtures. `default_lm`, `default_gguf_path` and `hf_ref_model` (session-scoped,
loaded once) come from tests/conftest.py."""

import os

import pytest


@pytest.fixture(scope="session")
def hf_gguf_tokenizer(default_gguf_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        os.path.dirname(default_gguf_path), gguf_file=os.path.basename(default_gguf_path)
    )
