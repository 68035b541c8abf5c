"""Multi-LoRA serving: PEFT adapters applied in the forward pass, many adapters in one batch.

One concept per file: `request.py` (LoRARequest, as vLLM), `adapter.py` (loading and validating a
PEFT folder), `manager.py` (the resident adapters: an LRU of at most max_loras device slots),
`layers.py` (the low-rank shrink/expand inside the model's linear layers and the per-token
adapter mapping of a step)."""

from .adapter import LoRAAdapter, load_adapter
from .layers import LoRALinear, LoRAMapping
from .manager import LoRAManager
from .request import LoRARequest

__all__ = ["LoRAAdapter", "LoRALinear", "LoRAManager", "LoRAMapping", "LoRARequest", "load_adapter"]
