"""Kernels chosen by measured speed (prefixkv/model/kernels/choice.py): the timing picks the faster
path and caps the prefill kernel where it loses; the answer is kept on disk and read back, a
broken file is measured again; the choice is in force for its dtype; a model runs and answers the
same whichever kernels were chosen; and every build this CPU can execute passes the kernels'
equality tests (x86-64-v3 = AVX2 + FMA, x86-64-v4 = AVX-512, besides the native one), unless it
compiles the same code as the native one (an AVX2-only CPU's x86-64-v3 build)."""

from __future__ import annotations

import gc
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from prefixkv import LLM, SamplingParams
from prefixkv.model import weight_cache
from prefixkv.model.kernels import build, ops
from prefixkv.model.kernels import choice as kernel_choice
from prefixkv.model.kernels.choice import KernelShapes, Timed

pytestmark = pytest.mark.skipif(not ops.available(), reason="no native CPU kernels here")

SHAPES = KernelShapes(hidden=64, intermediate=96, heads=4, kv_heads=2, head_dim=32, dtype="float32")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A cache folder of the test's own and timing switched on (the folder's conftest puts the
    choices back as they were after the test)."""
    monkeypatch.setenv("PREFIXKV_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(kernel_choice.ENV_MODE, "auto")
    kernel_choice._made.clear()
    yield tmp_path
    kernel_choice._made.clear()


def fake_timer(slower: set[str]):
    """A stand-in for kernel_choice._time: the native path takes 1 ms, PyTorch 2 ms - or 0.5 ms
    for the comparisons whose description starts with one of `slower` (there native loses)."""

    def timed(native, reference, what, reps=7):
        native()
        reference()
        loses = any(what.startswith(prefix) for prefix in slower)
        return Timed(what, 1.0, 0.5 if loses else 2.0)

    return timed


def test_the_faster_path_is_chosen_and_the_prefill_kernel_capped_where_it_loses(fresh, monkeypatch):
    monkeypatch.setattr(kernel_choice, "_time", fake_timer({"rotary", "prefill attention, 2048"}))
    made = kernel_choice.choose(SHAPES)
    assert made == ops.choice(torch.float32)
    assert made.prefill_max_tokens == 512  # won at 128 and 512, lost at 2,048
    assert not made.rotary and made.decode_attention and made.add_rms_norm and made.silu_and_mul
    assert ops.prefill_max_new_tokens(torch.float32) == 512
    assert ops.decode_attention_available(torch.float32)
    x = torch.randn(3, 4, 32)
    angles = torch.rand(3, 16)
    cos, sin = torch.cat((angles.cos(),) * 2, -1), torch.cat((-angles.sin(), angles.sin()), -1)
    assert not ops.rotary_(x, cos, sin)  # PyTorch's then
    assert ops.rotary_(x.bfloat16(), cos.bfloat16(), sin.bfloat16())  # another dtype: untouched


def test_the_small_linear_takes_steps_up_to_the_most_rows_it_won_at(fresh, monkeypatch):
    if not ops.small_linear_available(torch.float32):
        pytest.skip("no small-batch linear kernel here")
    monkeypatch.setattr(kernel_choice, "_time", fake_timer({"small linear, 8 rows", "small linear, 16 rows"}))
    made = kernel_choice.choose(SHAPES)
    assert made.small_linear and made.small_linear_max_rows == 4
    assert ops.small_linear_max_rows(torch.float32) == 4
    from prefixkv.model.layers import DualLayoutLinear

    layer = DualLayoutLinear(torch.randn(48, 64))
    assert layer.small is not None and layer.small_rows == 4


def test_a_prefill_kernel_that_loses_at_the_shortest_length_takes_nothing(fresh, monkeypatch):
    monkeypatch.setattr(kernel_choice, "_time", fake_timer({"prefill attention, 128", "decode attention"}))
    made = kernel_choice.choose(SHAPES)
    assert made.prefill_max_tokens == 0 and not made.decode_attention
    assert ops.prefill_max_new_tokens(torch.float32) == 0
    assert not ops.decode_attention_available(torch.float32)


def test_the_answer_is_kept_on_disk_and_a_broken_file_is_measured_again(fresh, monkeypatch):
    monkeypatch.setattr(kernel_choice, "_time", fake_timer({"SiLU"}))
    first = kernel_choice.choose(SHAPES)
    files = list((fresh / "kernel-choice").glob("*.json"))
    assert len(files) == 1 and not first.silu_and_mul
    assert json.loads(files[0].read_text())["choice"]["silu_and_mul"] is False

    kernel_choice._made.clear()  # a new process: read from disk, not timed
    monkeypatch.setattr(kernel_choice, "_time", lambda *a, **k: pytest.fail("timed again"))
    assert kernel_choice.choose(SHAPES) == first

    kernel_choice._made.clear()
    files[0].write_text("{not json")
    monkeypatch.setattr(kernel_choice, "_time", fake_timer(set()))
    assert kernel_choice.choose(SHAPES).silu_and_mul  # measured again, and written again
    assert json.loads(files[0].read_text())["choice"]["silu_and_mul"] is True


def test_native_mode_skips_the_timing(fresh, monkeypatch):
    monkeypatch.setenv(kernel_choice.ENV_MODE, "native")
    monkeypatch.setattr(kernel_choice, "_time", lambda *a, **k: pytest.fail("timed"))
    assert kernel_choice.choose(SHAPES) is None
    monkeypatch.setenv(kernel_choice.ENV_MODE, "native,-blocked_linear, -prefill_attention")
    fixed = kernel_choice.choose(SHAPES)
    assert fixed == ops.KernelChoice(prefill_max_tokens=0, blocked_linear=False, blocked_linear_faster=False)
    assert ops.choice(torch.float32) == fixed and not ops.blocked_linear_available(torch.float32)
    assert ops.prefill_max_new_tokens(torch.float32) == 0
    assert "blocked_linear" in kernel_choice.describe(SHAPES)[0]
    for bad in ("sometimes", "native,-fast_path", "native,rotary", "auto,-rotary"):
        monkeypatch.setenv(kernel_choice.ENV_MODE, bad)
        with pytest.raises(ValueError, match="PREFIXKV_KERNEL_CHOICE"):
            kernel_choice.choose(SHAPES)


def test_real_timing_gives_a_choice_and_its_lines(fresh):
    """Timed for real on a small shape: every comparison has a line and a positive time."""
    made, lines = kernel_choice.measure(SHAPES)
    assert isinstance(made, ops.KernelChoice)
    assert any(line.startswith("prefill attention, 128 tokens") for line in lines)
    assert all("native " in line and "PyTorch " in line for line in lines)


def test_a_loss_between_wins_does_not_cap_a_kernel(fresh, monkeypatch):
    """The small-batch linear losing at 2 rows only (noise, physically it streams the weights
    faster at every row count timed) still takes steps up to 16 rows; losing at 8 and 16 caps it at 4."""
    if not ops.small_linear_available(torch.float32):
        pytest.skip("no small-batch linear kernel here")
    monkeypatch.setattr(kernel_choice, "_time", fake_timer({"small linear, 2 rows"}))
    assert kernel_choice.choose(SHAPES).small_linear_max_rows == 16
    runs = [Timed("", 1.0, 2.0), Timed("", 1.0, 0.5), Timed("", 1.0, 2.0)]
    assert kernel_choice._cap(runs, (1, 2, 4)) == 4
    assert kernel_choice._cap(runs[:2], (1, 2)) == 1
    assert kernel_choice._cap([Timed("", 1.0, 2.0), Timed("", 3.0, 0.5), Timed("", 1.0, 2.0)], (1, 2, 4)) == 1
    assert kernel_choice._cap([Timed("", 1.0, 0.5), Timed("", 1.0, 2.0)], (1, 2)) == 0  # lost at the smallest


def test_the_weights_keep_one_layout_only_where_the_many_row_linear_won(fresh, monkeypatch):
    """Timed at least as fast as oneDNN at a prefill's rows, the many-row native linear runs and is
    preferred (the layers keep one copy, the native layout: NativeLinear); within the tolerance but
    slower, it runs where a second copy would not fit (test_model_gguf_file.py); slower still, it
    does not run."""
    if not ops.blocked_linear_available(torch.float32):
        pytest.skip("no many-row native linear here")
    monkeypatch.setattr(kernel_choice, "_time", fake_timer({"many-row linear"}))
    made = kernel_choice.choose(SHAPES)
    assert made.small_linear and not made.blocked_linear and not ops.blocked_linear_available(torch.float32)
    kernel_choice._made.clear()
    monkeypatch.setenv(kernel_choice.ENV_MODE, "measure")  # not the answer kept on disk above
    monkeypatch.setattr(kernel_choice, "_time", fake_timer(set()))
    assert kernel_choice.choose(SHAPES).blocked_linear and ops.blocked_linear_faster(torch.float32)
    kernel_choice._made.clear()  # within the tolerance, but slower: usable, not preferred
    monkeypatch.setattr(
        kernel_choice,
        "_time",
        lambda native, reference, what, reps=7: Timed(what, 1.03 if what.startswith("many-row") else 1.0, 1.0),
    )
    made = kernel_choice.choose(SHAPES)
    assert made.blocked_linear and not made.blocked_linear_faster
    assert ops.blocked_linear_available(torch.float32) and not ops.blocked_linear_faster(torch.float32)
    lines = kernel_choice.measure(SHAPES)[1]
    assert [line for line in lines if line.startswith("many-row linear, 256 rows x 64 -> 192")]
    assert [line for line in lines if line.startswith("many-row linear, 256 rows x 96 -> 64")]


def test_outputs_are_the_same_whichever_kernels_were_chosen(fresh, monkeypatch):
    """The default model, greedy float32: every kernel native, every one PyTorch's, and a mixed
    choice give the same tokens (the paths agree within rounding; the test prompt is one where
    rounding decides nothing)."""
    monkeypatch.setenv(kernel_choice.ENV_MODE, "measure")  # the stand-in below, never the file
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompt = "The capital of France is Paris. The capital of Italy is"
    results = []
    for choice in (
        ops.KernelChoice(),
        ops.KernelChoice(
            prefill_max_tokens=0,
            decode_attention=False,
            small_linear=False,
            blocked_linear=False,
            add_rms_norm=False,
            silu_and_mul=False,
            rotary=False,
            write_kv=False,
        ),
        ops.KernelChoice(prefill_max_tokens=4, rotary=False, silu_and_mul=False),
        ops.KernelChoice(blocked_linear=False),  # oneDNN's layout for prefills, the native one for decode
    ):
        monkeypatch.setattr(kernel_choice, "measure", lambda shapes, c=choice: (c, ["fixed"]))
        kernel_choice._made.clear()
        llm = LLM(dtype="float32", max_model_len=256, kv_cache_memory_bytes=32 << 20, cpu_thread_policy="fixed")
        assert ops.choice(torch.float32) == choice
        results.append(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
        del llm
        gc.collect()  # one default-model engine alive at a time
    assert results[0] == results[1] == results[2] == results[3]


OTHER_ARCHES = [a for a in build.ARCHES if a != "native"]


def _source_macros(target: str) -> dict[str, str]:
    """The predefined macros (name: value) that the kernel sources' preprocessor lines test, as a
    build for `target` defines them: two targets that agree compile the same code."""
    tested: set[str] = set()
    for path in build.SOURCES + build.HEADERS:
        for line in path.read_text().splitlines():
            if line.lstrip().startswith("#"):
                tested.update(re.findall(r"\b__\w+", line))
    done = subprocess.run(
        [build.compiler(), f"-march={target}", "-dM", "-E", "-x", "c++", os.devnull],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    defined = {}
    for line in done.stdout.splitlines():  # "#define NAME VALUE"
        _, name, *value = line.split(" ", 2)
        defined[name] = value[0] if value else ""
    return {name: defined[name] for name in tested if name in defined}


@pytest.mark.parametrize("arch", OTHER_ARCHES)
def test_each_build_this_cpu_runs_passes_the_kernel_tests(arch, tmp_path):
    """The kernels compiled for another x86-64 level than this CPU's own pass the equality tests
    where this CPU executes that level: an AVX-512 machine tests the AVX2 build its users on
    AVX2-only CPUs run."""
    if not build.arch_runs_here(arch):
        pytest.skip(f"this CPU does not execute {arch} code")
    if _source_macros(arch) == _source_macros(build.arch()):
        # an AVX2-only CPU's native build: test_ops.py runs this very code already
        pytest.skip(f"the {arch} build compiles the same code as this CPU's own ({build.arch()}) build")
    tests = Path(__file__).with_name("test_ops.py")
    env = {**os.environ, build.ARCH_ENV: arch}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", str(tests)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout


def test_bfloat16_without_bfloat16_arithmetic_is_said_once(monkeypatch, caplog):
    """On an AVX2 CPU without AVX512-BF16 or AMX, asking for bfloat16 logs one warning that it is
    emulated (slower than float32); with the instructions, or for float32, nothing."""
    monkeypatch.setattr(kernel_choice, "_warned_bf16", False)
    monkeypatch.setattr(build, "cpu_flags", lambda: "flags\t: fpu sse2 avx avx2 fma avx512f avx512_bf16")
    assert not kernel_choice.warn_if_bfloat16_is_emulated(torch.bfloat16)
    monkeypatch.setattr(build, "cpu_flags", lambda: "flags\t: fpu sse2 avx avx2 fma")
    assert not kernel_choice.warn_if_bfloat16_is_emulated(torch.float32)
    with caplog.at_level("WARNING", logger="prefixkv.model.kernels.choice"):
        assert kernel_choice.warn_if_bfloat16_is_emulated(torch.bfloat16)
        assert not kernel_choice.warn_if_bfloat16_is_emulated(torch.bfloat16)  # once
    assert [r.getMessage() for r in caplog.records if "no bfloat16 arithmetic" in r.getMessage()]


def test_the_kernels_command_prints_each_comparison_and_the_choice(tmp_path):
    """`prefixkv kernels` on the embedded model: the CPU, the build, a line per timed comparison
    and the summary; the answer is then on disk. A cache folder without any kernel choice, holding
    what this machine built and dequantized already (the build and the weight cache are tested
    elsewhere): what runs is the timing, not a compile."""
    shutil.copytree(build.cache_dir(), tmp_path / "kernels")
    weights = weight_cache.folder()
    if weights.is_dir():
        (tmp_path / "weights").symlink_to(weights, target_is_directory=True)
    env = {**os.environ, "PREFIXKV_CACHE_DIR": str(tmp_path), kernel_choice.ENV_MODE: "auto"}
    done = subprocess.run(
        [sys.executable, "-m", "prefixkv.cli", "kernels"], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert out.startswith("CPU: ") and "build target native" in out
    assert "prefill attention, 512 tokens: native" in out and "native prefill attention for" in out
    assert list((tmp_path / "kernel-choice").glob("*.json"))
