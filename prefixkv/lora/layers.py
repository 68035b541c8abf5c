"""The LoRA math inside the model: a wrapper around each targeted linear layer that adds
`scale * (x @ A[slot]) @ B[slot]` for the tokens of each adapter present in the step.

Weights are stacked per layer and per fused linear, one slot per resident adapter:
A [max_loras, in, R] and B [max_loras, R, out], R = slices x max_lora_rank (q/k/v share the fused
qkv linear: each slice owns R/3 columns of A and writes only its own rows of B; unused rank columns
are zero). The step's `LoRAMapping` groups the tokens by slot once; every wrapped linear then runs
punica / S-LoRA's shrink (x @ A) and expand (@ B): one pair per adapter present when few adapters
share the step (prefill), or - many adapters with few tokens each (decode) - one bmm pair over all
slots on a padded [max_loras, rows, in] layout. Never a loop over requests. A step with no adapter
(mapping None) runs the base linear alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Padded:
    """Many adapters with few tokens each (decode): the LoRA tokens laid out as [max_loras,
    rows, in] (row r of slot s: token `gather[s * rows + r]`, or the zero row T past the end) so
    one bmm per side serves every adapter at once; `valid` picks the real rows back out, in the
    order of `tokens`."""

    rows: int
    gather: torch.Tensor  # [max_loras * rows] token index, or T for padding
    valid: torch.Tensor  # [n] positions in the padded layout that hold real tokens
    tokens: torch.Tensor  # [n] their token indices


@dataclass
class LoRAMapping:
    """One step's per-token adapter index (`token_slots`, -1 = base) and the same grouped by slot:
    (slot, rows) with rows a slice for one contiguous run or an index tensor. `padded` is set when
    the grouped bmm layout is cheaper than one shrink/expand per adapter."""

    token_slots: torch.Tensor
    groups: list[tuple[int, slice | torch.Tensor]]
    padded: Padded | None = None

    @classmethod
    def from_segments(
        cls, segments: list[tuple[int, int]], device: torch.device | str, num_slots: int = 0
    ) -> LoRAMapping | None:
        """segments: (slot or -1, number of tokens) in batch order. None when every token is base.
        With `num_slots` (the stacked tensors' first dimension), several adapters with few tokens
        each get the padded one-bmm layout."""
        rows: dict[int, list[int]] = {}
        slots: list[int] = []
        pos = 0
        for slot, n in segments:
            if slot >= 0:
                rows.setdefault(slot, []).extend(range(pos, pos + n))
            slots.extend([slot] * n)
            pos += n
        if not rows:
            return None
        groups: list[tuple[int, slice | torch.Tensor]] = []
        for slot, r in rows.items():
            if r[-1] - r[0] + 1 == len(r):
                groups.append((slot, slice(r[0], r[-1] + 1)))
            else:
                groups.append((slot, torch.tensor(r, dtype=torch.long, device=device)))
        padded = None
        most = max(len(r) for r in rows.values())
        n = sum(len(r) for r in rows.values())
        if num_slots and len(rows) > 2 and num_slots * most <= 2 * n:
            gather = [pos] * (num_slots * most)  # pos == T: the zero row
            valid: list[int] = []
            tokens: list[int] = []
            for slot, r in rows.items():
                for k, t in enumerate(r):
                    gather[slot * most + k] = t
                    valid.append(slot * most + k)
                    tokens.append(t)

            def as_tensor(v: list[int]) -> torch.Tensor:
                return torch.tensor(v, dtype=torch.long, device=device)

            padded = Padded(most, as_tensor(gather), as_tensor(valid), as_tensor(tokens))
        return cls(torch.tensor(slots, dtype=torch.long, device=device), groups, padded)


class LoRAContext:
    """Shared by every wrapped linear of a model: the mapping of the step being computed."""

    __slots__ = ("mapping",)

    def __init__(self) -> None:
        self.mapping: LoRAMapping | None = None


class LoRALinear(nn.Module):
    """base(x) plus the low-rank updates of the step's adapters. `slices` are the output widths
    of the fused PEFT targets (q, k, v for qkv_proj; gate, up for gate_up_proj; one otherwise)."""

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
        self.slices = slices
        self.max_rank = max_rank
        width = len(slices) * max_rank
        out = sum(slices)
        self.register_buffer("lora_a", torch.zeros(max_loras, in_features, width, dtype=dtype, device=device))
        self.register_buffer("lora_b", torch.zeros(max_loras, width, out, dtype=dtype, device=device))

    def set_slot(self, slot: int, pieces: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Write one adapter into `slot`: per slice (A [r, in], B [out_i, r] already scaled) or None."""
        a, b = self.lora_a[slot], self.lora_b[slot]
        a.zero_()
        b.zero_()
        r0, o0 = 0, 0
        for width, piece in zip(self.slices, pieces):
            if piece is not None:
                pa, pb = piece
                r = pa.shape[0]
                a[:, r0 : r0 + r].copy_(pa.t())
                b[r0 : r0 + r, o0 : o0 + width].copy_(pb.t())
            r0 += self.max_rank
            o0 += width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        mapping = self.context.mapping
        if mapping is None:
            return y
        p = mapping.padded
        if p is not None:  # every adapter in one shrink bmm and one expand bmm
            x_pad = F.pad(x, (0, 0, 0, 1)).index_select(0, p.gather).view(self.lora_a.shape[0], p.rows, -1)
            delta = torch.bmm(torch.bmm(x_pad, self.lora_a), self.lora_b)
            y.index_add_(0, p.tokens, delta.view(-1, y.shape[-1]).index_select(0, p.valid))
            return y
        for slot, rows in mapping.groups:
            if isinstance(rows, slice):
                y[rows] += (x[rows] @ self.lora_a[slot]) @ self.lora_b[slot]
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ self.lora_a[slot]) @ self.lora_b[slot])
        return y


# fused module -> (PEFT targets in slice order, where it lives in a decoder layer)
FUSED: dict[str, tuple[tuple[str, ...], str]] = {
    "qkv_proj": (("q_proj", "k_proj", "v_proj"), "self_attn"),
    "o_proj": (("o_proj",), "self_attn"),
    "gate_up_proj": (("gate_proj", "up_proj"), "mlp"),
    "down_proj": (("down_proj",), "mlp"),
}


def attach_lora(
    model: nn.Module,
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
    for layer in model.layers:  # type: ignore[union-attr]
        found: dict[str, LoRALinear] = {}
        for fused, (targets, owner_name) in FUSED.items():
            owner = getattr(layer, owner_name)
            base = getattr(owner, fused)
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
