"""Falcon-H1 (transformers' FalconH1ForCausalLM): in every layer a Mamba2 mixer and full attention
side by side on the same normed input, their outputs summed (model/hybrid.py's layer with both),
then a SwiGLU MLP; muP multipliers throughout.

The multipliers are folded into the weights at load - each scales a matmul's input or output, or
(the mixer's five per-part `ssm_multipliers`) rows of in_proj - so a step computes the plain
hybrid. The logits' multiplier stays a scale on the logits where the head is tied to the
embedding, which carries the embedding multiplier.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from .config import ModelConfig
from .hybrid import HybridModel

_LAYER = re.compile(r"^model\.layers\.\d+\.(.+)$")


def mup_row_scale(config: ModelConfig) -> torch.Tensor:
    """Per row of the mixer's in_proj (gate, x, B, C, dt): its part's multiplier times the
    mixer's input multiplier."""
    I, GN, H = config.ssm_intermediate_size, config.ssm_n_groups * config.ssm_state_size, config.ssm_num_heads
    parts = config.mup.ssm_parts
    sizes = (I, I, GN, GN, H)
    scale = torch.cat([torch.full((n,), m, dtype=torch.float64) for n, m in zip(sizes, parts)])
    return scale * config.mup.ssm_in


class FalconH1Model(HybridModel):
    def __init__(
        self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__(config, dtype, device)
        mup = config.mup
        # a tied head reads the embedding, which carries the embedding multiplier
        self.logit_scale = mup.lm_head / mup.embedding if config.tie_word_embeddings else 1.0

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if self.logit_scale != 1.0:
            logits.mul_(self.logit_scale)  # the head's own output: scaled in place
        return logits

    def load_hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """transformers' names (as model/hybrid.py's), every muP multiplier folded into the
        weight it scales."""
        mup = self.config.mup
        rows = mup_row_scale(self.config)
        scales = {
            "self_attn.q_proj.weight": mup.attention_in,
            "self_attn.k_proj.weight": mup.attention_in * mup.key,
            "self_attn.v_proj.weight": mup.attention_in,
            "self_attn.o_proj.weight": mup.attention_out,
            "mamba.out_proj.weight": mup.ssm_out,
            "feed_forward.gate_proj.weight": mup.mlp_gate,
            "feed_forward.down_proj.weight": mup.mlp_down,
        }

        def folded() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                m = _LAYER.match(name)
                part = m.group(1) if m else None
                if name == "model.embed_tokens.weight":
                    tensor = _scaled(tensor, mup.embedding)
                elif name == "lm_head.weight":
                    tensor = _scaled(tensor, mup.lm_head)
                elif part == "mamba.in_proj.weight":
                    if tensor.shape[0] != rows.shape[0]:
                        raise ValueError(
                            f"checkpoint tensor {name!r} has {tensor.shape[0]} rows, expected {rows.shape[0]}"
                        )
                    tensor = (tensor.double() * rows[:, None]).to(tensor.dtype)
                elif part in scales:
                    tensor = _scaled(tensor, scales[part])
                yield name, tensor

        super().load_hf_weights(folded())


def _scaled(t: torch.Tensor, m: float) -> torch.Tensor:
    return t if m == 1.0 else (t.double() * m).to(t.dtype)
