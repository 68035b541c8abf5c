"""model/host_copy.HostCopies: a step's draws read on the host without waiting for a step launched
after them (async scheduling's overlap). On a CPU the tensors themselves; on a GPU a kernel queued
after the copies is still running when they are read."""

from __future__ import annotations

import pytest
import torch

from prefixkv.engine.sampler import SampledTensors
from prefixkv.model.host_copy import HostCopies


def test_on_a_cpu_the_tensors_themselves():
    t = torch.arange(5)
    assert HostCopies([t]).wait()[0] is t
    drawn = SampledTensors(torch.tensor([3, 1]), 2)
    drawn.start_reading()
    assert drawn.result().token_ids == [3, 1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_reading_waits_for_the_copies_not_for_later_work():
    tokens = torch.arange(7, device="cuda") * 3
    chosen = torch.linspace(-1.0, 0.0, 7, device="cuda")
    vals, idx = torch.topk(torch.randn(7, 50, device="cuda"), 2)
    drawn = SampledTensors(
        tokens, 7, chosen, torch.ones(7, dtype=torch.long, device="cuda"), [(list(range(7)), vals, idx)]
    )
    drawn.start_reading()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of spinning queued after the copies: "the next step"
    got = drawn.result()
    assert not torch.cuda.current_stream().query(), "the read waited for the work queued after it"
    assert got.token_ids == list(range(0, 21, 3))
    assert got.logprobs == pytest.approx(chosen.tolist()) and got.ranks == [1] * 7
    assert got.top_logprobs is not None and [i for i, _ in got.top_logprobs[0]] == idx[0].tolist()
    torch.cuda.synchronize()


def test_host_ints_equal_torch_tensor():
    """NumPy's build of an int list gives torch.tensor's tensor: dtype, shape, values; empty and
    nested lists too; other dtypes go through torch.tensor."""
    from prefixkv.model.host_copy import host_ints, tensor_on

    cpu = torch.device("cpu")
    for values in ([3, 1, 2**40], [[1, 2], [3, 4], [5, 6]], [], [[], []]):
        got, want = host_ints(values), torch.tensor(values, dtype=torch.long)
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
        assert torch.equal(tensor_on(values, cpu, torch.long), want)
    small = host_ints([7, -1, 2**31 - 1], torch.int32)
    assert small.dtype == torch.int32 and small.tolist() == [7, -1, 2**31 - 1]
    halves = tensor_on([0.5, 1.5], cpu)
    assert halves.dtype == torch.float32 and halves.tolist() == [0.5, 1.5]
