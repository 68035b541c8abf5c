"""Model-test fixtures. `default_lm`, `default_gguf_path` and `hf_ref_model` (session-scoped,
loaded once) come from tests/conftest.py."""

import pytest


@pytest.fixture(scope="session")
def hf_gguf_tokenizer(default_gguf_path):
    """transformers' conversion of the GGUF's tokenizer (kept per machine: tests/reference_copy.py)."""
    from ..reference_copy import reference_tokenizer

    return reference_tokenizer(default_gguf_path)
