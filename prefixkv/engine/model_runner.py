"""Turns a scheduled batch into tensors - token ids, positions, slot mapping, block tables - runs
the model on them and returns logits for the rows that sample. Knows nothing of hashing."""
from __future__ import annotations

import torch

from ..model import AttentionMetadata, LoadedModel, allocate_kv_cache


class ModelRunner:
    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.model = loaded.model
        if device.type == "cpu" and dtype == torch.bfloat16:
            self.model.pack_for_cpu()  # oneDNN-packed weights: faster bfloat16 matmuls
        self.config = loaded.config
        self.block_size = block_size
        self.device = device
        self.kv_caches = allocate_kv_cache(self.config, num_blocks, block_size, dtype, device)

    @torch.inference_mode()
    def execute(self, token_chunks: list[list[int]], starts: list[int],
                block_tables: list[list[int]], sample_rows: list[bool],
                hidden_rows: list[bool] | None = None) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """Compute tokens token_chunks[i] at positions starts[i]... of sequence i, whose KV
        blocks are block_tables[i]. Returns float32 logits [sum(sample_rows), vocab] for the
        last token of each sequence with sample_rows[i] set, and for each sequence with
        hidden_rows[i] set the final hidden states of all its tokens (turn them into logits a
        slice at a time with `compute_logits`: a whole chunk's logits can be large)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        for chunk, start, table in zip(token_chunks, starts, block_tables):
            end = start + len(chunk)
            input_ids.extend(chunk)
            positions.extend(range(start, end))
            # slots of consecutive positions: whole runs per block, not one lookup per token
            pos = start
            while pos < end:
                block_end = min(end, (pos // bs + 1) * bs)
                base = table[pos // bs] * bs - (pos // bs) * bs
                slots.extend(range(base + pos, base + block_end))
                pos = block_end
            query_start_loc.append(len(input_ids))
            seq_lens.append(end)
        max_blocks = max(len(t) for t in block_tables)
        padded = [t + [0] * (max_blocks - len(t)) for t in block_tables]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=torch.tensor(padded, dtype=torch.long, device=dev),
        )
        hidden = self.model(torch.tensor(input_ids, dtype=torch.long, device=dev),
                            torch.tensor(positions, dtype=torch.long, device=dev),
                            self.kv_caches, meta)
        full: list[torch.Tensor | None] = [
            hidden[query_start_loc[i]:query_start_loc[i + 1]] if want else None
            for i, want in enumerate(hidden_rows or ())]
        rows = [query_start_loc[i + 1] - 1 for i, s in enumerate(sample_rows) if s]
        if not rows:
            return torch.empty(0, self.config.vocab_size), full
        return self.compute_logits(hidden[torch.tensor(rows, device=dev)]), full

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits on the CPU for final hidden states."""
        logits = self.model.compute_logits(hidden)
        return logits.float().cpu() if logits.device.type != "cpu" else logits.float()
