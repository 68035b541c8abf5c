"""The KV budget on a GPU from vLLM's `gpu_memory_utilization`: the fraction of the card's memory
this engine may hold - its weights, one step's activations at most, the KV cache - the KV cache
getting what the other two leave. As vLLM does, the activations are measured, not guessed: one
forward of the largest step the scheduler may run (`max_num_batched_tokens` new tokens, logits for
`max_num_seqs` rows and their draws) on throwaway KV blocks, its peak allocation over what was there
before.

Not given, the KV budget stays `kv_cache_memory_bytes` (1 GiB by default), as on a CPU: a test
suite or a second engine on the same card is not squeezed out by a first one taking 90% of it.
"""

from __future__ import annotations

import torch

from ..memory.block_tensors import allocate_kv_cache
from ..model import AttentionMetadata, LlamaModel
from .sampler import SAMPLE_PARAMS, draw_fixed

GIB = 1 << 30


def kv_budget_bytes(utilization: float, total: int, free: int, held: int, weights: int, activations: int) -> int:
    """Bytes left for the KV cache: `utilization` x `total` less the `weights` and peak
    `activations`. `free` is what the card has free now and `held` what this process holds of the
    rest (its weights among it): a share larger than both together would need memory that other
    processes hold, and is refused, as by vLLM."""
    requested = int(utilization * total)
    if requested > free + held:
        raise ValueError(
            f"gpu_memory_utilization={utilization} asks for {requested / GIB:.1f} GiB of the GPU's "
            f"{total / GIB:.1f} GiB, but only {(free + held) / GIB:.1f} GiB are free for this engine "
            "(other processes hold the rest): lower it, or give kv_cache_memory_bytes"
        )
    left = requested - weights - activations
    if left <= 0:
        raise ValueError(
            f"gpu_memory_utilization={utilization} ({requested / GIB:.2f} GiB) leaves nothing for the KV cache "
            f"after the weights ({weights / GIB:.2f} GiB) and one step's activations ({activations / GIB:.2f} GiB)"
        )
    return left


def profile_step(tokens: int, seqs: int, block_size: int) -> tuple[torch.Tensor, AttentionMetadata, int]:
    """A step of `tokens` new tokens to measure (positions, metadata, the blocks it needs): one
    prompt, or with `seqs` > 1 as many requests of two tokens as fit (the last takes the rest), each
    from a block's last position - the most block-aligned segments a recurrent layer's scan can
    be given (model/static_scan.segments_for), which a replayed mixed step always computes."""
    if seqs <= 1 or tokens < 4:
        blocks = (tokens + block_size - 1) // block_size
        meta = AttentionMetadata(torch.arange(tokens), [0, tokens], [tokens], torch.arange(blocks)[None])
        return torch.arange(tokens), meta, blocks
    n = min(seqs, tokens // 2)
    lens = [2] * (n - 1) + [tokens - 2 * (n - 1)]
    start = block_size - 1
    width = (start + lens[-1] + block_size - 1) // block_size  # the longest request's blocks
    tables = torch.arange(n * width).view(n, width)
    positions = torch.cat([torch.arange(start, start + m) for m in lens])
    rows = torch.repeat_interleave(torch.arange(n), torch.tensor(lens))
    slots = tables[rows, positions // block_size] * block_size + positions % block_size
    qsl = [0]
    for m in lens:
        qsl.append(qsl[-1] + m)
    return positions, AttentionMetadata(slots, qsl, [start + m for m in lens], tables), n * width


@torch.inference_mode()
def peak_step_activations(model: LlamaModel, tokens: int, rows: int, block_size: int, seqs: int = 1) -> int:
    """Bytes one step of `tokens` new tokens with `rows` logits rows, and their draws, allocates at
    its peak on the model's CUDA device, over what was allocated before (its throwaway KV blocks
    included); with `seqs` > 1, in as many requests as `profile_step` lays out."""
    device = model.device
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    positions, meta, blocks = profile_step(tokens, seqs, block_size)
    caches = allocate_kv_cache(model.config, blocks, block_size, dtype=model.dtype, device=device)
    ids = torch.zeros(tokens, dtype=torch.long)
    hidden = model(ids, positions, caches, meta)
    logits = model.compute_logits(hidden[-min(rows, tokens) :]).float()
    # their draws with top-k / top-p (a sort of whole rows), as a sampled step makes them
    draw_fixed(logits, torch.zeros(SAMPLE_PARAMS, logits.shape[0], dtype=torch.float64, device=device), sort=True)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del caches, hidden, logits
    torch.cuda.empty_cache()
    return peak


def cuda_kv_budget(
    model: LlamaModel,
    utilization: float,
    max_tokens: int,
    max_rows: int,
    block_size: int,
    graph_rows: int,
    graph_logits_rows: int,
    staging_bytes: int = 0,
) -> int:
    """The KV budget in bytes on the model's CUDA device for `gpu_memory_utilization`.
    `graph_rows`: the most rows a step captured as a CUDA graph has (a decode batch or a mixed
    step's tokens; 0: none). The graphs' memory pool is held beside the eager steps' activations;
    it is reserved as what one forward of that many tokens allocates at its peak, with the logits
    of `graph_logits_rows` rows, their draws and a copy of those logits (the decode graphs' tail,
    cuda_graphs.tail_rows, and the draws' graphs, graph_sampling.py; the capture logs the real figure) - for a recurrent
    model over the most segments a replayed step computes, `max_rows` requests of two tokens
    (`profile_step`). `staging_bytes`: device buffers held beside them (the KV tiers' copies)."""
    device = model.device
    activations = peak_step_activations(model, max_tokens, max_rows, block_size) + staging_bytes
    if graph_rows:
        seqs = max_rows if model.config.is_recurrent else 1
        activations += peak_step_activations(model, graph_rows, max(1, graph_logits_rows), block_size, seqs)
        # the logits' raw copy, kept where edited rows are scored (GraphSampling.raw)
        activations += graph_logits_rows * model.config.vocab_size * 4
    free, total = torch.cuda.mem_get_info(device)
    held = torch.cuda.memory_reserved(device)
    weights = torch.cuda.memory_allocated(device)  # all this process holds there now: its weights at least
    return kv_budget_bytes(utilization, total, free, held, weights, activations)
