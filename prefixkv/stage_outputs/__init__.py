"""The stage-output cache (after vLLM-Omni): per-token model outputs - the final hidden states,
and any output whose first dimension is the token count - kept per KV block id, so a prefix hit
yields them for the cached tokens as well as the KV (docs/design.md, "Stage-output cache").

store.py     StageOutputCache: the per-block CPU tensors and which block ids hold valid rows
specs.py     what the cache declares in the engine's one memory budget; discovering outputs
pooling.py   PoolingParams and LAST / MEAN / CLS / ALL pooling of a prompt's hidden states
outputs.py   vLLM's EmbeddingRequestOutput / PoolingRequestOutput shapes
"""

from typing import TYPE_CHECKING

from ..lazy_exports import lazy_exports
from .pooling import POOLING_TYPES, PoolingParams, parse_pooler_config, pool

if TYPE_CHECKING:
    from .outputs import EmbeddingOutput, EmbeddingRequestOutput, PoolingOutput, PoolingRequestOutput
    from .specs import STAGE_PREFIX, per_token_outputs, stage_output_specs
    from .store import StageOutputCache

__all__ = [
    "POOLING_TYPES",
    "STAGE_PREFIX",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "PoolingOutput",
    "PoolingParams",
    "PoolingRequestOutput",
    "StageOutputCache",
    "parse_pooler_config",
    "per_token_outputs",
    "pool",
    "stage_output_specs",
]

# pooling's parameters come with the package (the engine's flags parse them); the rest needs torch
__getattr__ = lazy_exports(
    __name__,
    {
        "EmbeddingOutput": ".outputs",
        "EmbeddingRequestOutput": ".outputs",
        "PoolingOutput": ".outputs",
        "PoolingRequestOutput": ".outputs",
        "STAGE_PREFIX": ".specs",
        "per_token_outputs": ".specs",
        "stage_output_specs": ".specs",
        "StageOutputCache": ".store",
    },
)
