"""Each kind of captured step compared with the eager step on the same input, on this device, before
it serves: a replay whose final hidden states lie further from the eager step's than rounding
allows is never used - that kind of step runs eagerly, with a warning.

What a capture records is checked on a CPU (tests/engine/test_capture_safety.py: nothing read back
to the host, nothing built from host data) and the replays were compared with eager steps on an
H100 and an H200; on any other card, driver or Triton backend this is the check. It costs a few
eager steps at start-up. Mixed steps are compared where they are timed (mixed_graph_choice.py);
decode steps here (and the logits their graphs compute, cuda_graphs.DecodeTail, and the tokens
their draws' graphs draw from them, graph_sampling.py), at batch 1 and at the largest size the pool
holds less one (a padding row),
after a prefill of whole blocks (two, where the buffers' width allows) a request, so that the
decode starts a block: a recurrent layer reads the state the prefill left in the block before,
which neither run overwrites.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ..sampling_params import SamplingParams
from .sampler import sample
from .scheduler_output import ScheduledRequest

if TYPE_CHECKING:
    from .cuda_graphs import StepGraphs
    from .model_runner import ModelRunner

logger = logging.getLogger("prefixkv")


def disagreement(eager: torch.Tensor, replayed: torch.Tensor) -> float:
    """How far a replayed step's final hidden states lie from the eager step's: the norm of the
    difference over the eager states' norm (NaN or inf where either holds one)."""
    e, r = eager.float(), replayed[: eager.shape[0]].float()
    return float((e - r).norm() / e.norm().clamp_min(1e-30))


def tolerance(dtype: torch.dtype) -> float:
    """The disagreement a replay may show: float32 kernels that add in another order differ by a
    few parts in a million; 16-bit ones by up to a few percent over many layers (the default model
    in bfloat16, Triton's kernels against an AMD EPYC Zen 4's: 1.7e-2). A wrong kernel - rows of another
    request, an unwritten buffer, the capture's values - lies far beyond either."""
    return 1e-3 if dtype == torch.float32 else 0.1


def compare(
    eager: Callable[[], torch.Tensor], replay: Callable[[], torch.Tensor], dtype: torch.dtype, what: str
) -> str | None:
    """Run both on the same input (eager first); None where they agree, else what differed."""
    expected = eager().clone()  # its own copy, whatever memory the replay then writes
    off = disagreement(expected, replay())
    return None if off <= tolerance(dtype) else f"{what} disagreed with the eager step by {off:.3g}"


def decode_batches(sizes: list[int], num_blocks: int, blocks_per_request: int) -> list[int]:
    """The batches a decode check runs: 1, and the largest size whose requests' blocks the pool
    holds, less one where that leaves a padding row (replayed in the size above it)."""
    fits = [s for s in sizes if blocks_per_request * s <= num_blocks]
    if not fits:
        return []
    top = fits[-1] - 1 if fits[-1] > 2 else fits[-1]
    return sorted({1, top})


def check_decode(graphs: StepGraphs, runner: ModelRunner, num_blocks: int, max_tokens: int, dtype: torch.dtype) -> None:
    """Compare the decode replay with the eager decode step (`decode_batches`), each after a
    prefill of up to two blocks a request (what the buffers' width allows); a disagreement, or a
    check that raises, leaves decode steps eager (`StepGraphs.refuse`). Contexts of one block or
    less cannot start a decode at a block of its own: not checked then, said once."""
    if "decode" in graphs.failed:
        return
    bs = graphs.block_size
    prefill_blocks = min(2, (graphs.max_context - 1) // bs)
    if prefill_blocks < 1:
        logger.info("CUDA graphs: decode steps not compared with eager ones (contexts of one block at most)")
        return
    groups = len(graphs.group_inputs)
    vocab = runner.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    length = prefill_blocks * bs
    try:
        for batch in decode_batches(graphs.sizes, num_blocks, prefill_blocks + 1):
            prompts, decodes = [], []
            for i in range(batch):
                table = list(range((prefill_blocks + 1) * i, (prefill_blocks + 1) * (i + 1)))
                ids = torch.randint(0, vocab, (length + 1,), generator=gen).tolist()
                prompts.append(synthetic_request(f"graph-check-{i}", ids[:-1], 0, table, groups))
                decodes.append(synthetic_request(f"graph-check-{i}", ids[-1:], length, table, groups))
            per_step = max(1, max_tokens // length)
            for first in range(0, batch, per_step):  # the contexts, within the step's token budget
                runner.eager_hidden(prompts[first : first + per_step])
            wrong = compare(
                lambda: runner.eager_hidden(decodes),  # noqa: B023 (called at once)
                lambda: graphs.run(decodes, kind="decode")[0],  # noqa: B023
                dtype,
                f"the replay of {graphs.size_for(batch)} rows ({batch} decodes)",
            )
            tail = graphs.decode_tail(batch)
            if wrong is None and tail is not None:  # the LM head in the graph against the same head run eagerly
                wrong = compare(
                    lambda: runner.model.compute_logits(graphs.run(decodes, kind="decode")[0]).float(),  # noqa: B023
                    lambda: tail.logits,  # noqa: B023 (the shared buffer: the replay above rewrote it)
                    dtype,
                    f"the logits of the replay of {graphs.size_for(batch)} rows",
                )
            if wrong is not None:
                graphs.refuse("decode", wrong)
                return
            if tail is not None and graphs.sampling is not None and "sample" not in graphs.failed:
                wrong_draws = compare_draws(graphs, tail.logits, batch)
                if wrong_draws is not None:
                    graphs.refuse("sample", wrong_draws)
    except Exception as e:  # noqa: BLE001 (decode steps then run eagerly, said once)
        graphs.refuse("decode", f"comparing their replay with the eager step raised {type(e).__name__}: {e}")
    finally:
        graphs.replays = graphs.draws = 0  # served steps only (tests read them)


def compare_draws(graphs: StepGraphs, logits: torch.Tensor, batch: int) -> str | None:
    """The draws' graphs of the last replayed decode step (graph_sampling.py), both variants and
    the scores (logprobs), against the eager sampler on the same `logits` [batch, vocab] from
    generators seeded alike: None where every token, logprob, rank and top list agrees, else what
    differed."""
    sorted_params = [
        SamplingParams(temperature=0.8, top_p=0.9, top_k=40, min_p=0.02)
        if i % 2 == 0
        else SamplingParams(temperature=1.1)
        for i in range(batch)
    ]
    scored = [SamplingParams(temperature=0.9 * (i % 2), logprobs=(0, 2, None)[i % 3]) for i in range(batch)]
    for params in (sorted_params, [SamplingParams(temperature=0.9, min_p=0.05)] * batch, scored):
        try:
            eager_generators: list[torch.Generator | None] = list(_generators(batch))
            want = sample(logits.clone(), params, eager_generators, [[]] * batch, [[]] * batch).result()
            with torch.inference_mode():
                got = graphs.draw(params, _generators(batch)).result()
        except Exception as e:  # noqa: BLE001 (sampled steps then draw eagerly, said once)
            return f"comparing their draws with the eager sampler's raised {type(e).__name__}: {e}"
        if got != want:
            differ = sum(a != b for a, b in zip(got.token_ids, want.token_ids))
            size = graphs.size_for(batch)
            what = f"in {differ} of {batch} rows" if differ else "in their logprobs"
            return f"the draws of the replay of {size} rows differed from the eager sampler's {what}"
    return None


def _generators(n: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(1000 + i) for i in range(n)]


def synthetic_request(name: str, ids: list[int], start: int, table: list[int], groups: int) -> ScheduledRequest:
    """A request of a step the engine runs on itself before serving (a check, a timing): `ids` at
    positions `start`..., in `table`'s blocks, each later KV-cache group's table the same blocks;
    nothing sampled."""
    return ScheduledRequest(
        name, ids, start, table, False, SamplingParams(), None, ids, [], group_block_tables=[table] * groups
    )
