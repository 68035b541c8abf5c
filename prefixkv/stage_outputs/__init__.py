"""The stage-output cache (after vLLM-Omni): per-token model outputs - the final hidden states,
and any output whose first dimension is the token count - kept per KV block id, so a prefix hit
yields them for the cached tokens as well as the KV (docs/design.md, "Stage-output cache").

store.py     StageOutputCache: the per-block CPU tensors and which block ids hold valid rows
specs.py     what the cache declares in the engine's one memory budget; discovering outputs
pooling.py   PoolingParams and LAST / MEAN / CLS / ALL pooling of a prompt's hidden states
outputs.py   vLLM's EmbeddingRequestOutput / PoolingRequestOutput shapes
"""

from .outputs import EmbeddingOutput, EmbeddingRequestOutput, PoolingOutput, PoolingRequestOutput
from .pooling import POOLING_TYPES, PoolingParams, parse_pooler_config, pool
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
