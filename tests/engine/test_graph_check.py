"""A captured decode step is compared with the eager step before it serves (engine/graph_check.py):
the batches checked, and a decode replay that computes a wrong row caught at start-up - decode
steps then run eagerly, outputs still transformers'. (Every engine built over the graphs' buffers
runs the check; the graph tests' replay counts show it passed for their families.)"""

from __future__ import annotations

import logging

import pytest
import torch

from prefixkv import LLM, SamplingParams
from prefixkv.engine.cuda_graphs import StepGraphs
from prefixkv.engine.graph_check import compare, decode_batches

from ..conftest import hf_greedy
from ..model.test_model_hf_folder import _make, _write_tokenizer
from ..model.triton_interpreter import device, kernels_module


def test_the_batches_checked():
    assert decode_batches([1, 2, 4, 8], 64, 3) == [1, 7]  # 7 replays as 8: a padding row
    assert decode_batches([1, 2, 4, 8], 16, 2) == [1, 7]
    assert decode_batches([1, 2, 4, 8, 16, 256], 30, 3) == [1, 7]  # the pool holds 3 blocks x 10 requests
    assert decode_batches([1, 2], 64, 3) == [1, 2]
    assert decode_batches([1], 64, 3) == [1]
    assert decode_batches([1, 2], 2, 3) == []


def test_compare_within_rounding_and_beyond():
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    assert compare(lambda: x, lambda: x * (1 + 1e-6), torch.float32, "a step") is None
    assert compare(lambda: x, lambda: x * 1.01, torch.bfloat16, "a step") is None
    wrong = x.clone()
    wrong[2] = 0.0
    message = compare(lambda: x, lambda: wrong, torch.bfloat16, "the replay of 8 rows")
    assert message is not None and message.startswith("the replay of 8 rows disagreed with the eager step by")
    assert compare(lambda: x, lambda: torch.full_like(x, float("nan")), torch.float32, "a step") is not None


@pytest.mark.slow(seconds=4)
@pytest.mark.parametrize(
    "broken_part, said",
    [("hidden", "the replay of 1 rows (1 decodes) disagreed"), ("logits", "the logits of the replay of 1 rows")],
)
def test_a_decode_replay_computing_a_wrong_row_leaves_decode_steps_eager(
    tmp_path, monkeypatch, caplog, broken_part, said
):
    """A replay whose final hidden states, or whose logits (the graph's LM head, DecodeTail), are
    wrong in a row is refused: decode steps run eagerly, said so, and outputs stay right."""
    kernels_module()
    monkeypatch.setenv("PREFIXKV_CUDA_GRAPHS", "static" if device().type == "cpu" else "capture")
    hf = _make("llama")
    hf.save_pretrained(tmp_path, safe_serialization=True)
    _write_tokenizer(tmp_path)
    real = StepGraphs._forward

    def broken(self, kind, size):  # type: ignore[no-untyped-def]
        hidden = real(self, kind, size)
        if kind == "decode":  # a row the kernel never wrote
            (hidden if broken_part == "hidden" else self.logits)[0].zero_()
        return hidden

    monkeypatch.setattr(StepGraphs, "_forward", broken)
    caplog.set_level(logging.INFO, logger="prefixkv")
    llm = LLM(
        str(tmp_path), dtype="float32", device=str(device()), num_blocks=64, block_size=8, max_model_len=48,
        max_num_seqs=4,
    )  # fmt: skip
    graphs = llm.llm_engine.runner.graphs
    assert graphs is not None and "decode" in graphs.failed and not graphs.graphs
    assert f"decode steps run eagerly: {said}" in caplog.text
    prompt = [5, 17, 99, 3, 42, 7]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(hf, prompt, 5)
    assert graphs.replays == 0


@pytest.mark.slow(seconds=3)
@pytest.mark.parametrize("max_model_len, checked", [(12, True), (8, False)])
def test_short_contexts_are_checked_over_one_block_or_not_at_all(tmp_path, monkeypatch, caplog, max_model_len, checked):
    """Buffers 16 tokens wide take a one-block prefill and a decode starting the next; 8 wide, a
    decode cannot start a block of its own after a prefill: not compared, said so (never refused
    for what the check itself cannot lay out)."""
    kernels_module()
    monkeypatch.setenv("PREFIXKV_CUDA_GRAPHS", "static" if device().type == "cpu" else "capture")
    hf = _make("llama")
    hf.save_pretrained(tmp_path, safe_serialization=True)
    _write_tokenizer(tmp_path)
    caplog.set_level(logging.INFO, logger="prefixkv")
    llm = LLM(
        str(tmp_path), dtype="float32", device=str(device()), num_blocks=64, block_size=8,
        max_model_len=max_model_len, max_num_seqs=4,
    )  # fmt: skip
    graphs = llm.llm_engine.runner.graphs
    assert graphs is not None and not graphs.failed
    assert ("not compared with eager ones" in caplog.text) is not checked
    prompt = [5, 17, 99]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(hf, prompt, 4) and graphs.replays > 0


@pytest.mark.slow(seconds=4)
@pytest.mark.parametrize("wrong", ["token", "logprob"])
def test_draws_graphs_drawing_a_wrong_token_leave_sampled_steps_eager(tmp_path, monkeypatch, caplog, wrong):
    """The draws' graphs (graph_sampling.py) are compared with the eager sampler on the replay's
    logits, each variant and the scores: one drawing a wrong token (here the variant without the
    sort), or scoring a wrong logprob, is refused - sampled steps draw eagerly, said so, their
    tokens an eager engine's - while the decode graphs still serve."""
    from prefixkv.engine import graph_sampling
    from prefixkv.engine.graph_sampling import GraphSampling

    kernels_module()
    monkeypatch.setenv("PREFIXKV_CUDA_GRAPHS", "static" if device().type == "cpu" else "capture")
    hf = _make("llama")
    hf.save_pretrained(tmp_path, safe_serialization=True)
    _write_tokenizer(tmp_path)
    real, real_scores = GraphSampling.replay, graph_sampling.score_rows

    def broken(self, logits, sort):  # type: ignore[no-untyped-def]
        tokens, marked = real(self, logits, sort)
        return (tokens, marked) if sort else ((tokens + 1) % logits.shape[1], marked)

    def broken_scores(logits, tokens, k):  # type: ignore[no-untyped-def]
        chosen, ranks, values, ids = real_scores(logits, tokens, k)
        return chosen + 1e-3, ranks, values, ids

    config = dict(dtype="float32", device=str(device()), num_blocks=64, block_size=8, max_model_len=48, max_num_seqs=4)
    want = LLM(str(tmp_path), **config, enforce_eager=True)
    if wrong == "token":
        monkeypatch.setattr(GraphSampling, "replay", broken)
    else:
        monkeypatch.setattr(graph_sampling, "score_rows", broken_scores)
    caplog.set_level(logging.INFO, logger="prefixkv")
    llm = LLM(str(tmp_path), **config)
    graphs = llm.llm_engine.runner.graphs
    assert graphs is not None and graphs.failed == {"sample"}
    differed = "in 1 of 1 rows" if wrong == "token" else "in their logprobs"
    assert f"the draws of the replay of 1 rows differed from the eager sampler's {differed}" in caplog.text
    prompts = [[5, 17, 99, 3, 42, 7], [8, 9, 10]]
    params = SamplingParams(temperature=0.9, min_p=0.05, seed=5, max_tokens=6, ignore_eos=True)
    outs = [e.generate(prompts, params, use_tqdm=False) for e in (llm, want)]
    assert [o.outputs[0].token_ids for o in outs[0]] == [o.outputs[0].token_ids for o in outs[1]]
    assert graphs.replays > 0 and graphs.draws == 0
