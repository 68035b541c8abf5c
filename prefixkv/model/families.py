"""Which decoder class builds a config, by architecture: the Llama decoder, or a family with its
own block. Each architecture that model/configs/registry.py reads has its line here."""

from __future__ import annotations

import torch

from .config import ModelConfig
from .deepseek import DeepseekV3Model
from .falcon_h1 import FalconH1Model
from .gemma import GemmaModel
from .gemma4 import Gemma4Model
from .glm4 import Glm4Model
from .glm4_moe import Glm4MoeModel
from .gpt_oss import GptOssModel
from .granite import GraniteModel
from .granite_hybrid import GraniteHybridModel
from .hybrid import HybridModel
from .lfm2 import Lfm2Model
from .llama import LlamaModel
from .mamba2 import Mamba2Model
from .minimax_m2 import MiniMaxM2Model
from .olmo2 import Olmo2Model
from .phi3 import Phi3Model
from .qwen3_5 import Qwen3_5Model
from .qwen3_next import Qwen3NextModel
from .vision_language_text import Qwen3VLMoeTextModel, VisionLanguageTextModel

MODEL_CLASSES: dict[str, type[LlamaModel]] = {
    "LlamaForCausalLM": LlamaModel,
    "MistralForCausalLM": LlamaModel,
    "Ministral3ForCausalLM": LlamaModel,  # Mistral's decoder (YaRN; its query temperature not built)
    "Mistral3ForConditionalGeneration": VisionLanguageTextModel,  # its language model alone: served text-only
    "Qwen3VLForConditionalGeneration": VisionLanguageTextModel,  # likewise: Qwen3's decoder (M-RoPE over text: plain)
    "Qwen3VLMoeForConditionalGeneration": Qwen3VLMoeTextModel,  # and Qwen3-MoE's, its experts transposed
    "Qwen2ForCausalLM": LlamaModel,
    "Qwen3ForCausalLM": LlamaModel,
    "SmolLM3ForCausalLM": LlamaModel,  # with layers that have no rotary (ModelConfig.nope_layers)
    "GraniteForCausalLM": GraniteModel,
    "Ernie4_5ForCausalLM": LlamaModel,  # its interleaved rotary's q/k rows reordered at load
    "Glm4ForCausalLM": Glm4Model,  # sandwich norms; likewise an interleaved rotary
    "Gemma2ForCausalLM": GemmaModel,
    "Gemma3ForCausalLM": GemmaModel,
    "Gemma4ForCausalLM": Gemma4Model,  # per-layer inputs, layers reading earlier layers' K/V, two head sizes
    "Gemma4ForConditionalGeneration": Gemma4Model,  # its language model alone: served text-only
    # the Llama decoder with model/moe.py's MLP
    "MixtralForCausalLM": LlamaModel,
    "Qwen2MoeForCausalLM": LlamaModel,
    "Qwen3MoeForCausalLM": LlamaModel,
    "Glm4MoeForCausalLM": Glm4MoeModel,  # GLM-4.5 to 4.7: a float32 sigmoid router, groups, a shared expert
    "MiniMaxM2ForCausalLM": MiniMaxM2Model,  # q/k normed over the whole projection, a sigmoid router
    "DeepseekV3ForCausalLM": DeepseekV3Model,  # multi-head latent attention (Kimi K2 too), GLM-4.5's router
    "Glm4MoeLiteForCausalLM": DeepseekV3Model,  # GLM-4.7-Flash: DeepSeek-V3's attention, GLM-4.5's experts
    "Mamba2ForCausalLM": Mamba2Model,
    "BambaForCausalLM": HybridModel,
    "FalconH1ForCausalLM": FalconH1Model,
    "Qwen3NextForCausalLM": Qwen3NextModel,
    "Qwen3_5ForCausalLM": Qwen3_5Model,  # Qwen3-Next's decoder, its delta nets' projections split
    "Qwen3_5MoeForCausalLM": Qwen3_5Model,
    "Qwen3_5ForConditionalGeneration": Qwen3_5Model,  # its language model alone: served text-only
    "Qwen3_5MoeForConditionalGeneration": Qwen3_5Model,
    "GptOssForCausalLM": GptOssModel,
    "Olmo2ForCausalLM": Olmo2Model,
    "Olmo3ForCausalLM": Olmo2Model,  # with sliding layers (and their own rotary where the full ones' is scaled)
    "Phi3ForCausalLM": Phi3Model,
    "Lfm2ForCausalLM": Lfm2Model,  # gated short convolutions (a conv state per block) and attention
    "Lfm2MoeForCausalLM": Lfm2Model,  # and routed experts
    "GraniteMoeHybridForCausalLM": GraniteHybridModel,  # Bamba's layers, Granite's multipliers, a shared MLP
}


def model_class(config: ModelConfig) -> type[LlamaModel]:
    cls = MODEL_CLASSES.get(config.architecture)
    if cls is None:
        raise ValueError(f"no decoder class builds {config.architecture!r} (model/families.py MODEL_CLASSES)")
    return cls


def build_model(
    config: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", seed: int = 0
) -> LlamaModel:
    """A randomly initialised model of the config's family (for tests)."""
    model = model_class(config)(config, dtype=dtype, device=device)
    model.init_random_weights(seed)
    return model.eval()
