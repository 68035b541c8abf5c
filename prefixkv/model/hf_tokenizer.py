"""`LLM.get_tokenizer()`: the engine's tokenizer as a Hugging Face `PreTrainedTokenizerFast`, so
vLLM scripts that call `tok(text)`, `len(tok)`, `batch_decode`, `apply_chat_template` (tokenize=True
by default, as HF) work unchanged.

transformers is imported only here, on the first call: importing it costs 1.5-2 s on this
machine (measured under load, see docs/serving.md), which the engine and the server never pay.
The wrapper shares nothing mutable with the engine: it gets its own copy of the `tokenizers`
backend."""

from __future__ import annotations

from typing import Any

from .tokenizer import Tokenizer


def to_hf_tokenizer(tok: Tokenizer) -> Any:
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError as e:  # a runtime dependency, but say what is missing if it was removed
        raise ImportError(
            "LLM.get_tokenizer() returns a transformers PreTrainedTokenizerFast: pip install transformers"
        ) from e
    from tokenizers import Tokenizer as Backend
    from tokenizers import processors

    backend = Backend.from_str(tok.backend.to_str())
    bos = tok.bos_token
    if tok.add_bos_token and bos is not None and backend.post_processor is None:
        # GGUF tokenizers say "add BOS" in metadata; HF says it with a post-processor
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.bos_token_id)]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=tok.eos_token,
        pad_token=tok.pad_token,
        chat_template=tok.chat_template,
    )
