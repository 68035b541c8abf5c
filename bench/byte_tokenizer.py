"""A byte-level tokenizer for random test and bench checkpoints: the 256 byte tokens (GPT-2's
byte-to-character table, no merges) and two special ones, <s> and </s> (ids 256 and 257), written
as tokenizer.json + tokenizer_config.json. A vocabulary so small that a tiny model's logits cost
nothing, and that decodes any bytes."""

from __future__ import annotations

import json
from pathlib import Path


def write_byte_tokenizer(folder: Path) -> int:
    """Writes the tokenizer into `folder`; returns its vocabulary size (258)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from prefixkv.model.tokenizer import _bytes_to_unicode

    vocab = {ch: i for i, ch in enumerate(sorted(_bytes_to_unicode().values()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return int(tok.get_vocab_size())
