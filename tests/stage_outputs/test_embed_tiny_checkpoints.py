"""Pooled embeddings on tiny random HF checkpoints (transformers' own classes) equal transformers'
final hidden states pooled the same way, with the stage-output cache serving a shared prefix."""

from __future__ import annotations

import pytest
import torch

from prefixkv.llm import LLM

from ..model.test_model_hf_folder import VOCAB, _make, _write_tokenizer


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_pooled_embeddings_equal_transformers(tmp_path, kind):
    hf = _make(kind)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    _write_tokenizer(tmp_path)
    g = torch.Generator().manual_seed(2)
    prefix = torch.randint(0, VOCAB - 50, (16,), generator=g).tolist()
    docs = [prefix + torch.randint(0, VOCAB - 50, (n,), generator=g).tolist() for n in (3, 5, 7)]
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", block_size=8, num_blocks=64, enable_stage_output_cache=True)
    with torch.no_grad():
        ref = [hf(torch.tensor([d]), output_hidden_states=True).hidden_states[-1][0] for d in docs]
    for pooling in ("mean", "last", "cls", "all"):
        outs = llm.embed([{"prompt_token_ids": d} for d in docs], pooling=pooling, normalize=False, use_tqdm=False)
        for out, h in zip(outs, ref):
            want = {"mean": h.mean(0), "last": h[-1], "cls": h[0], "all": h}[pooling]
            torch.testing.assert_close(torch.tensor(out.outputs.embedding), want, atol=1e-4, rtol=1e-4)
        assert all(o.num_cached_tokens >= 16 for o in outs[1:])  # the prefix's hidden states, from the cache
    engine = llm.llm_engine
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks
