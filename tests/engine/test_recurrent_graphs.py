"""Decode steps of recurrent models (Mamba2, Falcon-H1, Qwen3-Next) over the fixed buffers a
CUDA graph replays (engine/cuda_graphs.py, model/static_decode.py): each row's state blocks - the
one it continues from, the one it writes - come from the buffers, the same one-token update as an
eager step's. On a CPU uncaptured under Triton's interpreter (PREFIXKV_CUDA_GRAPHS=static),
captured on a GPU."""

from __future__ import annotations

import random

import pytest

from ..model.test_model_hf_folder import _write_tokenizer
from ..model.triton_interpreter import device, kernels_module
from .engine_oracle import hf_generate, replay_against_eager

MAX_NEW = 6


def _make(kind: str):
    if kind == "mamba2":
        from .test_mamba2 import make_mamba2

        return make_mamba2()
    if kind == "falcon_h1":
        from .test_falcon_h1 import make_falcon_h1

        return make_falcon_h1()
    from .test_qwen3_next import make_qwen3_next

    # dense MLPs: a card may route float32 experts eagerly only (test_moe_architectures covers them)
    return make_qwen3_next(mlp_only_layers=[0, 1, 2, 3])


def _graphs_checkpoint(folder, monkeypatch, kind: str):
    """The family's checkpoint written to `folder`, the graphs' buffers set up (uncaptured under
    Triton's interpreter on a CPU, captured on a GPU); transformers' model, the oracle."""
    kernels_module()
    monkeypatch.setenv("PREFIXKV_CUDA_GRAPHS", "static" if device().type == "cpu" else "capture")
    hf = _make(kind)
    hf.save_pretrained(folder, safe_serialization=True)
    _write_tokenizer(folder)
    return hf


@pytest.mark.slow(seconds=10)
# (Bamba: Mamba2 mixers and attention in layers of their own, which Falcon-H1's layers hold both of)
@pytest.mark.parametrize("kind", ["mamba2", "falcon_h1", "qwen3_next"])
def test_recurrent_decode_steps_replay_over_fixed_buffers(tmp_path, monkeypatch, kind):
    """Greedy float32 tokens equal transformers', each token's logprob the eager steps' (a wrong
    block read or written shifts them before it flips a token), with caching on (later prompts
    continue from a shared prefix's cached state), a padded batch (3 rows in a graph of 4) and
    steps scheduled ahead; every block free after."""
    hf = _graphs_checkpoint(tmp_path, monkeypatch, kind)
    rng = random.Random(f"{kind}-graphs")
    shared = [rng.randrange(256) for _ in range(20)]
    # block-aligned and not: decodes cross into new blocks at different steps
    prompts = [shared + [rng.randrange(256) for _ in range(n)] for n in (3, 4, 9)]
    expected = [hf_generate(hf, p, MAX_NEW) for p in prompts]
    kwargs = dict(
        dtype="float32",
        device=str(device()),
        num_blocks=48,
        block_size=8,
        max_model_len=64,
        compilation_config={"cudagraph_capture_sizes": [1, 4]},
    )
    # the first prompt alone: the others continue from its cached state
    engine = replay_against_eager(tmp_path, [prompts[:1], prompts[1:]], expected, kwargs).llm_engine
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.replays > 0 and graphs.inputs.recurrent
    assert engine.prefix_cache_stats.hits > 0


@pytest.mark.slow(seconds=10)
@pytest.mark.parametrize("kind", ["mamba2", "falcon_h1", "qwen3_next"])
def test_recurrent_mixed_steps_replay_over_fixed_buffers(tmp_path, monkeypatch, kind):
    """Under cudagraph_mode FULL a recurrent layer's prompts, chunks and the decodes beside them
    take the mixed buffers (model/static_scan.py; a Mamba2 mixer, a gated delta net): segments
    crossing blocks mid-chunk, chains of several segments, chunks continuing from a cached state or
    their own previous chunk, and prompts sharing a prefix in one step (the second continuing from a
    block the first writes there: its chain walks the first's). Greedy tokens equal transformers',
    logprobs the eager steps'."""
    hf = _graphs_checkpoint(tmp_path, monkeypatch, kind)
    rng = random.Random(f"{kind}-mixed")
    shared = [rng.randrange(256) for _ in range(19)]
    prompts = [shared + [rng.randrange(256) for _ in range(n)] for n in (2, 13, 5, 30)]
    # three tokens a prompt: the second batch's chunks still run beside the decodes of the prompts
    # done before them (each step of Triton's interpreter costs ~1 s here)
    new = 3
    expected = [hf_generate(hf, p, new) for p in prompts]
    kwargs = dict(
        dtype="float32",
        device=str(device()),
        num_blocks=64,
        block_size=8,
        max_model_len=64,
        max_num_batched_tokens=24,  # chunks of up to 24 tokens beside the running decodes
        # (few sizes: each is set up by a forward under Triton's interpreter; shorter steps pad to 24)
        compilation_config={"cudagraph_mode": "FULL", "cudagraph_capture_sizes": [1, 4, 24]},
    )
    # one prompt first; then three over its cached state, the last in chunks; then two at once
    # sharing a prefix that neither has cached (the second's hit is computed in the same step)
    head = [rng.randrange(256) for _ in range(9)]  # a block and one token: the second hits the first's block
    fresh = [head + [11, 12], head + [13, 14, 15]]
    expected += [hf_generate(hf, p, new) for p in fresh]
    llm = replay_against_eager(tmp_path, [prompts[:1], prompts[1:], fresh], expected, kwargs)
    graphs = llm.llm_engine.runner.graphs
    assert graphs is not None and graphs.mixed is not None and graphs.mixed.scan is not None
    assert graphs.mixed_replays > 0 and graphs.replays > 0
