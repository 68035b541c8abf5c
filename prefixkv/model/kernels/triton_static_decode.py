"""Decode attention over buffers of a fixed shape, for a CUDA graph to capture: a graph replays
the launches it recorded on the addresses it recorded, so the step's queries, block tables and
lengths are copied into buffers allocated once (a batch padded up to the graph's size, as vLLM
pads), and the launch allocates nothing and reads nothing back to the host.

    decode = StaticDecode(max_batch=32, max_blocks=64, num_heads=9, num_kv_heads=3, head_dim=64,
                          block_size=16, dtype=torch.bfloat16, device=cuda)
    decode.prepare(q, block_tables, seq_lens)     # outside the graph, every step
    decode.run(k_cache, v_cache, scale)           # run once eagerly (Triton compiles), then capture

The layer's caches must be the same tensors at every replay (a KV cache is allocated once).
"""

from __future__ import annotations

import torch

from .triton_attention import decode_splits, decode_workspace, paged_decode


class StaticDecode:
    """Fixed buffers for one decode attention: q [max_batch, Hq, D], block tables int32
    [max_batch, max_blocks], lengths int32 [max_batch], the output, and the split's workspace."""

    def __init__(
        self,
        max_batch: int,
        max_blocks: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        *,
        window: int | None = None,
        num_splits: int | None = None,
    ) -> None:
        self.max_batch, self.max_blocks, self.window = max_batch, max_blocks, window
        self.q = torch.zeros(max_batch, num_heads, head_dim, dtype=dtype, device=device)
        self.out = torch.zeros_like(self.q)
        self.block_tables = torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.splits = num_splits or decode_splits(max_batch, num_kv_heads, max_blocks * block_size, device)
        self.workspace = (
            decode_workspace(max_batch, num_heads, head_dim, self.splits, device) if self.splits > 1 else None
        )

    def prepare(self, q: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """Copies a step of b <= max_batch sequences into the buffers; rows b.. become padding
        (length 0: zeros out, nothing read). Columns of a table past its blocks are never read."""
        b, width = block_tables.shape
        if b > self.max_batch or width > self.max_blocks or q.shape[0] != b or seq_lens.shape[0] != b:
            raise ValueError(
                f"a step of {q.shape[0]} queries and tables {tuple(block_tables.shape)} does not fit buffers "
                f"of {self.max_batch} x {self.max_blocks} blocks"
            )
        self.q[:b].copy_(q)
        self.block_tables[:b, :width].copy_(block_tables)
        self.seq_lens[:b].copy_(seq_lens)
        self.seq_lens[b:].zero_()

    def run(self, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """The launch on the buffers (what a graph captures): returns `out`, [max_batch, Hq, D]."""
        return paged_decode(
            self.q,
            k_cache,
            v_cache,
            self.block_tables,
            self.seq_lens,
            scale,
            window=self.window,
            out=self.out,
            num_splits=self.splits,
            workspace=self.workspace,
        )
