"""Threads per step under CPU contention (prefixkv/engine/cpu_threads.py): the foreign load is
measured from a real busy neighbour process, the engine changes its thread count beside one, and
outputs are the same bit for bit whatever the count."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from prefixkv import LLM, SamplingParams
from prefixkv.engine import cpu_threads
from prefixkv.engine.cpu_threads import (
    CONTENDED_CORE,
    HEAVY_STEP_TOKENS,
    PROBE_SKIPS,
    AdaptiveCpuThreads,
    ForeignLoad,
    LayerProbe,
    agreement_counts,
    thread_counts_agree,
    threads_for,
)
from prefixkv.model import ModelConfig, build_model, row_split

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="the foreign load is read from /proc/stat")

# The KV these tests need (four prompts of up to ~600 tokens, float32: 46 KB a token), not the
# default 1 GiB: several default-model engines are built here, one after another.
KV = 128 << 20
WORDS = "river mountain quiet engine paper lantern violet harbor copper signal garden winter".split()


@pytest.fixture(autouse=True)
def one_engine_at_a_time():
    """A test's default-model engines are freed before the next test builds its own."""
    yield
    gc.collect()


def text(n: int, seed: int) -> str:
    return " ".join(WORDS[(i * 7 + seed) % len(WORDS)] for i in range(n))


@contextmanager
def busy_neighbour() -> Iterator[None]:
    """Another process spinning on one of our CPUs for as long as the block runs."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def outputs(llm: LLM, prompts: list[str], max_tokens: int = 12) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=1)
    res = llm.generate(prompts, params, use_tqdm=False)
    return [
        (list(o.outputs[0].token_ids), [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
        for o in res
    ]


def test_threads_for_quiet_decode_and_prefill():
    assert threads_for(4, 4, 0.0, 1) == 4  # nobody else: the configured count, whatever the step
    assert threads_for(4, 4, 0.2, 1) == 4  # noise below a quarter core is nobody
    assert threads_for(4, 4, 0.7, 8) == 3  # one core taken: decode leaves it to its owner
    assert threads_for(4, 4, 1.6, 8) == 2
    assert threads_for(2, 2, 3.0, 1) == 1  # never below one
    assert threads_for(2, 2, 0.7, HEAVY_STEP_TOKENS) == 2  # a long prefill keeps every thread
    assert threads_for(4, 16, 12.0, 1) == 4  # the busy cores are ones we do not use
    assert threads_for(4, 16, 12.6, 1) == 3
    assert threads_for(8, 4, 0.0, 1) == 8  # a deliberate oversubscription is the caller's, when quiet


@contextmanager
def neighbour_at_nice(nice: int) -> Iterator[subprocess.Popen]:
    """A busy loop at `nice` (absolute) on our CPUs for as long as the block runs; the test is
    skipped where this process may not set that priority (a nice of 0 from a niced test run, not root)."""
    loop = f"import os; os.setpriority(os.PRIO_PROCESS, 0, {nice})\nwhile True: pass"
    proc = subprocess.Popen([sys.executable, "-c", loop], stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.3)
        if proc.poll() is not None:
            pytest.skip(f"cannot run a neighbour at nice {nice} from nice {os.getpriority(os.PRIO_PROCESS, 0)}")
        yield proc
    finally:
        proc.kill()
        proc.wait()


def windows(load: ForeignLoad, n: int = 3) -> tuple[list[float], list[float]]:
    """`n` windows of `load` (this process sleeping), and the same windows counted whole: every
    busy tick of our CPUs less our own time (what the policy counted before niced neighbours)."""
    seen, whole = [], []
    for _ in range(n):
        ticks, own, at = cpu_threads._cpu_ticks(load.cpus), time.process_time(), time.monotonic()
        time.sleep(0.4)
        now = time.monotonic()
        load.update(now)
        busy = (cpu_threads._cpu_ticks(load.cpus)[0] - ticks[0]) / cpu_threads._TICKS_PER_S
        seen.append(load.cores)
        whole.append((busy - (time.process_time() - own)) / (now - at))
    return seen, whole


def quiet_or_skip(cpus: frozenset[int]) -> None:
    """Skip where other sessions already keep our CPUs busy (a shared machine): the policy would
    rightly see them, whatever our own neighbour does."""
    load = ForeignLoad(cpus, nice=0)
    if min(windows(load, 2)[0]) >= CONTENDED_CORE:
        pytest.skip(f"other processes keep {load.cores:.2f} cores of ours busy already")


def process_cpu_seconds(pid: int) -> float:
    """User plus system time of process `pid` so far (/proc/<pid>/stat, fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / cpu_threads._TICKS_PER_S


def test_a_niced_neighbour_is_not_competition():
    """A nice-19 busy loop of our session runs on what our threads leave: a process at nice 0 does not
    count it - while the same windows counted whole show the loop's time. The loop gets a core only
    where nothing at a higher priority wants it: beside the suite's other busy workers it may get
    almost none, and then there is nothing of it to leave out."""
    cpus = frozenset(os.sched_getaffinity(0))
    with neighbour_at_nice(19) as loop:
        spent, at = process_cpu_seconds(loop.pid), time.monotonic()
        seen, whole = windows(ForeignLoad(cpus, nice=0))
        loop_cores = (process_cpu_seconds(loop.pid) - spent) / (time.monotonic() - at)
    if loop_cores < 0.5:
        pytest.skip(f"busier processes left the nice-19 loop {loop_cores:.2f} of a core")
    assert max(w - s for s, w in zip(seen, whole)) >= 0.8 * loop_cores, (seen, whole, loop_cores)  # left out


def test_a_niced_neighbour_leaves_a_quiet_machine_quiet():
    cpus = frozenset(os.sched_getaffinity(0))
    quiet_or_skip(cpus)
    with neighbour_at_nice(19):
        seen, _ = windows(ForeignLoad(cpus, nice=0))
    assert min(seen) < CONTENDED_CORE, seen


def test_a_neighbour_at_our_priority_still_counts():
    own = os.getpriority(os.PRIO_PROCESS, 0)
    with neighbour_at_nice(own):
        seen, _ = windows(ForeignLoad(frozenset(os.sched_getaffinity(0))))
    assert max(seen) >= 0.6, seen


def test_niced_processes_of_another_group_still_count():
    """A niced process in another scheduling group (here: its own session, an autogroup of its own
    where the kernel groups by session) is weighed as a group against ours: it competes."""
    own = cpu_threads._sched_group("self")
    loop = "import os; os.setsid(); os.setpriority(os.PRIO_PROCESS, 0, 19)\nwhile True: pass"
    proc = subprocess.Popen([sys.executable, "-c", loop])
    try:
        time.sleep(0.3)
        if cpu_threads._sched_group(proc.pid) == own:
            pytest.skip("a new session shares our scheduling group here (no autogroup)")
        seen, _ = windows(ForeignLoad(frozenset(os.sched_getaffinity(0)), nice=0))
    finally:
        proc.kill()
        proc.wait()
    assert max(seen) >= 0.6, seen


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: no thread to drop")
def test_adaptive_threads_keep_the_configured_count_beside_a_niced_neighbour():
    """As a process at nice 0 runs it (a niced test run would count the loop: it competes with us then)."""
    cpus = frozenset(os.sched_getaffinity(0))
    quiet_or_skip(cpus)
    configured = 2
    with neighbour_at_nice(19), torch_threads(configured):
        threads = AdaptiveCpuThreads(configured)
        threads.load = ForeignLoad(cpus, nice=0)
        for _ in range(4):
            time.sleep(0.3)
            assert threads.before_step(1) == configured, threads.load.cores
        threads.restore()
    assert threads.steps_adapted == 0


def test_foreign_load_sees_a_busy_neighbour():
    with busy_neighbour():
        load = ForeignLoad(frozenset(os.sched_getaffinity(0)))
        assert load.available
        time.sleep(0.6)  # this process sleeps: whatever runs on our CPUs is someone else
        load.update(time.monotonic())
        assert load.cores >= 0.6, load.cores


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_outputs_do_not_depend_on_the_thread_count(dtype):
    """The premise of changing threads per step: logprobs bit for bit on every count the engine may
    drop to - 1 and configured - 1 - as on the configured count (decode attention over 256+ keys
    splits its keys; the split must follow the data, not the threads). Never more than configured:
    the adaptive policy only lowers the count, and more threads than cores only wait on each other."""
    llm = LLM(
        device="cpu",
        dtype=dtype,
        max_model_len=1024,
        kv_cache_memory_bytes=KV,
        cpu_thread_policy="fixed",
    )
    if not thread_counts_agree(llm.llm_engine.runner.model, torch.get_num_threads()):
        # a CPU whose library kernels split by threads (an Intel Xeon with AMX in bfloat16, seen on a
        # GPU machine): the premise fails there, so the engine must not change counts at all
        del llm
        gc.collect()
        assert (
            LLM(device="cpu", dtype=dtype, max_model_len=1024, kv_cache_memory_bytes=KV).llm_engine.cpu_threads is None
        )
        pytest.skip("this CPU's kernels give other bits on other thread counts: adaptive threads are off")
    if dtype == "float32":
        prompts, max_tokens = [text(420, 1), "Tell me a story.", text(60, 2), text(150, 3)], 12
    else:
        # bfloat16 is emulated on CPUs without its arithmetic (6x float32's time on AVX2): the same
        # batch shape, shorter. The long prompt's decode still reads 256+ keys (kMinKeysPerPart 128
        # in csrc/decode_attention.cpp: two parts at the least), so its steps still split their keys.
        prompts, max_tokens = [text(270, 1), "Tell me a story.", text(12, 2), text(30, 3)], 4

    def both() -> tuple[list, list]:
        """The batch computed whole, then the long prompt alone - one sequence: the fewest tasks, the
        most split - from the batch's cached blocks (its prefill is the batch's; its last block and
        its decode steps are computed again), and the cache emptied for the next count."""
        batch, single = outputs(llm, prompts, max_tokens), outputs(llm, prompts[:1], max_tokens)
        assert llm.reset_prefix_cache()
        return batch, single

    configured = torch.get_num_threads()
    others = [n for n in agreement_counts(configured) if n != configured]
    if not others:
        pytest.skip("one thread configured: the engine has no other count to drop to")
    base, single = both()
    for n in others:
        with torch_threads(n):
            batch, alone = both()
        assert batch == base, f"{n} threads"
        assert alone == single, f"{n} threads, one sequence"


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="one thread has no fewer to drop to")
def test_engine_adapts_beside_a_neighbour_and_outputs_stay():
    # the long prompt's prefill is a step of HEAVY_STEP_TOKENS+ (probed), and no longer than that
    # needs: the busy neighbour spins, at our cost, for as long as the adaptive engine works
    prompts = [text(HEAVY_STEP_TOKENS + 32, 4), "Write a haiku about rivers."]
    fixed = LLM(device="cpu", max_model_len=1024, kv_cache_memory_bytes=KV, cpu_thread_policy="fixed")
    want = outputs(fixed, prompts)
    assert fixed.llm_engine.get_stats().cpu_threads == 0  # fixed: nothing adapted, no gauge
    del fixed
    gc.collect()  # one default-model engine alive at a time
    configured = torch.get_num_threads()
    with busy_neighbour():
        adaptive = LLM(
            device="cpu", max_model_len=1024, kv_cache_memory_bytes=KV
        )  # adaptive is the default; its first window spans the load
        got = outputs(adaptive, prompts)
    stats = adaptive.llm_engine.get_stats()
    assert stats.cpu_steps_adapted > 0  # the decode steps ran on fewer threads
    assert stats.cpu_steps_probed > 0  # the 160-token prefill switched count between its layers
    # ... and split its products by rows, where this machine builds the operator
    assert (stats.cpu_steps_row_split > 0) == row_split.available()
    assert not row_split.active()  # idle: products whole again
    # the gauge is the last step's window: 0.8+ cores on 2 CPUs here, 0.11 on the 16 of a GPU machine
    # (the neighbour's ticks spread over CPUs where our own threads ran too): seen, not sized
    assert stats.cpu_foreign_load > 0
    assert got == want
    layers = adaptive.llm_engine.runner.decoder_layers()
    assert len(layers) == 30 and not any(layer._forward_pre_hooks for layer in layers)  # the probe's hooks are gone
    assert torch.get_num_threads() == configured  # idle again: the caller's count is back
    assert stats.cpu_threads == configured


def test_layer_probe_times_both_counts_and_keeps_the_faster():
    probe = LayerProbe(2, 1, layers_each=2)
    assert (probe.switch_at, probe.decide_at) == (3, 5)
    assert probe.at_layer(0, 0.0) is None  # untimed: may pay for the previous step's count
    assert probe.at_layer(1, 1.0) is None  # layers 1-2 on the first count
    assert probe.at_layer(2, 2.0) is None
    assert probe.at_layer(3, 3.0) == 1  # layers 3-4 on the second
    assert probe.at_layer(4, 3.9) is None
    assert probe.at_layer(5, 4.8) == 1 and probe.chosen == 1  # 1.8 s on one thread against 2.0 on two
    assert probe.spent == pytest.approx([2.0, 1.8])
    assert probe.at_layer(6, 5.0) is None  # decided: the rest keep it
    slower = LayerProbe(2, 1, layers_each=1)
    assert [slower.at_layer(i, t) for i, t in enumerate((0.0, 1.0, 2.0, 3.5))] == [None, None, 1, 2]
    assert slower.chosen == 2  # 1.5 s on one thread against 1.0 on two
    swayed = LayerProbe(2, 1, layers_each=1, prior=(1.0, 2.0))  # earlier probes found two threads faster
    assert [swayed.at_layer(i, t) for i, t in enumerate((0.0, 1.0, 2.0, 2.8))] == [None, None, 1, 2]
    assert swayed.chosen == 2  # this probe alone says one thread (0.8 s against 1.0), the sum says two


class _TimedLayer(torch.nn.Module):
    """A layer that takes `slow_s` on `slow_threads` threads and almost nothing otherwise."""

    def __init__(self, slow_threads: int, slow_s: float) -> None:
        super().__init__()
        self.slow_threads, self.slow_s = slow_threads, slow_s
        self.ran_on: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.ran_on.append(torch.get_num_threads())
        if self.ran_on[-1] == self.slow_threads:
            time.sleep(self.slow_s)
        return x


def _contended(configured: int = 2) -> AdaptiveCpuThreads:
    """Threads on two CPUs, one of which a neighbour keeps busy (the load held, not measured)."""
    threads = AdaptiveCpuThreads(configured)
    threads.load.cpus = frozenset({0, 1})
    threads.load.cores = 0.9
    threads.load.update = lambda now: None  # type: ignore[method-assign]
    return threads


@pytest.mark.parametrize("slow_threads, expect", [(2, 1), (1, 2)])
def test_long_step_runs_its_last_layers_on_the_faster_count(slow_threads, expect):
    before = torch.get_num_threads()
    layers = torch.nn.ModuleList(_TimedLayer(slow_threads, 0.02) for _ in range(8))
    threads = _contended()
    threads.watch_layers(layers)
    threads.layers_each = 2
    try:
        assert threads.before_step(1) == 1  # a short step: the core left, no probe
        assert threads.probe is None and not row_split.active()
        assert threads.before_step(HEAVY_STEP_TOKENS) == 2  # a long one starts on every thread
        assert row_split.active() == threads.can_split  # ... its products split by rows where built
        x = torch.zeros(1)
        for layer in layers:
            x = layer(x)
        ran_on = [layer.ran_on[-1] for layer in layers]
        assert ran_on == [2, 2, 2, 1, 1] + [expect] * 3  # 0 untimed, 1-2 on two, 3-4 on one, the rest
        assert threads.steps_probed == 1 and threads.steps_adapted == 1 + (expect == 1)
        assert not any(layer._forward_pre_hooks for layer in layers)  # decided: hooks gone
        for _ in range(PROBE_SKIPS):  # decisive times (0.04 s against ~0): the next long steps skip the probe
            assert threads.before_step(HEAVY_STEP_TOKENS) == expect  # ... and run on the faster
            assert threads.probe is None and torch.get_num_threads() == expect
        assert threads.steps_probed == 1 and threads.steps_adapted == (1 + PROBE_SKIPS) * (expect == 1) + 1
        threads.before_step(HEAVY_STEP_TOKENS)  # then one probes again, weighing the earlier times
        assert threads.probe is not None and threads.probe.prior[2 - slow_threads] > 0.025
        threads.restore()
        assert torch.get_num_threads() == 2 and not row_split.active()  # the configured count, whole products
    finally:
        torch.set_num_threads(before)
        row_split.set_active(False)


def test_close_evidence_probes_every_long_step():
    """Earlier probes' times within PROBE_SKIP_MARGIN of each other decide nothing: each long step
    probes (none is skipped), and times from another pair of counts are not used."""
    before = torch.get_num_threads()
    threads = _contended()
    threads.watch_layers(torch.nn.ModuleList(_TimedLayer(2, 0.0) for _ in range(12)))
    try:
        for evidence in ((1.0, 1.1), (1.1, 1.0)):
            threads._evidence, threads._evidence_counts, threads._evidence_at = evidence, (2, 1), time.monotonic()
            threads.before_step(HEAVY_STEP_TOKENS)
            assert threads.probe is not None and threads.probe.prior == pytest.approx([0.75 * e for e in evidence])
        threads._evidence, threads._evidence_counts = (1.0, 5.0), (4, 1)  # decisive, but for other counts
        threads.before_step(HEAVY_STEP_TOKENS)
        assert threads.probe is not None and threads.probe.prior == (0.0, 0.0)
    finally:
        threads.restore()
        torch.set_num_threads(before)


def test_a_step_that_fails_mid_forward_leaves_no_probe_behind():
    before = torch.get_num_threads()
    layers = torch.nn.ModuleList(_TimedLayer(2, 0.0) for _ in range(8))
    threads = _contended()
    threads.watch_layers(layers)
    threads.layers_each = 2
    try:
        threads.before_step(2 * HEAVY_STEP_TOKENS)
        x = layers[1](layers[0](torch.zeros(1)))  # the forward raised after layer 1
        assert any(layer._forward_pre_hooks for layer in layers)
        threads.before_step(1)
        assert threads.probe is None and not any(layer._forward_pre_hooks for layer in layers)
        assert not row_split.active()  # a short step multiplies whole
        layers[3](x)  # a later forward runs untouched on the short step's count
        assert layers[3].ran_on == [1]
    finally:
        torch.set_num_threads(before)
        row_split.set_active(False)


def test_no_probe_on_a_quiet_machine_or_without_enough_layers():
    before = torch.get_num_threads()
    quiet = AdaptiveCpuThreads(2)
    quiet.load.update = lambda now: None  # type: ignore[method-assign]
    quiet.watch_layers(torch.nn.ModuleList(_TimedLayer(2, 0.0) for _ in range(8)))
    assert quiet.before_step(HEAVY_STEP_TOKENS) == 2 and quiet.probe is None
    assert not row_split.active() and quiet.steps_row_split == 0  # quiet: products whole
    shallow = _contended()
    shallow.layers_each = 2
    shallow.watch_layers(torch.nn.ModuleList(_TimedLayer(2, 0.0) for _ in range(6)))  # one layer after the choice
    try:
        assert shallow.before_step(HEAVY_STEP_TOKENS) == 2 and shallow.probe is None
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="one thread has no fewer to drop to")
def test_an_abort_that_leaves_the_engine_idle_gives_the_thread_count_back():
    """A request aborted mid-decode (a client gone, an interrupted generate) must not leave the
    process on the fewer threads its last step ran on: the caller's torch code gets its count back."""
    configured = torch.get_num_threads()
    llm = LLM(device="cpu", max_model_len=512, kv_cache_memory_bytes=KV)
    engine = llm.llm_engine
    threads = engine.cpu_threads
    assert threads is not None
    threads.load.cpus, threads.load.cores = frozenset({0, 1}), 0.9  # a neighbour keeps one core busy
    threads.load.update = lambda now: None  # type: ignore[method-assign]
    rid = engine.add_request("Tell me a story.", SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):  # the prefill and two decode steps
        engine.step()
    assert torch.get_num_threads() == 1 and engine.has_unfinished_requests()
    engine.abort_request(rid)
    assert torch.get_num_threads() == configured and not row_split.active()


def test_the_thread_check_is_measured_once_per_machine_and_kept(tmp_path, monkeypatch):
    """The start-up check costs two or three forwards (1.7 s for the default model, float32 on 2
    cores): its answer is kept on disk, keyed by the CPU, torch and prefixkv's model code, and read
    back by later engines; an unreadable answer is measured again. What is kept and when it is
    measured do not depend on the model's size: a tiny random Llama (head dim 64, as the native
    kernels take) is measured here, for real, in a fraction of the default model's time."""
    from prefixkv.engine import cpu_threads
    from prefixkv.model.kernels import ops

    ops.available()  # the native kernels from this machine's builds: the folder below would build them anew
    monkeypatch.setenv("PREFIXKV_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_threads, "_AGREEMENT", {})
    config = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=512,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=256,
    )
    model = build_model(config, torch.float32, "cpu")
    measured = []
    real = cpu_threads._measure_agreement
    monkeypatch.setattr(cpu_threads, "_measure_agreement", lambda m, c: measured.append(c) or real(m, c))
    first = thread_counts_agree(model, 2)
    (stored,) = (tmp_path / "thread-agreement").glob("*.json")
    monkeypatch.setattr(cpu_threads, "_AGREEMENT", {})  # a new process
    assert thread_counts_agree(model, 2) == first and measured == [2]  # read back, not measured
    stored.write_text("{not json")
    monkeypatch.setattr(cpu_threads, "_AGREEMENT", {})
    assert thread_counts_agree(model, 2) == first and measured == [2, 2]
