"""The native CPU kernels (prefixkv/model/kernels/ops.py: decode and prefill attention, residual add +
RMSNorm)
against the PyTorch path they replace: same outputs up to float rounding, in the model and alone,
and a clean fallback where they cannot run."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import shutil

import pytest
import torch

from prefixkv.memory.block_tensors import allocate_kv_cache
from prefixkv.model import load_model
from prefixkv.model.kernels import build, ops, reference

from ..model_helpers import make_step, run_logits

pytestmark = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler: the PyTorch path runs"
)


def test_the_kernel_is_built_and_used_here():
    # this machine has a compiler and torch has OpenMP: a silent fallback would hide a regression
    assert ops.available()
    assert list(build.cache_dir().glob("prefixkv-cpu-*.so"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("groups", [(4, 4), (6, 2), (9, 3)])  # (query heads, KV heads)
def test_decode_attention_equals_gather_then_sdpa(dtype, head_dim, groups):
    Hq, Hkv = groups
    g = torch.Generator().manual_seed(head_dim + Hq)
    B, L, num_slots = 5, 70, 400
    k = torch.randn(num_slots, Hkv, head_dim, generator=g).to(dtype)
    v = torch.randn(num_slots, Hkv, head_dim, generator=g).to(dtype)
    slots = torch.randperm(num_slots, generator=g)[: B * L].view(B, L)
    lens = torch.tensor([70, 1, 33, 69, 2])
    # q as the model has it: a strided slice of a wider tensor
    q = torch.randn(B, Hq + 3, head_dim, generator=g).to(dtype)[:, :Hq]
    got = ops.decode_attention(q, k, v, slots, lens, head_dim**-0.5)
    assert got is not None and got.dtype == dtype and got.shape == (B, Hq, head_dim)
    want = reference.reference_decode_attention(q, k, v, slots, lens, head_dim**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    # a slice of the batch (rows with a stride into the caller's q) gives the same rows as the whole
    few = ops.decode_attention(q[1:3], k, v, slots[1:3], lens[1:3], head_dim**-0.5)
    assert few is not None
    torch.testing.assert_close(few.float(), want[1:3].float(), rtol=tol, atol=tol)


def test_shapes_it_does_not_take_fall_back():
    q, kv = torch.randn(2, 4, 16), torch.randn(10, 2, 16)
    slots, lens = torch.zeros(2, 3, dtype=torch.long), torch.tensor([3, 1])
    assert ops.decode_attention(q, kv, kv, slots, lens, 0.25) is None  # head_dim 16
    q, kv = torch.randn(2, 4, 64).half(), torch.randn(10, 2, 64).half()
    assert ops.decode_attention(q, kv, kv, slots, lens, 0.125) is None  # float16
    q, kv = torch.randn(2, 4, 64), torch.randn(10, 2, 64)
    assert ops.decode_attention(q, kv, kv.bfloat16(), slots, lens, 0.125) is None  # mixed dtypes
    assert ops.decode_attention(q, kv, kv, slots.int(), lens, 0.125) is None  # int32 slots
    with ops.disabled():
        assert not ops.available()
        assert ops.decode_attention(q, kv, kv, slots, lens, 0.125) is None
    assert ops.available()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_default_model_steps_match_the_pytorch_path(dtype):
    """Prefill three prompts of different lengths, then decode steps of all three: the logits with
    the kernels equal the PyTorch path's up to rounding, and the greedy tokens are the same."""
    lm = load_model(None, dtype=dtype)
    lm.model.pack_for_cpu()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 5000, (n,), generator=g).tolist() for n in (40, 17, 75)]
    blocks = [[0, 1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12, 13, 14, 15]]
    outputs = []
    for use_kernel in (True, False):
        caches = allocate_kv_cache(lm.config, 16, 16, dtype=dtype)
        seqs = [(list(p), b, 0) for p, b in zip(prompts, blocks)]
        if use_kernel:
            prefill, _ = run_logits(lm.model, caches, seqs, 16)
        else:
            with ops.disabled():
                prefill, _ = run_logits(lm.model, caches, seqs, 16)
        steps = [prefill[-3:].float()]  # the last prompt's last three rows
        for step in range(4):
            seqs = [(p + list(range(200, 201 + step)), b, len(p) + step) for p, b in zip(prompts, blocks)]
            if use_kernel:
                logits, _ = run_logits(lm.model, caches, seqs, 16)
            else:
                with ops.disabled():
                    logits, _ = run_logits(lm.model, caches, seqs, 16)
            steps.append(logits.float())
        outputs.append(torch.stack(steps))
    tol = 1e-4 if dtype == torch.float32 else 0.05 * outputs[1].abs().max().item()
    torch.testing.assert_close(outputs[0], outputs[1], rtol=tol, atol=tol)
    if dtype == torch.float32:
        assert torch.equal(outputs[0].argmax(-1), outputs[1].argmax(-1))


def test_built_once_into_the_cache_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFIXKV_CACHE_DIR", str(tmp_path))
    compiler = shutil.which("c++") or shutil.which("g++")
    # two small sources, compiled side by side and linked into one library: the caching is the
    # same for all of them (the whole library takes ~12 CPU-s)
    sources = [path for path in build.SOURCES if path.name in ("write_kv.cpp", "silu_and_mul.cpp")]
    headers = [path for path in build.HEADERS if path.name == "target.h"]
    first = build.build(compiler, sources, headers)
    assert first.parent == tmp_path / "kernels" and first.exists()
    library = ctypes.CDLL(str(first))
    assert library.prefixkv_write_kv and library.prefixkv_silu_and_mul  # both sources' entry points
    stamp = first.stat().st_mtime_ns
    assert build.build(compiler, sources, headers) == first
    assert first.stat().st_mtime_ns == stamp
    assert [p.name for p in (tmp_path / "kernels").iterdir()] == [first.name]  # no build leftovers


def test_a_failing_build_falls_back_with_a_log_line(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PREFIXKV_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", shutil.which("false") or "false")
    monkeypatch.setattr(ops, "_loaded", False)
    monkeypatch.setattr(ops, "_kernels", None)
    with caplog.at_level(logging.INFO, logger="prefixkv.model.kernels.ops"):
        assert not ops.available()
    assert "PyTorch path runs" in caplog.text
    q, kv, slots = torch.randn(2, 4, 64), torch.randn(10, 2, 64), torch.zeros(2, 3, dtype=torch.long)
    assert ops.decode_attention(q, kv, kv, slots, torch.tensor([3, 1]), 0.1) is None


@pytest.mark.parametrize("cause", ["no compiler", "a failing compiler"])
def test_one_cause_one_log_line_for_the_kernels_and_the_row_split_products(tmp_path, monkeypatch, caplog, cause):
    """What a start logs where the compiler cannot build (as on an emulated aarch64 Debian without
    g++, bench/emulated_aarch64.sh): the kernels' line, and no second one from the row-split
    operator (model/row_split.py) saying the same."""
    from prefixkv.model import row_split
    from prefixkv.model.warmup import prepare_cpu_kernels

    monkeypatch.setenv("PREFIXKV_CACHE_DIR", str(tmp_path))
    if cause == "no compiler":
        monkeypatch.delenv("CXX", raising=False)
        monkeypatch.setattr(build.shutil, "which", lambda name: None)
    else:
        monkeypatch.setenv("CXX", shutil.which("false") or "false")
    for module, loaded in ((ops, "_kernels"), (row_split, "_op")):
        monkeypatch.setattr(module, "_loaded", False)
        monkeypatch.setattr(module, loaded, None)
    monkeypatch.setattr(row_split, "_built", None)  # built beside the kernels, by prepare_cpu_kernels
    monkeypatch.setattr(ops, "_load_failure", None)
    with caplog.at_level(logging.INFO, logger="prefixkv"):
        assert prepare_cpu_kernels() == {"kernels": False, "row_split": False}
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO and "not used" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("CPU kernels not used (") and "PyTorch path runs" in said[0], said
    if cause == "no compiler":
        assert "no C++ compiler" in said[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 x 576: the parallel branch
def test_add_rms_norm_equals_add_then_transformers_norm(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    h = (torch.randn(rows, 576, generator=g) * 4).to(dtype)
    delta = torch.randn(rows, 576, generator=g).to(dtype)
    weight = (torch.rand(576, generator=g) + 0.5).to(dtype)
    want_h, want = reference.reference_add_rms_norm(h, delta, weight, 1e-5)
    stream = h.clone()
    got = ops.add_rms_norm(stream, delta, weight, 1e-5)
    assert got is not None
    assert torch.equal(stream, want_h)  # the residual add, in place, rounded as PyTorch's `h + delta`
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    h_before = h.clone()
    alone = ops.add_rms_norm(h, None, weight, 1e-5)  # norm only: h untouched
    assert alone is not None and torch.equal(h, h_before)
    torch.testing.assert_close(
        alone.float(), reference.reference_add_rms_norm(h, None, weight, 1e-5)[1].float(), rtol=tol, atol=tol
    )


def test_add_rms_norm_refuses_what_it_cannot_take_and_changes_nothing():
    h, weight = torch.randn(4, 64), torch.ones(64)
    before = h.clone()
    assert ops.add_rms_norm(h.t(), None, torch.ones(4), 1e-5) is None  # not contiguous
    assert ops.add_rms_norm(h, torch.randn(4, 64).bfloat16(), weight, 1e-5) is None  # mixed dtypes
    assert ops.add_rms_norm(h, torch.randn(4, 32), weight, 1e-5) is None  # shapes differ
    assert ops.add_rms_norm(h.half(), None, weight.half(), 1e-5) is None  # float16
    assert torch.equal(h, before)


def test_the_model_never_writes_into_the_callers_input_embeddings():
    lm = load_model(None)
    caches = allocate_kv_cache(lm.config, 4, 16)
    ids, pos, meta = make_step([(list(range(100, 110)), [0], 0)], 16)
    embeds = lm.model.embed_tokens(ids).clone()
    before = embeds.clone()
    lm.model(ids, pos, caches, meta, inputs_embeds=embeds)
    assert torch.equal(embeds, before)


def assert_decode_with_lse_matches_reference(q, k, v, slots, lens):
    """The kernel's output and log-sum-exps against the PyTorch reference (scale 1/8)."""
    lse = torch.empty(q.shape[0], q.shape[1])
    got = ops.decode_attention(q, k, v, slots, lens, 0.125, lse)
    want, want_lse = reference.reference_decode_attention_lse(q, k, v, slots, lens, 0.125)
    assert got is not None
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    tol = 1e-5 if q.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length", [700, 300, 130, 1])
def test_one_long_sequence_is_split_across_threads_and_merged(dtype, length):
    # one sequence: fewer (sequence, KV head) tasks than twice the threads, so the kernel splits the
    # keys into ranges and merges them by log-sum-exp (a short sequence leaves a range empty)
    g = torch.Generator().manual_seed(length)
    L = 700
    k, v = torch.randn(900, 3, 64, generator=g).to(dtype), torch.randn(900, 3, 64, generator=g).to(dtype)
    slots = torch.randperm(900, generator=g)[:L].view(1, L)
    lens = torch.tensor([length])
    q = torch.randn(1, 9, 64, generator=g).to(dtype)
    assert_decode_with_lse_matches_reference(q, k, v, slots, lens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_log_sum_exp_for_the_cascade_merge(dtype):
    g = torch.Generator().manual_seed(7)
    k, v = torch.randn(300, 3, 64, generator=g).to(dtype), torch.randn(300, 3, 64, generator=g).to(dtype)
    slots = torch.randperm(300, generator=g)[: 4 * 50].view(4, 50)
    lens = torch.tensor([50, 3, 1, 27])
    q = torch.randn(4, 9, 64, generator=g).to(dtype)
    assert_decode_with_lse_matches_reference(q, k, v, slots, lens)
    assert ops.decode_attention(q, k, v, slots, lens, 0.125, torch.empty(4, 9).double()) is None


def test_shared_prefix_decodes_through_the_cascade_match_the_pytorch_path():
    """Three sequences on one 96-token prefix (the same six blocks) decode together: the PyTorch
    path attends to the prefix once (cascade), the kernel reads each whole context; the logits
    agree. The chunks after the prefix go through the cascade on both paths."""
    lm = load_model(None)
    lm.model.pack_for_cpu()
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(100, 5000, (96,), generator=g).tolist()
    suffixes = [torch.randint(100, 5000, (n,), generator=g).tolist() for n in (5, 20, 11)]
    shared = [0, 1, 2, 3, 4, 5]
    blocks = [shared + [6, 7], shared + [8, 9], shared + [10, 11]]
    outputs = []
    for use_kernel in (True, False):
        caches = allocate_kv_cache(lm.config, 12, 16)
        seqs = [prefix + s for s in suffixes]
        with contextlib.nullcontext() if use_kernel else ops.disabled():
            run_logits(lm.model, caches, [(seqs[0], blocks[0], 0)], 16)
            # two chunks after the shared prefix: the cascade again, the prefill kernel for the suffixes
            chunks, _ = run_logits(lm.model, caches, [(s, b, 96) for s, b in zip(seqs[1:], blocks[1:])], 16)
        steps = [chunks[-3:]]
        for step in range(3):
            batch = [(s + list(range(300, 301 + step)), b, len(s) + step) for s, b in zip(seqs, blocks)]
            with contextlib.nullcontext() if use_kernel else ops.disabled():
                ids, pos, meta = make_step(batch, 16)
                # the PyTorch path attends to the prefix once (the cascade); with the kernel each
                # sequence reads its whole context in place, faster on a CPU
                assert (meta.plan(16, torch.device("cpu")).prefix_slots is not None) == (not use_kernel)
                steps.append(lm.model.compute_logits(lm.model(ids, pos, caches, meta)))
        outputs.append(torch.stack(steps))
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-4, atol=1e-4)
    assert torch.equal(outputs[0].argmax(-1), outputs[1].argmax(-1))


def _prefill_case(dtype, head_dim, Hq, Hkv, specs, seed=0):
    """q for the sequences of `specs` ((new tokens, keys read) each) as a strided view, a paged
    cache and their slots: what paged_attention hands the prefill kernel."""
    g = torch.Generator().manual_seed(seed)
    T = sum(n for n, _ in specs)
    num_slots = sum(kv for _, kv in specs) + 50
    k = torch.randn(num_slots, Hkv, head_dim, generator=g).to(dtype)
    v = torch.randn(num_slots, Hkv, head_dim, generator=g).to(dtype)
    q = torch.randn(T, Hq + Hkv, head_dim, generator=g).to(dtype)[:, :Hq]  # rows (Hq + Hkv) * D apart
    slots = torch.randperm(num_slots, generator=g)[: sum(kv for _, kv in specs)]
    rows, row, offset = [], 0, 0
    for n, kv in specs:
        rows.append([row, n, kv, offset])
        row, offset = row + n, offset + kv
    return q, k, v, torch.tensor(rows), slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("groups", [(4, 4), (6, 2), (9, 3)])  # (query heads, KV heads)
def test_prefill_attention_equals_the_masked_softmax(dtype, head_dim, groups):
    """A whole 70-token prompt, 5 new tokens after 40 cached, 130 after 3 (crossing key tiles),
    one token alone: outputs and log-sum-exps equal the float32 reference."""
    Hq, Hkv = groups
    q, k, v, seqs, slots = _prefill_case(dtype, head_dim, Hq, Hkv, [(70, 70), (5, 45), (130, 133), (1, 1)])
    got, want = torch.full(q.shape, 7.0, dtype=dtype), torch.full(q.shape, 7.0, dtype=dtype)
    got_lse, want_lse = torch.zeros(q.shape[:2]), torch.zeros(q.shape[:2])
    assert ops.prefill_attention(q, k, v, seqs, slots, head_dim**-0.5, got, got_lse)
    reference.reference_prefill_attention(q, k, v, seqs, slots, head_dim**-0.5, want, want_lse)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(got_lse, want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prefill_rows_values_do_not_depend_on_the_rows_computed_with_it(dtype):
    """Bit for bit: the last 37 rows of a 150-token prompt computed as a chunk after 113 cached
    tokens, alone or beside another sequence, equal the same rows of the whole prompt computed at
    once - the kernel's part of "caching on equals caching off"."""
    q, k, v, seqs, slots = _prefill_case(dtype, 64, 9, 3, [(150, 150), (20, 60)], seed=3)
    whole = torch.zeros(q.shape, dtype=dtype)
    assert ops.prefill_attention(q, k, v, seqs[:1], slots, 0.125, whole)
    chunk_q = q[113:150]
    # the chunk alone: its queries are rows 0..36, its 150 keys the prompt's slots
    alone = torch.zeros(chunk_q.shape, dtype=dtype)
    assert ops.prefill_attention(chunk_q, k, v, torch.tensor([[0, 37, 150, 0]]), slots, 0.125, alone)
    assert torch.equal(alone, whole[113:150])
    # beside the second sequence, in one call
    both_q = torch.cat([q[150:170], chunk_q]).contiguous()
    both = torch.zeros(both_q.shape, dtype=dtype)
    two = torch.tensor([[0, 20, 60, 150], [20, 37, 150, 0]])
    assert ops.prefill_attention(both_q, k, v, two, slots, 0.125, both)
    assert torch.equal(both[20:], whole[113:150])


def test_prefill_attention_refuses_what_it_cannot_take_and_writes_nothing():
    q, k, v, seqs, slots = _prefill_case(torch.float32, 64, 6, 2, [(10, 30)])
    out = torch.full(q.shape, 7.0)
    bad = [
        (q, k, v.bfloat16(), seqs, slots, out),  # mixed dtypes
        (q, k, v, seqs.int(), slots, out),  # int32 descriptors
        (q, k, v, seqs, slots.int(), out),  # int32 slots
        (q, k, v, seqs, slots, out[:5]),  # output of another shape
        (q, k, v, torch.tensor([[0, 0, 30, 0]]), slots, out),  # no new tokens
        (q, k, v, torch.tensor([[0, 10, 5, 0]]), slots, out),  # fewer keys than new tokens
        (q.transpose(0, 1).contiguous().transpose(0, 1), k, v, seqs, slots, out),  # heads not contiguous
    ]
    for args in bad:
        assert not ops.prefill_attention(*args[:5], 0.125, args[5])
    assert torch.equal(out, torch.full(q.shape, 7.0))
    with ops.disabled():
        assert not ops.prefill_attention(q, k, v, seqs, slots, 0.125, out)
    assert torch.equal(out, torch.full(q.shape, 7.0))


def test_the_plan_gives_the_native_prefill_kernel_prompts_up_to_the_chosen_length():
    """Without a measured choice the plan gives the native kernel float32 prompts of any length and
    bfloat16 ones up to the default for what the CPU multiplies on (past it PyTorch's flash kernel
    is faster); a measured limit caps either dtype, and a limit of 0 leaves every prompt, and every
    chunk after cached context, to PyTorch (the chunks in one padded attention)."""
    from prefixkv.model.attention import AttentionMetadata

    # the choices set here are undone after the test by this folder's conftest (every_native_kernel)
    for dtype in (torch.float32, torch.bfloat16):
        ops.set_choice(dtype, None)
    long, short = ops.prefill_max_new_tokens(torch.bfloat16) + 1, 40
    columns = long // 16 + 1
    blocks = torch.arange(2 * columns).view(2, columns)
    slots = torch.cat([blocks[i, pos // 16] * 16 + pos % 16 for i, pos in enumerate(map(torch.arange, (short, long)))])
    meta = AttentionMetadata(slots, [0, short, short + long], [short, long], blocks)
    fp32 = meta.plan(16, torch.device("cpu"), None, torch.float32)
    assert fp32.fresh_kernel is not None and fp32.fresh_kernel.seqs[:, 1].tolist() == [short, long]
    assert fp32.fresh_rest == []
    bf16 = meta.plan(16, torch.device("cpu"), None, torch.bfloat16)
    assert bf16.fresh_kernel is not None and bf16.fresh_kernel.seqs[:, 1].tolist() == [short]
    assert [b - a for a, b, _ in bf16.fresh_rest] == [long]

    ops.set_choice(torch.float32, ops.KernelChoice(prefill_max_tokens=short))
    meta = AttentionMetadata(slots, [0, short, short + long], [short, long], blocks)
    capped = meta.plan(16, torch.device("cpu"), None, torch.float32)
    assert capped.fresh_kernel is not None and capped.fresh_kernel.seqs[:, 1].tolist() == [short]
    assert [b - a for a, b, _ in capped.fresh_rest] == [long]

    ops.set_choice(torch.float32, ops.KernelChoice(prefill_max_tokens=0))
    # a 5-token chunk after 32 cached tokens, and a fresh prompt
    blocks = torch.arange(8).view(2, 4)
    slots = torch.cat([torch.arange(32, 37), blocks[1, torch.arange(20) // 16] * 16 + torch.arange(20) % 16])
    meta = AttentionMetadata(slots, [0, 5, 25], [37, 20], blocks)
    none = meta.plan(16, torch.device("cpu"), None, torch.float32)
    assert none.fresh_kernel is None and none.chunked_kernel is None
    assert none.chunk_batch is not None and [b - a for a, b, _ in none.fresh_rest] == [20]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 2 * 1536), (37, 2 * 83), (3, 4, 2 * 40)])
def test_silu_and_mul_equals_silu_then_mul(dtype, shape):
    """The fused gate/up activation against `F.silu(gate) * up`: float32 within the exponential's
    ~2e-7, bfloat16 rounded as PyTorch rounds (silu to bfloat16, then the product) - the same
    values but for rare one-ulp differences; the vector tail (83, 40 columns) included."""
    g = torch.Generator().manual_seed(sum(shape))
    gate_up = (torch.randn(*shape, generator=g) * 4).to(dtype)
    gate_up[..., 0] = 0.0  # silu(0) = 0 exactly
    got = ops.silu_and_mul(gate_up)
    want = reference.reference_silu_and_mul(gate_up)
    assert got is not None and got.dtype == dtype and got.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=1e-6)
        assert (got != want).float().mean() < 0.01
    assert torch.equal(got[..., 0], torch.zeros_like(got[..., 0]))


def test_silu_and_mul_refuses_what_it_cannot_take():
    assert ops.silu_and_mul(torch.randn(4, 10).half()) is None  # float16
    assert ops.silu_and_mul(torch.randn(10, 4).t()) is None  # not contiguous
    assert ops.silu_and_mul(torch.randn(4, 9)) is None  # odd width: no gate/up halves
    with ops.disabled():
        assert ops.silu_and_mul(torch.randn(4, 10)) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 64, 128, 40])  # 40: a half that is not a multiple of 16
def test_rotary_in_place_equals_the_pytorch_rotation_bit_for_bit(dtype, head_dim):
    """q and k heads rotated in place inside the fused q/k/v rows (rows wider than the rotated
    heads, v untouched), against RotaryEmbedding.apply's formulation: the same bits, both dtypes."""
    from prefixkv.model.layers import RotaryEmbedding

    g = torch.Generator().manual_seed(head_dim)
    T, heads, v_heads = 37, 12, 3
    qkv = (torch.randn(T, (heads + v_heads) * head_dim, generator=g) * 3).to(dtype)
    angles = torch.rand(T, head_dim // 2, generator=g) * 50
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(dtype)[:, None]
    sin = torch.cat((-angles.sin(), angles.sin()), -1).to(dtype)[:, None]
    x = qkv[:, : heads * head_dim].view(T, heads, head_dim)
    want = RotaryEmbedding.apply(x, cos, sin)
    v_before = qkv[:, heads * head_dim :].clone()
    got = RotaryEmbedding.apply_(x, cos, sin)
    assert got.data_ptr() == qkv.data_ptr()  # in place: no new tensor
    assert torch.equal(got, want)
    assert torch.equal(qkv[:, heads * head_dim :], v_before)


def test_rotary_refuses_what_it_cannot_take_and_changes_nothing():
    x = torch.randn(4, 2, 64)
    cos, sin = torch.randn(4, 64), torch.randn(4, 64)
    before = x.clone()
    assert not ops.rotary_(x, cos.bfloat16(), sin)  # mixed dtypes
    assert not ops.rotary_(x, cos[:3], sin[:3])  # a table per row is needed
    assert not ops.rotary_(x.transpose(0, 1), cos, sin)  # heads not contiguous
    assert not ops.rotary_(x.half(), cos.half(), sin.half())  # float16
    with ops.disabled():
        assert not ops.rotary_(x, cos, sin)
    assert torch.equal(x, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])  # float16: bytes are bytes
@pytest.mark.parametrize("tokens", [1, 5, 700])  # 700: enough to split across threads
def test_write_kv_equals_index_copy(dtype, tokens):
    """A step's K and V, strided views into the fused q/k/v rows, written into a layer's paged cache
    at scattered slots: the same cache as index_copy_ writes, every other slot untouched."""
    g = torch.Generator().manual_seed(tokens)
    Hq, Hkv, D, num_slots = 6, 2, 64, 1024
    qkv = torch.randn(tokens, (Hq + 2 * Hkv) * D, generator=g).to(dtype)
    k = qkv[:, Hq * D : (Hq + Hkv) * D].view(tokens, Hkv, D)
    v = qkv[:, (Hq + Hkv) * D :].view(tokens, Hkv, D)
    slots = torch.randperm(num_slots, generator=g)[:tokens]
    cache = torch.randn(2, num_slots, Hkv, D, generator=g).to(dtype)
    want = cache.clone()
    want[0].index_copy_(0, slots, k)
    want[1].index_copy_(0, slots, v)
    assert ops.write_kv(k, v, cache[0], cache[1], slots)
    assert torch.equal(cache, want)


def test_write_kv_refuses_what_it_cannot_take_and_writes_nothing():
    k, v = torch.randn(4, 2, 64), torch.randn(4, 2, 64)
    cache = torch.zeros(2, 16, 2, 64)
    slots = torch.tensor([3, 0, 9, 15])
    assert not ops.write_kv(k, v, cache[0], cache[1], torch.tensor([3, 0, 9, 16]))  # out of range
    assert not ops.write_kv(k, v, cache[0], cache[1], torch.tensor([3, 0, -1, 2]))  # negative
    assert not ops.write_kv(k, v, cache[0], cache[1], slots.int())  # int32 slots
    assert not ops.write_kv(k.bfloat16(), v.bfloat16(), cache[0], cache[1], slots)  # dtype differs
    assert not ops.write_kv(k.transpose(1, 2), v.transpose(1, 2), cache[0], cache[1], slots[:2])
    assert not ops.write_kv(k, v, cache[0].transpose(1, 2), cache[1].transpose(1, 2), slots)
    with ops.disabled():
        assert not ops.write_kv(k, v, cache[0], cache[1], slots)
    assert not cache.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 8, 11])  # 11: two passes over the weights (8 + 3 rows)
# 37: a padded last block of 16 columns and a padded last pair of blocks; 80: five blocks, so the
# last task of four blocks has one pair (its second block padding) where the others have two
@pytest.mark.parametrize("out_features", [37, 80, 960])
@pytest.mark.parametrize("with_bias", [False, True])
def test_small_linear_equals_f_linear(dtype, rows, out_features, with_bias):
    if not ops.small_linear_available(dtype):
        pytest.skip(f"CPU without the instructions for {dtype} (AVX-512 / AVX512-BF16): linears stay on oneDNN")
    g = torch.Generator().manual_seed(rows * out_features)
    weight = torch.randn(out_features, 576, generator=g).to(dtype)
    bias = torch.randn(out_features, generator=g) if with_bias else None
    # x as the model has it: rows of a wider tensor (a stride larger than K)
    x = torch.randn(rows, 600, generator=g).to(dtype)[:, :576]
    got = ops.small_linear(x, ops.small_linear_weight(weight), out_features, bias)
    assert got is not None and got.dtype == dtype and got.shape == (rows, out_features)
    want = torch.nn.functional.linear(x.float(), weight.float(), bias)
    if dtype == torch.float32:  # the same products, summed in another order
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
        return
    # float32 sums in another order, one bfloat16 rounding: within two units in the last place
    torch.testing.assert_close(got.float(), want, rtol=2 * 2**-8, atol=1e-2)
    # the same rounding as PyTorch's own bfloat16 linear, most of the time bit for bit
    same = (got == torch.nn.functional.linear(x, weight, None if bias is None else bias.bfloat16())).float().mean()
    assert same > 0.5


@pytest.mark.skipif(
    not ops.small_linear_available(torch.bfloat16), reason="CPU without AVX512-BF16: linears stay on oneDNN"
)
def test_small_linear_refuses_what_it_cannot_take():
    weight = torch.randn(32, 64).to(torch.bfloat16)
    packed = ops.small_linear_weight(weight)
    assert packed is not None and packed.shape == (1, 32, 2, 16, 2)
    assert ops.small_linear_weight(weight.half()) is None  # float16
    assert ops.small_linear_weight(torch.randn(32, 63).to(torch.bfloat16)) is None  # bfloat16, K odd
    x = torch.randn(2, 64).to(torch.bfloat16)
    assert ops.small_linear(x.float(), packed, 32) is None  # float32 input, bfloat16 weights
    assert ops.small_linear(x.t().contiguous().t(), packed, 32) is None  # columns apart
    assert ops.small_linear(torch.randn(2, 62).to(torch.bfloat16), packed, 32) is None  # K mismatch
    assert ops.small_linear(x, packed, 32, torch.randn(32).bfloat16()) is None  # bias not float32
    assert ops.small_linear(x, packed, 33) is None  # more outputs than the weight has blocks for
    assert ops.small_linear(x, packed, 32, torch.randn(31)) is None  # bias of another length
    with ops.disabled():
        assert ops.small_linear(x, packed, 32) is None
    assert ops.small_linear(x, packed, 32) is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# 1-13: one partial tile; 130 and 263: chunks of equal size, tiles and a partial one in each
@pytest.mark.parametrize("rows", [1, 13, 130, 263])
@pytest.mark.parametrize("out_features", [37, 80, 960])
@pytest.mark.parametrize("in_features", [576, 2304])  # 2,304: passes over spans of the steps, partial sums kept
def test_blocked_linear_is_the_small_linears_bits(dtype, rows, out_features, in_features):
    """Every row of the many-row linear is the small-batch linear's, bit for bit (so a prompt's
    logits do not depend on how many rows its step had), at 1, 2 and 3 threads; and F.linear's up
    to rounding."""
    if not ops.blocked_linear_available(dtype):
        pytest.skip(f"no many-row native linear for {dtype} here")
    g = torch.Generator().manual_seed(rows + out_features + in_features)
    weight = (torch.randn(out_features, in_features, generator=g) / in_features**0.5).to(dtype)
    bias = torch.randn(out_features, generator=g)
    packed = ops.small_linear_weight(weight)
    x = torch.randn(rows, in_features + 24, generator=g).to(dtype)[:, :in_features]
    before = torch.get_num_threads()
    try:
        for b in (None, bias):
            want = ops.small_linear(x, packed, out_features, b)
            assert want is not None
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                got = ops.blocked_linear(x, packed, out_features, b)
                assert got is not None and got.dtype == dtype and got.shape == (rows, out_features)
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (b is None, threads)
    finally:
        torch.set_num_threads(before)
    reference = torch.nn.functional.linear(x.float(), weight.float(), bias)
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2 * 2**-8, atol=2e-2)
    torch.testing.assert_close(got.float(), reference, **tol)


def test_blocked_linear_refuses_what_it_cannot_take():
    if not ops.blocked_linear_available(torch.float32):
        pytest.skip("no many-row native linear here")
    weight = torch.randn(32, 64)
    packed = ops.small_linear_weight(weight)
    x = torch.randn(40, 64)
    assert ops.blocked_linear(x.t().contiguous().t(), packed, 32) is None  # columns apart
    assert ops.blocked_linear(torch.randn(40, 62), packed, 32) is None  # K mismatch
    assert ops.blocked_linear(x, packed, 33) is None  # more outputs than the weight has blocks for
    assert ops.blocked_linear(x, packed, 32, torch.randn(31)) is None  # bias of another length
    assert ops.blocked_linear(x.bfloat16(), packed, 32) is None  # another dtype than the weight's
    with ops.disabled():
        assert ops.blocked_linear(x, packed, 32) is None
    assert torch.equal(ops.blocked_linear(torch.randn(0, 64), packed, 32), torch.empty(0, 32))


def test_a_native_linear_layer_takes_any_rows_and_works_with_the_kernels_off():
    """NativeLinear (one copy, the native layout): the small-batch kernel for a decode step's rows,
    the blocked one for more, the same bits for a row either way; with the kernels switched off
    after the layout was made, F.linear on the weight read back from it."""
    from prefixkv.model.layers import NativeLinear

    if not ops.blocked_linear_available(torch.float32):
        pytest.skip("no many-row native linear here")
    g = torch.Generator().manual_seed(5)
    weight, bias = torch.randn(70, 64, generator=g), torch.randn(70, generator=g)
    layer = NativeLinear(weight, bias)
    x = torch.randn(2, 150, 64, generator=g)  # leading dims flattened: 300 rows
    many = layer(x)
    assert many.shape == (2, 150, 70)
    few = layer(x[0, :3])
    assert torch.equal(few, many[0, :3])
    torch.testing.assert_close(many, torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
    with ops.disabled():
        assert torch.equal(layer(x), torch.nn.functional.linear(x, weight, bias))
    with pytest.raises(ValueError, match="no native linear kernel"):
        NativeLinear(weight.half())
