"""GLM-4.5 to GLM-4.7 (transformers' Glm4MoeForCausalLM; configs/glm4_moe.py): the Llama decoder
- rotary over the first half of each head, q/k/v biases, q/k norms per head where the config has
them - whose layers after the first dense ones route to experts beside an ungated shared expert
(moe.py: a float32 sigmoid router, a selection bias, group-limited top k, scaled weights)."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from .llama import LlamaModel, below_layer, renamed

# transformers' names -> this model's: the shared experts (one MLP of their summed width) and the
# router's selection bias (DeepSeek-V3's too)
ROUTED_EXPERT_RENAMES = (
    (re.compile(r"\.mlp\.shared_experts\."), ".mlp.shared_expert."),
    (re.compile(r"\.mlp\.gate\.e_score_correction_bias$"), ".mlp.expert_bias"),
)


class Glm4MoeModel(LlamaModel):
    """forward(input_ids [T], positions [T], kv_caches, meta) -> final-normed hidden [T, H]."""

    def load_hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """transformers' names (mlp.gate.weight, mlp.gate.e_score_correction_bias,
        mlp.experts.E.{gate,up,down}_proj or the stacked experts, mlp.shared_experts.*); the
        multi-token-prediction layers after the last are left out."""
        super().load_hf_weights(renamed(below_layer(weights, self.config.num_hidden_layers), ROUTED_EXPERT_RENAMES))
