"""The LoRA math inside the model: a wrapper around each targeted linear layer that adds
`(x @ A[slot]) @ B[slot]` (scaling already folded into B at load) for the tokens of each adapter in
the step.

Layout, per wrapped linear (q/k/v share the fused qkv linear, gate/up the fused gate_up; each PEFT
target is one "slice" of the output), N = max_loras slots, R = max_lora_rank:
  lora_a [in, slices * N * R]  slice-major: columns (slice, slot, rank)
  lora_b [N * R, out]          rows (slot, rank); slice i's columns are its own output span
so slice i of every slot is one column block of A and one column block of B: no block-diagonal
zeros are stored or read (reading weights is what a decode step is bound by).

A step's `LoRAMapping` (built once per step, shared by every layer) splits the adapter tokens:
- long runs (a prefill chunk of one request): per run and slice, one shrink mm and one expand
  addmm_ into the run's rows of the output (punica's SGMV, one op pair per run and slice);
- short runs (decodes, one token each, many adapters): one dense shrink `x @ lora_a` over every
  slot, a per-row 0/1 mask that keeps the rank group of the row's own slot (base rows all zero),
  and one expand addmm_ per slice - a fixed handful of ops per layer, no gathers, no padding.
Never a loop over requests inside the dense part; a step with no adapter (mapping None) runs the
base linear alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from ..model.llama import LlamaModel

# runs shorter than this go to the dense masked path (measured crossover on the default model:
# 4-16 tokens per run with 8 resident rank-16 adapters)
SHORT_RUN = 8


@dataclass
class LoRAMapping:
    """One step's adapter tokens. `runs`: (slot, start, end) computed one run at a time; `dense`:
    the rows [start, end) computed by the masked dense path over the slots `dense_slots` (the range
    the short runs use), with `masks[k]` [end - start, k * len(dense_slots) * rank] (k = slices of
    the linear) one-hot per row on its slot's rank columns."""

    runs: list[tuple[int, int, int]]
    dense: slice | None = None
    dense_slots: slice | None = None
    masks: dict[int, torch.Tensor] | None = None

    @classmethod
    def from_segments(
        cls,
        segments: list[tuple[int, int]],
        device: torch.device | str,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype = torch.float32,
        slice_counts: tuple[int, ...] = (1, 2, 3),
    ) -> LoRAMapping | None:
        """segments: (slot or -1, number of tokens) in batch order. None when every token is base.
        Neighbouring segments of one adapter merge into one run (a decode batch of a single
        adapter is one run); two or more short runs close together take the dense path; the rest
        go run by run."""
        merged: list[list[int]] = []  # [slot, start, end]
        pos = 0
        for slot, n in segments:
            if n <= 0:
                continue
            if merged and merged[-1][0] == slot:
                merged[-1][2] += n
            else:
                merged.append([slot, pos, pos + n])
            pos += n
        runs: list[tuple[int, int, int]] = []
        short: list[tuple[int, int, int]] = []
        for slot, start, end in merged:
            if slot >= 0:
                (short if end - start < SHORT_RUN else runs).append((slot, start, end))
        if not runs and not short:
            return None
        lo, hi = (short[0][1], short[-1][2]) if short else (0, 0)
        # the dense rows span the short runs; skip it when few, or when long runs sit in between
        if len(short) < 2 or hi - lo > SHORT_RUN * len(short):
            return cls(runs + short)
        first = min(slot for slot, _, _ in short)
        last = max(slot for slot, _, _ in short) + 1
        row_slot = torch.full((hi - lo,), -1, dtype=torch.long)
        for slot, start, end in short:
            row_slot[start - lo : end - lo] = slot
        one_hot = (row_slot[:, None] == torch.arange(first, last)[None, :]).to(dtype)  # [rows, slots]
        mask = one_hot[:, :, None].expand(-1, -1, max_rank).reshape(hi - lo, (last - first) * max_rank)
        masks = {k: mask.repeat(1, k).to(device) for k in {1, *slice_counts}}
        return cls(runs, slice(lo, hi), slice(first, last), masks)


# how many slices the wrapped linears have (o/down 1, gate_up 2, qkv 3): the masks a step needs
SLICE_COUNTS = (1, 2, 3)


class StaticLoRAMapping(LoRAMapping):
    """The mapping of a step over fixed buffers (what a CUDA graph captures): every row through the
    dense masked path, over every slot, the masks made on the device from `row_slots` (int64 [rows],
    each row's slot, -1 for a base row or padding) by `refresh()`, which the captured forward calls
    first. A base row's mask is all zeros: it gets exactly the base linear's output (an added 0)."""

    def __init__(
        self,
        row_slots: torch.Tensor,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
    ) -> None:
        super().__init__([], slice(0, row_slots.shape[0]), slice(0, num_slots), None)
        self.row_slots = row_slots
        self.max_rank = max_rank
        self.dtype = dtype
        self._slots = torch.arange(num_slots, device=row_slots.device)

    def refresh(self) -> None:
        """The masks of the slots in `row_slots` now: one-hot per row on its slot's rank columns,
        repeated per slice."""
        rows = self.row_slots.shape[0]
        one_hot = (self.row_slots[:, None] == self._slots[None, :]).to(self.dtype)  # [rows, slots]
        mask = one_hot[:, :, None].expand(-1, -1, self.max_rank).reshape(rows, -1)
        self.masks = {k: mask if k == 1 else mask.repeat(1, k) for k in SLICE_COUNTS}


class LoRAContext:
    """Shared by every wrapped linear of a model: the mapping of the step being computed."""

    __slots__ = ("mapping",)

    def __init__(self) -> None:
        self.mapping: LoRAMapping | None = None


class LoRALinear(nn.Module):
    """base(x) plus the low-rank updates of the step's adapters. `slices` are the output widths
    of the fused PEFT targets (q, k, v for qkv_proj; gate, up for gate_up_proj; one otherwise)."""

    # registered buffers (they follow the module's device and dtype)
    lora_a: torch.Tensor
    lora_b: torch.Tensor

    def __init__(
        self,
        base: nn.Module,
        in_features: int,
        slices: list[int],
        context: LoRAContext,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.base = base
        self.context = context
        self.max_rank = max_rank
        self.num_slots = max_loras
        # per slice: (output offset, width) - the column block it owns in the output and in lora_b
        self.spans: list[tuple[int, int]] = []
        offset = 0
        for width in slices:
            self.spans.append((offset, width))
            offset += width
        # per slot and slice, the rank of the adapter there (0: not targeted): runs read only those
        self.slot_rank = [[0] * len(slices) for _ in range(max_loras)]
        group = max_loras * max_rank
        self.register_buffer("lora_a", torch.zeros(in_features, len(slices) * group, dtype=dtype, device=device))
        self.register_buffer("lora_b", torch.zeros(group, offset, dtype=dtype, device=device))

    def set_slot(self, slot: int, pieces: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Write one adapter into `slot`: per slice (A [r, in], B [out_i, r] already scaled) or None."""
        R, group = self.max_rank, self.num_slots * self.max_rank
        rows = self.lora_b[slot * R : (slot + 1) * R]
        rows.zero_()
        for i, ((offset, width), piece) in enumerate(zip(self.spans, pieces)):
            cols = self.lora_a[:, i * group + slot * R : i * group + (slot + 1) * R]
            cols.zero_()
            if piece is not None:
                pa, pb = piece
                r = pa.shape[0]
                cols[:, :r].copy_(pa.t())
                rows[:r, offset : offset + width].copy_(pb.t())
            self.slot_rank[slot][i] = 0 if piece is None else piece[0].shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        mapping = self.context.mapping
        if mapping is None:
            return y
        R, group = self.max_rank, self.num_slots * self.max_rank
        a, b = self.lora_a, self.lora_b
        if mapping.dense is not None and mapping.dense_slots is not None and mapping.masks is not None:
            y_rows, x_rows = y[mapping.dense], x[mapping.dense]
            first, last = mapping.dense_slots.start, mapping.dense_slots.stop
            if last - first == self.num_slots:
                # every slot's shrink at once; the mask zeroes all but each row's own slot's rank columns
                s = x_rows @ a
                s.mul_(mapping.masks[len(self.spans)])
                for i, (offset, width) in enumerate(self.spans):
                    cols = slice(offset, offset + width)
                    y_rows[:, cols].addmm_(s[:, i * group : (i + 1) * group], b[:, cols])
            else:  # only the slots in use: their columns are one block per slice
                w0, w1 = first * R, last * R
                for i, (offset, width) in enumerate(self.spans):
                    cols = slice(offset, offset + width)
                    s = x_rows @ a[:, i * group + w0 : i * group + w1]
                    s.mul_(mapping.masks[1])
                    y_rows[:, cols].addmm_(s, b[w0:w1, cols])
        for slot, start, end in mapping.runs:
            x_run = x[start:end]
            for i, (offset, width) in enumerate(self.spans):
                r = self.slot_rank[slot][i]
                if not r:
                    continue
                c = i * group + slot * R
                y[start:end, offset : offset + width].addmm_(
                    x_run @ a[:, c : c + r], b[slot * R : slot * R + r, offset : offset + width]
                )
        return y


# fused module -> (PEFT targets in slice order, where it lives in a decoder layer)
FUSED: dict[str, tuple[tuple[str, ...], str]] = {
    "qkv_proj": (("q_proj", "k_proj", "v_proj"), "self_attn"),
    "o_proj": (("o_proj",), "self_attn"),
    "gate_up_proj": (("gate_proj", "up_proj"), "mlp"),
    "down_proj": (("down_proj",), "mlp"),
}


def attach_lora(
    model: LlamaModel,
    shapes: dict[str, tuple[int, int]],
    max_loras: int,
    max_rank: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[dict[str, LoRALinear]]:
    """Wrap every targetable linear of `model.layers` (once); returns per layer {fused name: wrapper}
    and sets `model.lora_context`, through which the model hands each step's mapping over."""
    context = LoRAContext()
    wrapped: list[dict[str, LoRALinear]] = []
    for layer in model.layers:
        found: dict[str, LoRALinear] = {}
        for fused, (targets, owner_name) in FUSED.items():
            owner = getattr(layer, owner_name)
            base = getattr(owner, fused, None)
            if base is None:  # a mixture-of-experts MLP: no adapter reaches it (adapter.py refuses)
                continue
            if isinstance(base, LoRALinear):
                raise ValueError("LoRA is already attached to this model")
            in_features = shapes[targets[0]][0]
            lin = LoRALinear(
                base, in_features, [shapes[t][1] for t in targets], context, max_loras, max_rank, dtype, device
            )
            setattr(owner, fused, lin)
            found[fused] = lin
        wrapped.append(found)
    model.lora_context = context
    return wrapped
