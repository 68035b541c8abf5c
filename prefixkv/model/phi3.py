"""Phi-3 / Phi-4 (dense): the Llama decoder itself; its checkpoints keep q/k/v fused in
`qkv_proj` and gate/up in `gate_up_proj` (the layout this decoder computes with), which are read
here as the pieces the Llama loader places."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from .llama import LlamaModel

_FUSED = re.compile(r"^(model\.layers\.\d+\.)self_attn\.qkv_proj\.weight$")


class Phi3Model(LlamaModel):
    """forward(input_ids [T], positions [T], kv_caches, meta) -> final-normed hidden [T, H]."""

    def load_hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_hf_weights(self._unfused(weights))

    def _unfused(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        cfg = self.config
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        for name, t in weights:
            m = _FUSED.match(name)
            if m is None:
                yield name, t
                continue
            if t.shape[0] != q + 2 * kv:
                raise ValueError(f"{name}: {t.shape[0]} rows, expected {q + 2 * kv} (q, k, v)")
            for part, rows in zip(("q_proj", "k_proj", "v_proj"), t.split([q, kv, kv])):
                yield f"{m.group(1)}self_attn.{part}.weight", rows
