"""Session-wide fixtures: the embedded model (ours) and its transformers reference, loaded once."""

from __future__ import annotations

import ctypes
import gc
import os

# The suite runs the test process and real server subprocesses side by side on 2 cores. OpenMP
# threads that spin while they wait steal the cores their neighbours need: a server test file ran
# 2x faster with passive waiting under load (docs/benchmarks.md, "CPU contention"). Set before
# torch loads its OpenMP runtime; subprocesses inherit it. A value the caller set wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Which native kernels run is timed on the machine at a model's first load (model/kernels/choice.py);
# the suite runs a fixed set instead, so that what a test exercises does not depend on the
# machine's load: every kernel where it applies, but a prefill's products on oneDNN, where the
# timing put them for the default model on the CPUs measured (the native many-row linear timed
# 2-5% slower on a Zen 4, 2.4x on a Zen 3, where forcing it made two default-model test files
# take 107-117 CPU-s instead of 91-92). Its own tests, and the tests of its single weight layout,
# ask for it (the `every_native_kernel` fixture); tests/model/kernels/test_choice.py times for real.
os.environ.setdefault("PREFIXKV_KERNEL_CHOICE", "native,-blocked_linear")
# An engine's build freezes the heap out of the collector's walks after a full collection
# (engine/gc_heap.py): ~0.5 s a build in a worker holding reference models, 90 s over 185 builds
# of three folders. Off here; tests/engine/test_gc_heap.py turns it on.
os.environ.setdefault("PREFIXKV_FREEZE_GC", "0")

import pytest  # noqa: E402
import torch  # noqa: E402


def _malloc_trim() -> None:
    """Hand the C heap's free pages back to the system (glibc only; elsewhere nothing to do)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


# `make test` runs the suite on pytest-xdist's workers, a file to a worker at a time (--dist
# loadfile: a module's fixtures, such as its server, start once). Much of the suite waits on
# subprocesses (servers, pip, Ray), so two workers on two cores finish in well under the time one
# takes; more workers than the memory holds would swap: each holds a model or two and a server.
WORKER_MEMORY_BYTES = 6 << 30


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker per core, as many as the available memory holds."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        available = 2 * WORKER_MEMORY_BYTES
    return max(1, min(len(os.sched_getaffinity(0)), available // WORKER_MEMORY_BYTES))


SLOW_TEST_SECONDS = 5  # what a test marked slow takes unless its marker says (slow(seconds=N))


def pytest_collection_modifyitems(config, items):
    """The longest files first, by their slow tests' estimated seconds, each file's tests kept
    together and in order: the workers start on the longest files and the short ones fill in
    around them (a long file taken last leaves the other worker idle until it ends; `make test`
    passes --no-loadscope-reorder so that xdist keeps this order)."""
    seconds: dict[object, float] = {}
    for item in items:
        marker = item.get_closest_marker("slow")
        if marker is not None:
            seconds[item.path] = seconds.get(item.path, 0) + marker.kwargs.get("seconds", SLOW_TEST_SECONDS)
    items.sort(key=lambda item: -seconds.get(item.path, 0))  # stable: files stay contiguous


@pytest.fixture(autouse=True, scope="module")
def release_memory_between_modules():
    """Engines, models and KV caches a module built may be garbage only in reference cycles, and
    freed weights land in glibc's heap, which keeps the pages: collected and trimmed here, the
    suite's resident peak is one module's working set, not the sum of every module's.

    What is still alive then lives for the rest of the session (imported modules, the session's
    models, the modules' globals): frozen out of the collector's walks (gc.freeze, as an engine
    does with its own heap: engine/gc_heap.py), so that this collection and Python's own full ones
    walk what the next module makes, not the ~450k objects of torch, transformers and the reference
    models each time (0.5 s a walk in a worker holding them)."""
    yield
    gc.collect()
    _malloc_trim()
    gc.freeze()


@pytest.fixture(autouse=True, scope="session")
def thread_check_off_the_interpreter():
    """An engine's start on a CPU checks once per machine and model shape that its outputs do not
    depend on the thread count (engine/cpu_threads.py: a 448-token prompt on each count, the answer
    kept on disk under a key of the model code, so every change to prefixkv/model measures again).
    Tests that put the GPU's fused Triton steps on CPU tensors (gpu_fused.run_on_cpu, under
    Triton's interpreter) would measure through the interpreter: 30-40 s an engine, where the
    engine on a CPU - and the answer kept for every later test - runs them as PyTorch or native
    operators. Measured that way here, whichever test builds the first engine of a shape."""
    from prefixkv.engine import cpu_threads
    from prefixkv.model.kernels import gpu_fused

    real = cpu_threads._measure_agreement

    def measure(model, configured):  # type: ignore[no-untyped-def]
        on_cpu, gpu_fused.run_on_cpu = gpu_fused.run_on_cpu, False
        try:
            return real(model, configured)
        finally:
            gpu_fused.run_on_cpu = on_cpu

    cpu_threads._measure_agreement = measure
    yield
    cpu_threads._measure_agreement = real


@pytest.fixture
def every_native_kernel(monkeypatch):
    """Every native kernel where it applies, the many-row linear included
    (PREFIXKV_KERNEL_CHOICE=native), with no choice in force; the choices as they were after."""
    from prefixkv.model.kernels import ops
    from prefixkv.model.kernels.choice import ENV_MODE

    monkeypatch.setenv(ENV_MODE, "native")
    before = dict(ops._choices)
    ops._choices.clear()
    yield
    ops._choices.clear()
    ops._choices.update(before)


@pytest.fixture(scope="session")
def default_lm():
    from prefixkv.model import load_model

    return load_model(None, dtype=torch.float32, device="cpu")


@pytest.fixture(scope="session")
def default_gguf_path():
    from prefixkv.model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def hf_ref_model(default_gguf_path):
    """transformers' own dequantization of the same GGUF: the oracle for model outputs (read once
    per machine and kept: tests/reference_copy.py)."""
    from .reference_copy import reference_model

    return reference_model(default_gguf_path)


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding with transformers' KV cache, ignoring EOS (so lengths always match)."""
    tokens: list[int] = []
    if max_new_tokens <= 0:
        return tokens
    out = model(torch.tensor([prompt_ids]), use_cache=True)
    past = out.past_key_values
    while True:
        tokens.append(int(out.logits[0, -1].argmax()))
        if len(tokens) >= max_new_tokens:  # the last token needs no forward of its own
            return tokens
        out = model(torch.tensor([tokens[-1:]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
