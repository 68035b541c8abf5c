"""Steps with adapters over the fixed buffers a CUDA graph replays (engine/cuda_graphs.py,
lora/layers.StaticLoRAMapping): greedy float32 tokens equal transformers + peft's for a batch of
every adapter and the base model, decode and mixed steps both replayed, scheduled ahead. On a CPU
the buffers run uncaptured under Triton's interpreter; on a GPU they are captured."""

from __future__ import annotations

import pytest
import torch

from prefixkv import LLM
from prefixkv.lora.layers import FUSED, SLICE_COUNTS, StaticLoRAMapping

from ..model.triton_interpreter import device, kernels_module
from .conftest import Fixture
from .test_lora_oracle import BASE, _all_free, _run


@pytest.fixture
def static_graphs(monkeypatch):
    kernels_module()
    monkeypatch.setenv("PREFIXKV_CUDA_GRAPHS", "static" if device().type == "cpu" else "capture")


@pytest.fixture(scope="module")
def llama_adapters(tmp_path_factory):
    """The oracle's checkpoint and adapters, Llama's alone (Qwen2's take the same path here)."""
    return Fixture("llama", tmp_path_factory.mktemp("lora-graphs"))


@pytest.mark.slow(seconds=12)
def test_adapters_in_replayed_steps_match_peft(llama_adapters, static_graphs):
    fx = llama_adapters
    llm = LLM(
        str(fx.base),
        **{**BASE, "device": str(device())},
        max_loras=3,
        max_lora_rank=8,
        max_num_seqs=8,
        max_num_batched_tokens=32,  # prompts beside decodes, some in chunks: mixed steps
        async_scheduling=True,
        compilation_config={"cudagraph_mode": "FULL", "cudagraph_capture_sizes": [2, 8, 32]},
    )
    names = [None, "all", "qv"]  # every target ("all"), two slots in one batch, base rows
    got = _run(llm, fx, names)
    for name in set(names):
        assert got[name] == fx.expected[name] * names.count(name), name
    graphs = llm.llm_engine.runner.graphs
    assert graphs is not None and graphs.lora is not None
    assert graphs.replays > 0 and graphs.mixed_replays > 0 and graphs.lora_replays > 0
    assert ("decode-lora", 8) in graphs.lora_maps and ("mixed-lora", 32) in graphs.lora_maps
    _all_free(llm)
    # a step without adapters replays the graph that reads none
    before = graphs.lora_replays
    base = _run(llm, fx, [None])
    assert base[None] == fx.expected[None] and graphs.lora_replays == before


def test_static_mapping_masks_each_rows_own_slot():
    """One-hot per row on its slot's rank columns, repeated per slice; a base row all zeros; the
    masks follow the slots buffer from refresh to refresh."""
    assert sorted({len(targets) for targets, _ in FUSED.values()}) == list(SLICE_COUNTS)
    slots = torch.tensor([2, -1, 0, 2])
    mapping = StaticLoRAMapping(slots, num_slots=3, max_rank=2, dtype=torch.float32)
    mapping.refresh()
    assert mapping.masks is not None
    assert mapping.masks[1].tolist() == [
        [0, 0, 0, 0, 1, 1],
        [0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 0, 0, 1, 1],
    ]
    assert torch.equal(mapping.masks[3], mapping.masks[1].repeat(1, 3))
    assert mapping.dense == slice(0, 4) and mapping.dense_slots == slice(0, 3) and mapping.runs == []
    slots.fill_(-1)
    mapping.refresh()
    assert not mapping.masks[2].any()
