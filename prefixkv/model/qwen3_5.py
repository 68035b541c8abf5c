"""Qwen3.5 (transformers' Qwen3_5ForCausalLM, dense MLPs, and Qwen3_5MoeForCausalLM, routed experts
with a gated shared expert in every layer): Qwen3-Next's decoder (model/qwen3_next.py) with the
gated delta net's input projections kept apart in the checkpoint - in_proj_qkv (every q head,
then every k head, then every v head), in_proj_z, in_proj_b and in_proj_a, one row per value head -
where Qwen3-Next fuses them per q/k head group. They are laid out once at load in Qwen3-Next's
fused order (`fused_delta_net_tensors`), so both run the same two products. Qwen3.5's rotary is
Qwen3-VL's interleaved multimodal one: over text alone its three position streams are equal,
which is the plain rotary over the same dimensions.

The released checkpoints are vision-language ones (Qwen3_5ForConditionalGeneration): their
language model (model.language_model.*) is loaded and served text-only; the vision encoder
(model.visual.*) is not, and a request with images is refused (the engine's text-only path)."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator

import torch

from .config import ModelConfig
from .qwen3_next import Qwen3NextModel

logger = logging.getLogger(__name__)
_PARTS = ("qkv", "z", "b", "a")
_SPLIT_PROJECTION = re.compile(r"^(model\.layers\.\d+\.linear_attn\.)in_proj_(qkv|z|b|a)\.weight$")


class Qwen3_5Model(Qwen3NextModel):
    """Qwen3NextModel, loading Qwen3.5's split delta-net projections."""

    def load_hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_hf_weights(fused_delta_net_tensors(self._language_model(weights), self.config))

    def _language_model(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """A vision-language checkpoint's language model under the names of a causal LM's; its
        vision encoder's tensors left out (once logged)."""
        vision_language = self.config.architecture.endswith("ForConditionalGeneration")
        skipped = 0
        for name, t in weights:
            if vision_language:
                if name.startswith("model.visual."):
                    skipped += 1
                    continue
                if name.startswith("model.language_model."):
                    name = "model." + name[len("model.language_model.") :]
            yield name, t
        if skipped:
            logger.info(
                "%s: its language model is served text-only; the vision encoder (%d tensors) is not loaded, "
                "and requests with images are refused",
                self.config.architecture,
                skipped,
            )


def fused_delta_net_tensors(
    weights: Iterable[tuple[str, torch.Tensor]], config: ModelConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each delta net layer's in_proj_qkv / _z / _b / _a (held until
    all four of a layer are read) as Qwen3-Next's in_proj_qkvz - per q/k head: its q rows, its k
    rows, then the v rows and the z rows of the value heads it serves - and in_proj_ba - per q/k
    head: its value heads' b rows, then their a rows. Every other tensor passes as it is."""
    Hk, dk, dv = config.linear_num_key_heads, config.linear_key_head_dim, config.linear_value_head_dim
    r = config.linear_num_value_heads // Hk
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in weights:
        m = _SPLIT_PROJECTION.match(name)
        if m is None:
            yield name, t
            continue
        prefix, part = m.group(1), m.group(2)
        parts = pending.setdefault(prefix, {})
        parts[part] = t
        if len(parts) < len(_PARTS):
            continue
        del pending[prefix]
        qkv, z, b, a = parts["qkv"], parts["z"], parts["b"], parts["a"]
        H = qkv.shape[-1]
        want = {"qkv": 2 * Hk * dk + Hk * r * dv, "z": Hk * r * dv, "b": Hk * r, "a": Hk * r}
        for key, rows in want.items():
            if tuple(parts[key].shape) != (rows, H):
                raise ValueError(
                    f"{prefix}in_proj_{key}.weight of shape {tuple(parts[key].shape)}: expected {(rows, H)}"
                )
        q, k, v = qkv.split([Hk * dk, Hk * dk, Hk * r * dv])
        groups = (q.view(Hk, dk, H), k.view(Hk, dk, H), v.view(Hk, r * dv, H), z.view(Hk, r * dv, H))
        yield prefix + "in_proj_qkvz.weight", torch.cat(groups, dim=1).reshape(-1, H)
        yield prefix + "in_proj_ba.weight", torch.cat((b.view(Hk, r, H), a.view(Hk, r, H)), dim=1).reshape(-1, H)
    if pending:
        missing = [f"{p}in_proj_{part}.weight" for p, parts in pending.items() for part in _PARTS if part not in parts]
        raise ValueError(f"delta net projections missing from the checkpoint: {sorted(missing)}")
