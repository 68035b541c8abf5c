"""POST /v1/embeddings and vLLM's POST /pooling: each input's final hidden states pooled as the
engine's `--pooler-config` says (default LAST, vLLM's for decoder models; MEAN, CLS, or ALL = one
vector per token), L2-normalized unless `normalize` is false, as floats or base64 float32.
Requests share cached prefixes like any other; with `--enable-stage-output-cache` the hidden
states of cached blocks are kept too, so MEAN and ALL pooling reuse a cached prefix (docs/lora.md)."""

from __future__ import annotations

import base64
import time
from typing import Any

import numpy as np
from fastapi import Request

from ..sampling_params import SamplingParams
from ..stage_outputs.pooling import PoolingParams, pool
from .errors import APIError
from .protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingData,
    PoolingRequest,
    PoolingResponse,
    PromptTokensDetails,
    UsageInfo,
    random_id,
)
from .serving import OpenAIServing

# one greedy token is drawn and dropped: the prompt's last position is computed like any prefill
_ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)


def _encode(vector: Any, encoding_format: str) -> Any:
    if encoding_format == "base64":  # float32 bytes, row-major for ALL pooling (as vLLM)
        return base64.b64encode(vector.numpy().astype(np.float32).tobytes()).decode()
    return vector.tolist()


class OpenAIServingEmbedding(OpenAIServing):
    async def _pool(
        self, req: EmbeddingRequest | PoolingRequest, raw: Request, params: PoolingParams, prefix: str
    ) -> tuple[str, str, list[Any], UsageInfo]:
        """Run every input for its hidden states and pool them: (model, id, vectors, usage)."""
        model = self.check_model(req.model)
        self.check_fields(req)
        prompts, texts = await self.prompt_inputs(req.input, req.add_special_tokens, "input")
        for ids in prompts:
            self.check_length(ids, 1, "input")
        rid = req.request_id or random_id(prefix)
        gens = self.start(
            prompts, texts, _ONE_TOKEN, rid, req.cache_salt, stream=False, hidden_states_from=params.first_position
        )
        finals = await self.collect(raw, gens)
        vectors = []
        for i in range(len(prompts)):
            hidden = finals[i].hidden_states
            if hidden is None:
                raise APIError("the engine returned no hidden states", 500)
            vectors.append(pool(hidden, params).float().cpu())
        num_tokens = sum(len(p) for p in prompts)
        cached = sum(out.num_cached_tokens for out in finals.values())
        usage = UsageInfo(
            prompt_tokens=num_tokens,
            total_tokens=num_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )
        return model, rid, vectors, usage

    def _default(self) -> PoolingParams:
        return self.engine.config.default_pooling

    async def create(self, req: EmbeddingRequest, raw: Request) -> EmbeddingResponse:
        default = self._default()
        normalize = default.normalize if req.normalize is None else req.normalize
        model, rid, vectors, usage = await self._pool(req, raw, PoolingParams(default.pooling, normalize), "embd")
        data = [EmbeddingData(index=i, embedding=_encode(v, req.encoding_format)) for i, v in enumerate(vectors)]
        return EmbeddingResponse(id=rid, created=int(time.time()), model=model, data=data, usage=usage)

    async def create_pooling(self, req: PoolingRequest, raw: Request) -> PoolingResponse:
        """vLLM's /pooling: task "embed" pools as the engine's pooler config says, "token_embed"
        returns one vector per token (ALL); no other task on a decoder model."""
        default = self._default()
        normalize = default.normalize if req.normalize is None else req.normalize
        if req.task is None or req.task == "embed":
            params = PoolingParams(default.pooling, normalize)
        elif req.task == "token_embed":
            params = PoolingParams("all", normalize)
        else:
            raise APIError(
                f"task {req.task!r} is not supported by prefixkv: only 'embed' and 'token_embed' "
                "(no classification head is loaded)",
                400,
                param="task",
            )
        model, rid, vectors, usage = await self._pool(req, raw, params, "pool")
        data = [PoolingData(index=i, data=_encode(v, req.encoding_format)) for i, v in enumerate(vectors)]
        return PoolingResponse(id=rid, created=int(time.time()), model=model, data=data, usage=usage)
