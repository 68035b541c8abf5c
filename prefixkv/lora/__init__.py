"""Multi-LoRA serving: PEFT adapters applied in the forward pass, many adapters in one batch.

One concept per file: `request.py` (LoRARequest, as vLLM), `adapter.py` (loading and validating a
PEFT folder), `manager.py` (the resident adapters: an LRU of at most max_loras device slots),
`layers.py` (the low-rank shrink/expand inside the model's linear layers and the per-token
adapter mapping of a step). Only the request is imported with the package: the rest needs torch."""

from typing import TYPE_CHECKING

from ..lazy_exports import lazy_exports
from .request import LoRARequest

if TYPE_CHECKING:
    from .adapter import LoRAAdapter, load_adapter
    from .layers import LoRALinear, LoRAMapping
    from .manager import LoRAManager

__all__ = ["LoRAAdapter", "LoRALinear", "LoRAManager", "LoRAMapping", "LoRARequest", "load_adapter"]

__getattr__ = lazy_exports(
    __name__,
    {
        "LoRAAdapter": ".adapter",
        "load_adapter": ".adapter",
        "LoRALinear": ".layers",
        "LoRAMapping": ".layers",
        "LoRAManager": ".manager",
    },
)
