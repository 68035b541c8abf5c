"""vLLM's gpu_memory_utilization: on CUDA the KV cache gets the share of the card left after the
weights and one step's measured activations (the measuring itself runs in tests/engine/test_cuda.py);
a share that needs other processes' memory, or leaves no KV cache, is refused; on a CPU it changes
nothing and says so."""

from __future__ import annotations

import logging

import pytest

from prefixkv.config import EngineConfig
from prefixkv.engine.gpu_memory import GIB, kv_budget_bytes, profile_step
from prefixkv.engine.llm_engine import LLMEngine


def test_the_kv_cache_gets_what_weights_and_activations_leave():
    # a 140 GiB card, all free but what this process holds (2 GiB: 1 of weights, 1 cached)
    assert kv_budget_bytes(0.9, 140 * GIB, 138 * GIB, 2 * GIB, 1 * GIB, GIB // 2) == int(0.9 * 140 * GIB) - 3 * GIB // 2
    assert kv_budget_bytes(1.0, 8 * GIB, 7 * GIB, GIB, GIB, GIB) == 6 * GIB


def test_a_recurrent_models_graph_reserve_is_measured_over_the_most_segments(tmp_path):
    """The step measured for a recurrent model's graphs: requests of two tokens from a block's last
    position, each cutting two segments; it runs through the model (here on the CPU) and cuts
    about as many segments as a replayed step of that size computes (model/static_scan.py)."""
    import torch

    from prefixkv.memory.block_tensors import allocate_kv_cache
    from prefixkv.model import load_model
    from prefixkv.model.mamba2 import _plan
    from prefixkv.model.static_scan import segments_for

    from ..model.test_model_hf_folder import _write_tokenizer
    from .test_mamba2 import make_mamba2

    make_mamba2().save_pretrained(tmp_path, safe_serialization=True)
    _write_tokenizer(tmp_path)
    model = load_model(str(tmp_path)).model
    tokens, seqs, bs = 40, 8, 8
    positions, meta, blocks = profile_step(tokens, seqs, bs)
    assert meta.query_start_loc == [0, 2, 4, 6, 8, 10, 12, 14, 40] and positions[:2].tolist() == [7, 8]
    caches = allocate_kv_cache(model.config, blocks, bs, dtype=model.dtype, device="cpu")
    hidden = model(torch.zeros(tokens, dtype=torch.long), positions, caches, meta)
    assert hidden.shape[0] == tokens
    cut = _plan(meta, bs, torch.device("cpu")).seg_blocks.numel()
    assert cut == 2 * 7 + 5  # the last request's 26 tokens, positions 7 to 32, touch five blocks
    assert cut <= segments_for(tokens, seqs, bs) <= cut + seqs
    _, one, _ = profile_step(tokens, 1, bs)  # any other model: one prompt
    assert one.query_start_loc == [0, tokens]


def test_a_share_that_needs_other_processes_memory_is_refused():
    # another process holds 100 of the 140 GiB: 0.9 of the card cannot be had
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.9 asks for 126.0 GiB .* only 40.0 GiB are free"):
        kv_budget_bytes(0.9, 140 * GIB, 40 * GIB, 0, 0, 0)
    with pytest.raises(ValueError, match="leaves nothing for the KV cache"):
        kv_budget_bytes(0.1, 10 * GIB, 10 * GIB, 0, GIB, GIB // 10)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(gpu_memory_utilization=0), "gpu_memory_utilization must be a fraction"),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization must be a fraction"),
        (dict(gpu_memory_utilization="0.5"), "gpu_memory_utilization must be a fraction"),
        (dict(gpu_memory_utilization=0.5, kv_cache_memory_bytes=1 << 26), "give one of gpu_memory_utilization"),
        (dict(gpu_memory_utilization=0.5, num_gpu_blocks_override=64), "gpu_memory_utilization and num_blocks"),
    ],
)
def test_bad_shares_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_on_a_cpu_it_changes_nothing_and_says_so(default_lm, caplog):
    with caplog.at_level(logging.INFO, logger="prefixkv"):
        engine = LLMEngine(EngineConfig(device="cpu", gpu_memory_utilization=0.5, max_model_len=128), loaded=default_lm)
    assert engine.num_blocks == engine.block_tensors.num_blocks_for(1 << 30)  # the default 1 GiB budget
    assert "gpu_memory_utilization=0.5 changes nothing on the CPU" in caplog.text
