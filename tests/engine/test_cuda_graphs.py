"""Decode steps over fixed buffers (engine/cuda_graphs.py, model/static_decode.py): what a CUDA
graph captures and replays. On a CPU the same buffers, padding, null block and forward run without
a capture, under Triton's interpreter (PREFIXKV_CUDA_GRAPHS=static); on a GPU they are captured and
the replay is compared with the same forward run eagerly, bit for bit. Tiny random checkpoints."""

from __future__ import annotations

import collections
import importlib.util
import logging
import random
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from prefixkv import LLM, SamplingParams
from prefixkv.engine.cuda_graphs import StepGraphs, capture_sizes, default_capture_sizes, graph_mode
from prefixkv.engine_args import EngineArgs
from prefixkv.memory.block_tensors import allocate_kv_cache
from prefixkv.model import AttentionMetadata, load_model
from prefixkv.model.kernels import gpu_fused

from ..conftest import hf_greedy
from ..model.test_model_hf_folder import _make, _write_tokenizer
from ..model.triton_interpreter import FUSED, device, kernels_module


def test_capture_sizes_are_vllms():
    assert default_capture_sizes(256) == [1, 2, 4, *range(8, 257, 8)]
    assert default_capture_sizes(5) == [1, 2, 4]
    assert default_capture_sizes(1024)[-1] == 512
    assert capture_sizes(256, {"max_capture_size": 16}) == [1, 2, 4, 8, 16]
    assert capture_sizes(4, {"cudagraph_capture_sizes": [8, 2, 1, 4]}) == [1, 2, 4]
    assert capture_sizes(64, 3) == default_capture_sizes(64)


def test_graph_mode_and_flags(monkeypatch):
    cuda = torch.device("cuda")
    assert graph_mode(cuda, True, None)[0] is None
    assert graph_mode(cuda, False, {"cudagraph_mode": "NONE"})[0] is None
    monkeypatch.delenv("PREFIXKV_CUDA_GRAPHS", raising=False)
    assert graph_mode(torch.device("cpu"), False, None)[0] is None  # a CPU is eager
    triton = importlib.util.find_spec("triton") is not None
    assert graph_mode(cuda, False, None)[0] == ("capture" if triton else None)  # the default on a GPU
    monkeypatch.setenv("PREFIXKV_CUDA_GRAPHS", "capture")
    assert graph_mode(cuda, False, {"cudagraph_mode": "FULL_DECODE_ONLY"})[0] == ("capture" if triton else None)
    assert graph_mode(cuda, True, None)[0] is None
    for bad in ({"cudagraph_capture_sizes": [0]}, {"max_capture_size": "8"}, {"cudagraph_mode": "SOME"}):
        with pytest.raises(ValueError, match="compilation_config"):
            EngineArgs(compilation_config=bad)
    with pytest.raises(ValueError, match="max_seq_len_to_capture"):
        EngineArgs(max_seq_len_to_capture=0)
    EngineArgs(compilation_config={"level": 3, "cudagraph_capture_sizes": [1, 2]})


@pytest.fixture
def fused_steps(monkeypatch):
    """The fused steps a GPU runs by default (the q/k norms and rotation with the K/V write, the
    norms, SiLU): on a CPU under the interpreter too."""
    kernels_module(FUSED)
    monkeypatch.setattr(gpu_fused, "run_on_cpu", device().type == "cpu")
    monkeypatch.setattr(gpu_fused, "_module", None)


@pytest.fixture
def static_graphs(monkeypatch):
    """Graphs without a capture on a CPU (under Triton's interpreter), captured on a GPU."""
    kernels_module()
    monkeypatch.setenv("PREFIXKV_CUDA_GRAPHS", "static" if device().type == "cpu" else "capture")


@pytest.mark.slow(seconds=14)
def test_engine_through_static_decode_matches_transformers(tmp_path, static_graphs, caplog):
    """Greedy float32 tokens equal transformers' with the decode steps over the fixed buffers:
    caching off and on (prefix hits), a batch shrinking and growing across the sizes (1, 2, 4:
    three sequences pad to four), preemption; every block free after."""
    hf = _make("llama")
    hf.save_pretrained(tmp_path, safe_serialization=True)
    _write_tokenizer(tmp_path)
    rng = random.Random(40)
    shared = [rng.randrange(256) for _ in range(20)]
    prompts = [shared + [rng.randrange(256) for _ in range(rng.randrange(1, 8))] for _ in range(4)]
    prompts.append([rng.randrange(256) for _ in range(6)])
    lengths = [6, 2, 4, 3, 5]  # sequences finish at different steps: the batch shrinks
    expected = [hf_greedy(hf, p, n) for p, n in zip(prompts, lengths)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    base = dict(
        dtype="float32",
        device=str(device()),
        num_blocks=64,
        block_size=8,
        max_model_len=48,
        max_num_seqs=4,  # the fifth joins as the first leave: the batch grows again
        compilation_config={"cudagraph_capture_sizes": [1, 2, 4], "cudagraph_mode": "FULL_AND_PIECEWISE"},
    )
    for kwargs in (
        dict(enable_prefix_caching=False),
        dict(enable_prefix_caching=True),
        # in order: scheduled ahead, a request ends before this cache runs short (no preemption)
        dict(num_blocks=7, max_num_seqs=3, async_scheduling=False),
    ):
        llm = LLM(str(tmp_path), **{**base, **kwargs})
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == expected, kwargs
        engine = llm.llm_engine
        graphs = engine.runner.graphs
        assert graphs is not None and graphs.replays > 0
        assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks
        assert engine.block_tensors.kv_caches[0].shape[1] == engine.num_blocks + 1  # the null block
        if kwargs.get("enable_prefix_caching", True):
            assert engine.prefix_cache_stats.hits > 0
        if kwargs.get("num_blocks") == 7:
            assert engine.scheduler.num_preemptions > 0
    # what the graphs take: one new token a row, at most the largest size, contexts within the width
    runner = engine.runner

    def row(**kw):
        fields = dict(token_ids=[1], start=5, block_table=[0], lora_id=0, mm_inputs=(), want_hidden_states=False)
        return SimpleNamespace(**{**fields, **kw})

    assert graphs.sizes == [1, 2]  # (the last engine's max_num_seqs=3 dropped size 4)
    assert graphs.mixed_sizes == [1, 2, 4]  # vLLM's sizes are token counts of any step too
    assert runner.graph_kind([row()] * 2) == "decode"
    assert runner.graph_kind([row(token_ids=[1, 2])]) == "mixed"  # a chunk
    assert runner.graph_kind([row()] * 3) == "mixed"  # past the largest batch, not the largest step
    assert runner.graph_kind([row(token_ids=[1, 2, 3]), row(), row()]) is None  # five tokens
    assert runner.graph_kind([row()] * 4) is None  # more sequences than the scheduler's three
    assert runner.graph_kind([row(start=48)]) is None  # past max_model_len's blocks
    assert runner.graph_kind([row(start=46, token_ids=[1, 2, 3])]) is None
    for eager_only in (dict(lora_id=1), dict(mm_inputs=("image",))):
        assert runner.graph_kind([row(), row(**eager_only)]) is None
    # hidden states (prompt logprobs, return_hidden_states) are read from the replay's output
    assert runner.graph_kind([row(), row(want_hidden_states=True)]) == "decode"
    # a kind whose capture failed runs eagerly, said once; the other kind still replays
    with caplog.at_level(logging.WARNING, logger="prefixkv"):
        graphs.refuse("decode", "a test's reason")
    assert "decode steps run eagerly: a test's reason" in caplog.text
    assert runner.graph_kind([row()] * 2) is None and runner.graph_kind([row(token_ids=[1, 2])]) == "mixed"
    assert not graphs.takes_lora("decode")
    eager = LLM(str(tmp_path), **{**base, "enforce_eager": True})
    assert eager.llm_engine.runner.graphs is None
    assert [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)] == expected


@pytest.mark.slow(seconds=10)
def test_engine_through_static_mixed_steps_matches_transformers(tmp_path, static_graphs):
    """Greedy float32 tokens equal transformers' with prompts chunked (16 tokens a step) beside
    running decodes, each mixed step over the fixed buffers of 8 or 16 rows: caching off and on
    (chunks after cached context), scheduled ahead (input tokens carried on the device, into the
    mixed buffers too); every block free after."""
    hf = _make("llama")
    hf.save_pretrained(tmp_path, safe_serialization=True)
    _write_tokenizer(tmp_path)
    rng = random.Random(41)
    shared = [rng.randrange(256) for _ in range(17)]
    prompts = [shared + [rng.randrange(256) for _ in range(rng.randrange(1, 9))] for _ in range(3)]
    prompts += [[rng.randrange(256) for _ in range(n)] for n in (3, 11)]
    lengths = [5, 3, 6, 4, 5]
    expected = [hf_greedy(hf, p, n) for p, n in zip(prompts, lengths)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    base = dict(
        dtype="float32",
        device=str(device()),
        num_blocks=64,
        block_size=8,
        max_model_len=48,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        async_scheduling=True,
        compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8, 16], "cudagraph_mode": "FULL"},
    )
    for caching in (False, True):
        llm = LLM(str(tmp_path), **base, enable_prefix_caching=caching)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == expected, caching
        engine = llm.llm_engine
        graphs = engine.runner.graphs
        assert graphs is not None and graphs.mixed_sizes == [1, 2, 4, 8, 16]
        assert graphs.mixed_replays > 0 and graphs.replays > 0 and engine.num_steps_ahead > 0
        assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks
        if caching:
            assert engine.prefix_cache_stats.hits > 0


@pytest.mark.parametrize("kind", ["qwen3"])  # q/k norms (the tile-mapped kernel's window: its own test)
def test_static_mixed_step_equals_the_eager_forward(tmp_path, static_graphs, fused_steps, monkeypatch, kind):
    """One step of a fresh prompt (over more than one tile of the attention kernel), a decode and
    two chunks after cached context, in 25 rows padded to 32: the buffers' forward (captured and
    replayed on a GPU) against the model's eager forward on the same cache through Triton's
    kernels; the replay against the same buffers' forward run eagerly, bit for bit; nothing written
    but the step's slots and the null block."""
    monkeypatch.setenv("PREFIXKV_CUDA_ATTENTION", "triton")
    dev = device()
    hf = _make(kind)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    _write_tokenizer(tmp_path)
    model = load_model(str(tmp_path), dtype=torch.float32, device=dev).model
    if dev.type == "cpu":
        model.pack_for_cpu()
    bs, num_blocks = 4, 16
    caches = allocate_kv_cache(model.config, num_blocks, bs, dtype=torch.float32, device=dev)
    gen = torch.Generator().manual_seed(1)
    for c in caches:
        c.copy_(torch.randn(c.shape, generator=gen))
    null = num_blocks - 1
    before_null = [c[:, :null].clone() for c in caches]
    mode = "capture" if dev.type == "cuda" else "static"
    graphs = StepGraphs(
        model, caches, [1, 2], 5, bs, null, dev, mode, max_model_len=200, mixed_sizes=[16, 32], max_seqs=4
    )
    graphs.capture()
    rows = [
        SimpleNamespace(token_ids=list(range(30, 48)), start=0, block_table=[8, 9, 10, 11, 12]),  # a fresh prompt
        SimpleNamespace(token_ids=[9], start=9, block_table=[3, 0, 7]),  # a decode
        SimpleNamespace(token_ids=[2, 6, 5, 3], start=11, block_table=[2, 4, 5, 6]),  # after 11 cached
        SimpleNamespace(token_ids=[17, 8], start=2, block_table=[1]),  # after 2 cached, ends a block
    ]
    assert graphs.kind(rows) == "mixed"
    hidden, starts = graphs.run(rows)
    hidden = hidden.clone()
    assert starts == [0, 18, 19, 23, 25] and hidden.shape[0] == 25
    ids = [t for r in rows for t in r.token_ids]
    positions = [r.start + j for r in rows for j in range(len(r.token_ids))]
    tables_of = [r.block_table for r in rows for _ in r.token_ids]
    slots = [t[p // bs] * bs + p % bs for t, p in zip(tables_of, positions)]
    for c, old in zip(caches, before_null):
        changed = (c[:, :null] != old).any(dim=(0, 2, 3, 4)).nonzero().flatten().tolist()
        assert set(changed) <= {s // bs for s in slots}
    tables = torch.tensor([r.block_table + [0] * (5 - len(r.block_table)) for r in rows])
    seq_lens = [r.start + len(r.token_ids) for r in rows]
    meta = AttentionMetadata(torch.tensor(slots), starts, seq_lens, tables)
    eager = model(torch.tensor(ids), torch.tensor(positions), caches, meta)
    torch.testing.assert_close(hidden, eager, rtol=1e-5, atol=1e-5)
    again = graphs._forward("mixed", 32)[:25]  # the same buffers, eagerly: the very kernels the graph replays
    assert torch.equal(hidden, again)
    if dev.type == "cuda":
        assert ("mixed", 16) in graphs.graphs and ("mixed", 32) in graphs.graphs


@pytest.mark.parametrize("kind", ["qwen3", "mistral-swa"])  # q/k norms; a 7-token sliding window
def test_static_decode_equals_the_eager_forward(tmp_path, static_graphs, fused_steps, monkeypatch, kind):
    """One decode step of three sequences padded to four: the buffers' forward (captured and
    replayed on a GPU) against the model's eager forward on the same cache through Triton's
    kernels, the fused steps on both (the K/V written at the buffers' slots); the replay against
    the same buffers' forward run eagerly, bit for bit; the padding row writes no block but the
    null one."""
    monkeypatch.setenv("PREFIXKV_CUDA_ATTENTION", "triton")
    dev = device()
    hf = _make(kind)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    _write_tokenizer(tmp_path)
    model = load_model(str(tmp_path), dtype=torch.float32, device=dev).model
    if dev.type == "cpu":
        model.pack_for_cpu()
    assert model.static_decode_unsupported() is None
    bs, num_blocks = 4, 13
    caches = allocate_kv_cache(model.config, num_blocks, bs, dtype=torch.float32, device=dev)
    gen = torch.Generator().manual_seed(0)
    for c in caches:
        c.copy_(torch.randn(c.shape, generator=gen))
    null = num_blocks - 1
    before_null = [c[:, :null].clone() for c in caches]
    mode = "capture" if dev.type == "cuda" else "static"
    graphs = StepGraphs(model, caches, [1, 2, 4], 4, bs, null, dev, mode, max_model_len=200)
    graphs.capture()
    # the position tables a graph reads are built for every step the engine may run, never regrown
    assert model.rotary.max_positions >= 200
    rows = [
        SimpleNamespace(token_ids=[5], start=9, block_table=[3, 0, 7]),
        SimpleNamespace(token_ids=[17], start=2, block_table=[1]),
        SimpleNamespace(token_ids=[99], start=14, block_table=[2, 4, 5, 6]),
    ]
    hidden, starts = graphs.run(rows)
    hidden = hidden.clone()
    assert starts is None  # row i is request i's
    slots = [7 * bs + 1, 1 * bs + 2, 6 * bs + 2]  # position p: block_table[p // bs], offset p % bs
    # the eager forward writes the same K/V to the same slots; nothing else but the null block changed
    for c, old in zip(caches, before_null):
        changed = (c[:, :null] != old).any(dim=(0, 2, 3, 4)).nonzero().flatten().tolist()
        assert set(changed) <= {s // bs for s in slots}
    tables = torch.tensor([[3, 0, 7, 0], [1, 0, 0, 0], [2, 4, 5, 6]])
    meta = AttentionMetadata(torch.tensor(slots), [0, 1, 2, 3], [10, 3, 15], tables)
    eager = model(torch.tensor([5, 17, 99]), torch.tensor([9, 2, 14]), caches, meta)
    torch.testing.assert_close(hidden, eager, rtol=1e-5, atol=1e-5)
    again = graphs._forward("decode", 4)[:3]  # the same buffers, eagerly: the very kernels the graph replays
    assert torch.equal(hidden, again)
    if dev.type == "cuda":
        assert graphs.graphs.keys() == {("decode", 1), ("decode", 2), ("decode", 4)}


def _write_llama(folder: Any) -> None:
    """A random Llama checkpoint and its tokenizer in `folder`."""
    _make("llama").save_pretrained(folder, safe_serialization=True)
    _write_tokenizer(folder)


HOST_ONLY = ("lift_fresh", "resolve_conj", "resolve_neg")  # a host tensor made, or read as NumPy


def _launches_beside_the_forward(
    graphs: StepGraphs, owner: object, method: str, kind: str, step_of: Callable[[Any], list[Any]]
) -> list[collections.Counter[str]]:
    """Wrap `owner.method` (its first argument a step, `step_of` its requests): per call for a step
    of `kind`, what it launches outside the graphs' forward (host-only operators aside)."""
    depth = [0]
    real = getattr(owner, method)
    counted: list[collections.Counter[str]] = []

    def left_out(fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn` with what it launches not counted (a graph's work)."""

        def inside(*args: Any) -> Any:
            depth[0] += 1
            try:
                return fn(*args)
            finally:
                depth[0] -= 1

        return inside

    graphs._forward = left_out(graphs._forward)  # type: ignore[method-assign]
    if graphs.sampling is not None:  # a sampled step's draws: their graph's work, left out too
        graphs.sampling.replay = left_out(graphs.sampling.replay)  # type: ignore[method-assign]

    def wrapped(step, *args, **kwargs):  # type: ignore[no-untyped-def]
        with _Launches(depth) as launches:
            out = real(step, *args, **kwargs)
        if graphs.kind(step_of(step)) == kind:
            counted.append(launches.ops - collections.Counter(dict.fromkeys(HOST_ONLY, 1 << 20)))
        return out

    setattr(owner, method, wrapped)
    return counted


class _Launches(TorchDispatchMode):
    """What a GPU would launch for the operators run inside this mode: every aten operator that
    writes a tensor (not a view or an allocation, not a `.to` that returns its input), by name.
    Triton's kernels are counted apart (their interpreter runs aten operators of its own)."""

    NO_KERNEL = frozenset(
        {"view", "_unsafe_view", "as_strided", "slice", "select", "unsqueeze", "squeeze", "t", "transpose"}
        | {"expand", "permute", "reshape", "alias", "detach", "unbind", "split", "narrow", "flatten"}
        | {"empty", "empty_like", "empty_strided", "new_empty"}
    )

    def __init__(self, triton_depth: list[int]) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.triton_depth = triton_depth

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if not self.triton_depth[0] and name not in self.NO_KERNEL and not (name == "to" and out is args[0]):
            self.ops[name] += 1
        return out


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_a_replayed_step_launches_nine_kernels_a_layer(tmp_path, static_graphs, fused_steps, monkeypatch, kind):
    """The launches a replayed step records (a decode; a mixed step the same with the prefill
    kernel for the decode's), counted on a CPU (at batch 1 likely a GPU's bound:
    their number, each a few microseconds whatever its size): per layer four matrix products
    (qkv, o, gate-up, down), two fused norms, one kernel for the q/k norms + rotation + K/V write,
    the decode attention and SiLU-and-mul; per step the embedding, the rotary tables' two gathers
    and the final norm; a decode step's graph also its tail (cuda_graphs.DecodeTail). An operator
    that slips into the decode path shows here."""
    if device().type != "cpu":
        pytest.skip("counted under Triton's interpreter; a GPU counts with the profiler (host_overhead.py)")
    from triton.runtime.interpreter import InterpretedFunction

    from prefixkv.model.kernels import ops

    monkeypatch.setattr(ops, "_enabled", False)  # the CPU's native kernels would stand in for Triton's
    hf = _make(kind)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    _write_tokenizer(tmp_path)
    llm = LLM(
        str(tmp_path), dtype="float32", device="cpu", max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16,
        compilation_config={"cudagraph_mode": "FULL"},
    )  # fmt: skip
    graphs = llm.llm_engine.runner.graphs
    assert graphs is not None
    depth, triton = [0], collections.Counter[str]()
    real_run, real_forward = InterpretedFunction.run, graphs._forward

    def run(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        triton[self.fn.__name__.strip("_")] += 1
        depth[0] += 1
        try:
            return real_run(self, *args, **kwargs)
        finally:
            depth[0] -= 1

    steps = []

    def forward(kind, size):  # type: ignore[no-untyped-def]
        triton.clear()
        with _Launches(depth) as launches:
            hidden = real_forward(kind, size)
        steps.append((kind, launches.ops.copy(), triton.copy()))
        return hidden

    monkeypatch.setattr(InterpretedFunction, "run", run)
    graphs._forward = forward
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    n = hf.config.num_hidden_layers
    assert [kind for kind, *_ in steps] == ["mixed", "decode", "decode"]  # the prompt's step is one too
    for kind, aten, kernels in steps:
        # (a CPU's products of more rows take oneDNN's packed layout: one product all the same)
        aten["linear"] += aten.pop("_linear_pointwise", 0)
        step = {"linear": 4 * n, "embedding": 1, "index": 2}
        if kind == "decode":  # its tail: the LM head into the logits buffer, the row checks, the argmax
            step.update(linear=4 * n + 1, copy_=1, sum=1, isfinite=1, argmax=1, where=1)
        assert aten == step
        fused = {"add_rms_norm_kernel": 2 * n + 1, "rotary_write_kv_kernel": n, "silu_and_mul_kernel": n}
        assert kernels == {**fused, f"{kind.replace('mixed', 'prefill')}_kernel": n}


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_replayed_decode_step_launches_its_copies_beside_its_graphs(
    tmp_path, static_graphs, async_scheduling, sampled
):
    """Outside its graph a greedy decode step launches one copy: its ids, positions, slots, lengths
    and block tables from the host's flat buffer (DecodeLayout), whatever its batch; the LM head,
    the row checks and the argmax run in the graph (DecodeTail). Under async scheduling the ids
    drawn by the previous step add one copy on the device; in order, the host reads the row checks
    before it samples. A sampled step (temperature, top-p) draws its tokens in a graph of its own
    after the decode graph (graph_sampling.py), with one copy more: its rows' parameters and
    uniforms. On a GPU every operator outside the graphs is host time a step. Counted on a CPU, the
    graphs' work left out (the read-back, a copy on a GPU, is no operator here)."""
    if device().type != "cpu":
        pytest.skip("counted under Triton's interpreter")
    _write_llama(tmp_path)
    llm = LLM(
        str(tmp_path), dtype="float32", device="cpu", max_model_len=64, max_num_seqs=4,
        async_scheduling=async_scheduling, compilation_config={"cudagraph_capture_sizes": [1, 4]},
    )  # fmt: skip
    runner = llm.llm_engine.runner
    graphs = runner.graphs
    assert graphs is not None and graphs.tail_rows == 4 and graphs.sampling is not None
    counted = _launches_beside_the_forward(graphs, runner, "launch", "decode", lambda out: out.scheduled)
    params = SamplingParams(temperature=0.8 if sampled else 0, top_p=0.9, max_tokens=4, ignore_eos=True)
    llm.generate([[5, 6, 7]], params, use_tqdm=False)  # batch 1
    # 3 rows padded to 4 (sampled: one with a seed, its own generator)
    llm.generate([[5, 6, 7], [8, 9], [1, 2, 3, 4]], [params, params.clone(seed=3), params], use_tqdm=False)
    # in order (async scheduling off) the host reads the row checks before it samples
    want = {"copy_": 2 + sampled} if async_scheduling else {"copy_": 1 + sampled, "all": 1, "is_nonzero": 1}
    assert len(counted) == 6 and graphs.draws == (6 if sampled else 0)
    if sampled:  # the uniforms: drawn on the host, one draw per generator (the engine's, the seeded row's)
        assert [ops.pop("rand") for ops in counted] == [1, 1, 1, 2, 2, 2]
    assert all(ops == want for ops in counted), counted


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_sampled_decode_steps_draw_in_their_graphs_as_eager_steps_draw(tmp_path, static_graphs, async_scheduling):
    """Sampled rows - seeded or from the engine's generator, temperature, top-k, top-p, min-p, beside
    greedy ones - draw in the decode graphs' sampling graphs (graph_sampling.py) the tokens an
    eager engine draws; steps without top-k or top-p take the variant without the sort. Rows
    asking for logprobs (up to the 20 the graphs score; greedy ones too) get from the scores the
    logprobs, ranks and top lists the eager sampler gives over the same replayed logits (an eager
    forward's logits may differ in their last bits)."""
    _write_llama(tmp_path)
    base = dict(dtype="float32", device=str(device()), max_model_len=64, max_num_seqs=8, block_size=8)
    llm = LLM(
        str(tmp_path), **base, async_scheduling=async_scheduling,
        compilation_config={"cudagraph_capture_sizes": [1, 4, 8]},
    )  # fmt: skip
    eager = LLM(str(tmp_path), **base, enforce_eager=True)
    # the same replayed steps, every draw by the eager sampler
    eager_draws = LLM(
        str(tmp_path), **base, async_scheduling=async_scheduling,
        compilation_config={"cudagraph_capture_sizes": [1, 4, 8]},
    )  # fmt: skip
    assert eager_draws.llm_engine.runner.graphs is not None
    eager_draws.llm_engine.runner.graphs.refuse("sample", "this test's reference")
    prompts = [[5, 6, 7], [8, 9], [1, 2, 3, 4, 5, 6], [11, 12], [40, 41, 42]]
    mixes = [
        [
            SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True),
            SamplingParams(temperature=0.7, top_p=0.9, seed=3, max_tokens=6, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
            SamplingParams(temperature=1.0, top_k=5, min_p=0.05, max_tokens=6, ignore_eos=True),
            SamplingParams(temperature=1.3, min_p=0.1, max_tokens=4, ignore_eos=True),  # ends first: 4 rows
        ],
        SamplingParams(temperature=0.9, min_p=0.02, max_tokens=5, ignore_eos=True),  # no sort
        [
            SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3),
            SamplingParams(temperature=0.8, top_p=0.95, seed=4, max_tokens=6, ignore_eos=True, logprobs=0),
            SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True),
            SamplingParams(temperature=0.7, seed=9, max_tokens=6, ignore_eos=True, logprobs=20),
            SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
        ],
    ]
    graphs = llm.llm_engine.runner.graphs
    assert graphs is not None and graphs.sampling is not None and not graphs.failed  # the check at start-up passed
    sampling, variants = graphs.sampling, []
    real_replay = sampling.replay

    def replay(logits, sort):  # type: ignore[no-untyped-def]
        variants.append(sort)
        return real_replay(logits, sort)

    sampling.replay = replay  # type: ignore[method-assign]
    for params, sort in zip(mixes, (True, False, True)):
        variants.clear()
        got, want, same_logits = (e.generate(prompts, params, use_tqdm=False) for e in (llm, eager, eager_draws))
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        assert [_logprobs(o) for o in got] == [_logprobs(o) for o in same_logits]
        assert len(variants) >= 4 and set(variants) == {sort}  # the decode steps drew in the graphs
    engine = llm.llm_engine
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks


def _logprobs(out: Any) -> list[list[tuple[int, float, int]]] | None:
    """Each step's (token, logprob, rank) entries of a request's first completion, exactly."""
    entries = out.outputs[0].logprobs
    if entries is None:
        return None
    return [sorted((t, lp.logprob, lp.rank) for t, lp in step.items()) for step in entries]


def test_the_card_times_the_folded_one_row_step_and_keeps_the_faster(tmp_path, static_graphs, caplog):
    """On a GPU the batch-1 decode graph is captured twice, with and without its norms and SiLU
    folded into its products (kernels/triton_gemv.py), and the faster replay kept, said in the log;
    either way the tokens are transformers' (float32)."""
    if device().type != "cuda":
        pytest.skip("timed on a card (a CPU runs the folded step in tests/model/test_triton_gemv.py)")
    hf = _make("llama")
    hf.save_pretrained(tmp_path, safe_serialization=True)
    _write_tokenizer(tmp_path)
    caplog.set_level(logging.INFO, logger="prefixkv")
    llm = LLM(str(tmp_path), dtype="float32", device="cuda", max_model_len=64, max_num_seqs=4)
    graphs = llm.llm_engine.runner.graphs
    assert graphs is not None and graphs.one_row_timing is not None and ("decode", 1) in graphs.graphs
    assert "a batch-1 decode step replayed in" in caplog.text
    prompt = [5, 17, 99, 3, 42, 7]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(hf, prompt, 6) and graphs.replays > 0


def test_replayed_decode_steps_sample_from_their_graphs_logits_as_eager_steps_do(tmp_path, static_graphs):
    """A decode graph computes its rows' logits (cuda_graphs.DecodeTail); every request that is not
    plain greedy samples from them as from an eager step's: logprobs, seeded draws, penalties,
    min_tokens, allowed_token_ids - the same tokens and logprobs as an eager engine's."""
    _write_llama(tmp_path)
    base = dict(dtype="float32", device=str(device()), max_model_len=64, max_num_seqs=8, block_size=8)
    llm = LLM(str(tmp_path), **base, compilation_config={"cudagraph_capture_sizes": [1, 4, 8]})
    eager = LLM(str(tmp_path), **base, enforce_eager=True)
    prompts = [[5, 6, 7], [8, 9], [1, 2, 3, 4, 5, 6], [11, 12], [40, 41, 42]]
    params = [
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.8, seed=3, max_tokens=10, ignore_eos=True, top_p=0.9),
        SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.3, min_tokens=6),
        # (constraints edit logits on the host: its steps take the eager LM head; after it, the graph's)
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, allowed_token_ids=[3, 9, 27, 81]),
    ]
    got, want = (e.generate(prompts, params, use_tqdm=False) for e in (llm, eager))
    graphs = llm.llm_engine.runner.graphs
    assert graphs is not None and graphs.replays > 0 and graphs.tail_rows == 8
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for a, b in zip(got[1].outputs[0].logprobs or [], want[1].outputs[0].logprobs or []):
        assert a.keys() == b.keys()
        for token in a:
            assert a[token].logprob == pytest.approx(b[token].logprob, abs=1e-5)


def test_a_replayed_mixed_steps_inputs_reach_the_buffers_in_one_copy(tmp_path, static_graphs):
    """A mixed step's ids, positions, slots, sequences, tile map and block tables go to the device
    in one copy from the host's flat buffer (MixedLayout). Counted on a CPU, the forward left out
    (a GPU's replay: one launch)."""
    if device().type != "cpu":
        pytest.skip("counted under Triton's interpreter")
    _write_llama(tmp_path)
    llm = LLM(
        str(tmp_path), dtype="float32", device="cpu", max_model_len=64, max_num_seqs=4, async_scheduling=False,
        compilation_config={"cudagraph_capture_sizes": [1, 4, 16], "cudagraph_mode": "FULL"},
    )  # fmt: skip
    graphs = llm.llm_engine.runner.graphs
    assert graphs is not None
    counted = _launches_beside_the_forward(graphs, graphs, "run", "mixed", lambda scheduled: scheduled)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate([[5, 6, 7], [8, 9], [1, 2, 3, 4]], params, use_tqdm=False)
    assert counted and all(ops == {"copy_": 1} for ops in counted), counted


def test_a_step_past_the_span_limit_copies_its_tables_apart(tmp_path, static_graphs, monkeypatch):
    """Past SPAN_COPY_MAX entries (many rows of wide tables) a step copies its header, then only
    its tables' used columns: the same tokens as eager steps, decode and mixed steps replayed,
    rows growing into a second block."""
    from prefixkv.engine import cuda_graphs

    _write_llama(tmp_path)
    monkeypatch.setattr(cuda_graphs, "SPAN_COPY_MAX", 1)
    base = dict(dtype="float32", device=str(device()), max_model_len=64, max_num_seqs=4, block_size=8)
    llm = LLM(
        str(tmp_path), **base, compilation_config={"cudagraph_capture_sizes": [1, 4, 16], "cudagraph_mode": "FULL"}
    )
    eager = LLM(str(tmp_path), **base, enforce_eager=True)
    prompts = [[5, 6, 7], [8, 9], [1, 2, 3, 4, 5, 6]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got, want = (e.generate(prompts, params, use_tqdm=False) for e in (llm, eager))
    graphs = llm.llm_engine.runner.graphs
    assert graphs is not None and graphs.replays > 0 and graphs.mixed_replays > 0
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


@pytest.mark.slow(seconds=8)
@pytest.mark.parametrize("ahead", [False, True])
def test_replayed_steps_give_hidden_states_and_fill_the_stage_output_cache(tmp_path, static_graphs, ahead):
    """Steps over the fixed buffers (cudagraph_mode FULL: the prompt's too) hand their final hidden
    states on as eager steps do: a request's returned hidden states and prompt logprobs equal an
    eager engine's; and with the stage-output cache a prompt that continues that request's output
    hits the blocks its replayed mixed and decode steps completed, its prompt logprobs read from
    their stage rows equal to those of an engine that computes every position. Scheduled ahead,
    the rows of a step are written when it is booked, after the next step has replayed over the
    same buffers: they were copied out first."""
    hf = _make("llama")
    hf.save_pretrained(tmp_path, safe_serialization=True)
    _write_tokenizer(tmp_path)
    rng = random.Random(41)
    prompt = [rng.randrange(256) for _ in range(13)]
    base = dict(
        dtype="float32",
        device=str(device()),
        num_blocks=32,
        block_size=8,
        max_model_len=64,
        compilation_config={"cudagraph_capture_sizes": [1, 16], "cudagraph_mode": "FULL"},
    )
    llm = LLM(str(tmp_path), **base, enable_stage_output_cache=True, async_scheduling=ahead)
    eager = LLM(str(tmp_path), **base, enable_prefix_caching=False, enforce_eager=True)
    assert llm.llm_engine.async_scheduling == ahead
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=0, return_hidden_states=True)
    first, want_first = (e.generate([prompt], params, use_tqdm=False)[0] for e in (llm, eager))
    graphs = llm.llm_engine.runner.graphs
    assert graphs is not None and graphs.replays > 0 and graphs.mixed_replays > 0
    assert first.outputs[0].token_ids == want_first.outputs[0].token_ids
    assert first.hidden_states is not None and first.hidden_states.shape[0] == 13 + 12 - 1
    torch.testing.assert_close(first.hidden_states, want_first.hidden_states, atol=1e-4, rtol=1e-4)

    def logprobs(out):
        return [next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]]

    assert logprobs(first) == pytest.approx(logprobs(want_first), abs=1e-4)
    longer = prompt + list(first.outputs[0].token_ids)  # 25 tokens: blocks 0-2 cached, 1-2 completed by decodes
    scoring = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    got, want = (e.generate([longer], scoring, use_tqdm=False)[0] for e in (llm, eager))
    assert got.num_cached_tokens == 24
    assert logprobs(got) == pytest.approx(logprobs(want), abs=1e-4)
    engine = llm.llm_engine
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks
    assert (engine.num_steps_ahead > 0) == ahead
