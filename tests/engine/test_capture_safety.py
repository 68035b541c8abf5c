"""Every kind of step over the graphs' buffers records on a GPU what it computes on a CPU: the
forward reads no value back to the host, builds no tensor from host data and runs no operator whose
shape follows the values (capture_safety.py) - what would make a capture fail, or a replay repeat
the capture's values. Mixed steps replay by default wherever a card times them faster
(engine/mixed_graph_choice.py), and none has been captured on a card yet: this is the check a CPU
can make. One family a kind of layer: dense attention, KV-cache groups, routed experts, Mamba2
beside attention, the gated delta net, the short convolution (a conv kernel of 3, where the
others' is 4: the fixed conv windows take the model's), LoRA rows and image rows; decode and mixed
steps each."""

from __future__ import annotations

import logging

import pytest

from prefixkv import LLM, SamplingParams
from prefixkv.model import moe

from ..model.triton_interpreter import device, kernels_module
from .capture_safety import HostReads
from .sweep_graphs import BLOCK, _checkpoint, _run

FAMILIES = ["llama", "gemma3", "qwen3_moe", "falcon_h1", "qwen3_next", "lfm2", "lora", "llava"]


def _triton_depth(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """[n]: n > 0 while a Triton kernel runs under the interpreter (whose own host reads are not
    the step's)."""
    from triton.runtime.interpreter import InterpretedFunction

    depth = [0]
    real_run = InterpretedFunction.run

    def run(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        depth[0] += 1
        try:
            return real_run(self, *args, **kwargs)
        finally:
            depth[0] -= 1

    monkeypatch.setattr(InterpretedFunction, "run", run)
    return depth


@pytest.mark.slow(seconds=5)
@pytest.mark.parametrize("family", FAMILIES)
def test_no_step_over_the_buffers_reads_values_on_the_host(tmp_path, monkeypatch, caplog, family):
    if device().type != "cpu":
        pytest.skip("a card captures these steps itself (test_cuda_graphs.py, the sweep)")
    kernels_module()
    monkeypatch.setenv("PREFIXKV_CUDA_GRAPHS", "static")
    monkeypatch.setattr(moe, "GROUPED_ON_CPU", True)  # the device's routing, as a GPU runs it
    caplog.set_level(logging.ERROR, logger="prefixkv")  # put back after the test
    depth = _triton_depth(monkeypatch)
    scenarios, adapters = _checkpoint(family, tmp_path / family)
    settings, requests = scenarios["greedy"]
    llm = LLM(
        str(tmp_path / family / "base" if family == "lora" else tmp_path / family),
        **{"dtype": "float32", "device": "cpu", "num_blocks": 64, "block_size": BLOCK, "max_model_len": 64,
           "max_num_seqs": 8, **settings},
        async_scheduling=True,
        # (three sizes: each is set up by a forward under Triton's interpreter)
        compilation_config={"cudagraph_mode": "FULL", "cudagraph_capture_sizes": [1, 4, 16]},
    )  # fmt: skip
    graphs = llm.llm_engine.runner.graphs
    assert graphs is not None
    reads = HostReads(depth)
    real_forward = graphs._forward

    def forward(kind, size):  # type: ignore[no-untyped-def]
        with reads:
            return real_forward(kind, size)

    graphs._forward = forward
    # three requests, four tokens each: chunked prompts beside decodes, then decodes alone
    _run(llm, [(prompt, SamplingParams(temperature=0, max_tokens=4), a) for prompt, _, a in requests[:3]], adapters)
    assert graphs.replays > 0 and graphs.mixed_replays > 0
    if family == "lora":
        assert graphs.lora_replays > 0
    if family == "llava":
        assert graphs.image_rows is not None and graphs.image_rows.steps > 0
    assert not reads.found, "\n".join(f"{n}x {name} at {where}" for (name, where), n in reads.found.items())


@pytest.mark.slow(seconds=8)
def test_the_draws_graphs_and_the_folded_one_row_step_read_nothing_on_the_host(tmp_path, monkeypatch, caplog):
    """The same for what a GPU records beside the forward of a decode step: a sampled step's draws
    (graph_sampling.py, both variants: with the sort top-k and top-p need, and without; and the
    scores of rows asking for logprobs) and a one-row step with its norms and SiLU folded into its
    products (LlamaModel.one_row_products)."""
    if device().type != "cpu":
        pytest.skip("a card captures these steps itself (test_cuda_graphs.py)")
    from prefixkv.model.kernels import gpu_fused

    from ..model.triton_interpreter import FUSED, GEMV

    kernels_module(FUSED)
    kernels_module(GEMV)
    from prefixkv.model import LlamaModel

    monkeypatch.setattr(gpu_fused, "run_on_cpu", True)
    monkeypatch.setattr(gpu_fused, "_module", None)
    monkeypatch.setattr(LlamaModel, "pack_for_cpu", lambda self: False)  # projections as a GPU keeps them
    monkeypatch.setenv("PREFIXKV_CUDA_GRAPHS", "static")
    caplog.set_level(logging.ERROR, logger="prefixkv")
    depth = _triton_depth(monkeypatch)
    scenarios, _ = _checkpoint("llama", tmp_path / "llama")
    llm = LLM(
        str(tmp_path / "llama"), dtype="float32", device="cpu", num_blocks=64, block_size=BLOCK, max_model_len=64,
        max_num_seqs=4, async_scheduling=True, compilation_config={"cudagraph_capture_sizes": [1, 2, 4]},
    )  # fmt: skip
    graphs = llm.llm_engine.runner.graphs
    assert graphs is not None and graphs.sampling is not None
    llm.llm_engine.runner.model.one_row_products = True
    reads = HostReads(depth)
    real_forward, real_replay, real_scores = graphs._forward, graphs.sampling.replay, graphs.sampling.scores
    variants, scored = set(), []

    def forward(kind, size):  # type: ignore[no-untyped-def]
        with reads:
            return real_forward(kind, size)

    def replay(logits, sort):  # type: ignore[no-untyped-def]
        variants.add(sort)
        with reads:
            return real_replay(logits, sort)

    def scores(logits, tokens):  # type: ignore[no-untyped-def]
        scored.append(logits.shape[0])
        with reads:
            return real_scores(logits, tokens)

    graphs._forward = forward
    graphs.sampling.replay = replay  # type: ignore[method-assign]
    graphs.sampling.scores = scores  # type: ignore[method-assign]
    model = llm.llm_engine.runner.model
    real_one_row, folded = model._one_row_forward, []

    def one_row(*args):  # type: ignore[no-untyped-def]
        folded.append(real_one_row(*args))
        return folded[-1]

    model._one_row_forward = one_row
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # one row, folded
    for params in (
        SamplingParams(temperature=0.8, top_p=0.9, top_k=20),
        SamplingParams(temperature=1.0, min_p=0.1, logprobs=2),
    ):
        llm.generate(prompts, params.clone(max_tokens=4), use_tqdm=False)
    assert graphs.replays > 0 and variants == {True, False} and scored
    assert folded and all(x is not None for x in folded)  # the one-row steps took the folded products
    assert not reads.found, "\n".join(f"{n}x {name} at {where}" for (name, where), n in reads.found.items())
