"""POST /v1/embeddings: the final hidden state of each input's last token, L2-normalized unless
`normalize` is false (LAST pooling, vLLM's default for decoder models), as floats or base64
float32. Requests share cached prefixes like any other; with `--enable-stage-output-cache` the
hidden states of cached blocks are kept too (see docs/lora.md)."""

from __future__ import annotations

import base64
import time

import numpy as np
from fastapi import Request

from ..sampling_params import SamplingParams
from ..stage.pooling import PoolingParams, pool
from .errors import APIError
from .protocol import EmbeddingData, EmbeddingRequest, EmbeddingResponse, PromptTokensDetails, UsageInfo, random_id
from .serving import OpenAIServing

# one greedy token is drawn and dropped: the prompt's last position is computed like any prefill
_ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)


class OpenAIServingEmbedding(OpenAIServing):
    async def create(self, req: EmbeddingRequest, raw: Request) -> EmbeddingResponse:
        model = self.check_model(req.model)
        self.check_fields(req)
        prompts, texts = await self.prompt_inputs(req.input, req.add_special_tokens, "input")
        for ids in prompts:
            self.check_length(ids, 1, "input")
        params = PoolingParams("last", req.normalize)
        rid = req.request_id or random_id("embd")
        gens = self.start(prompts, texts, _ONE_TOKEN, rid, req.cache_salt, hidden_states_from=params.first_position)
        finals = await self.collect(raw, gens)
        data = []
        for i in range(len(prompts)):
            hidden = finals[i].hidden_states
            if hidden is None:
                raise APIError("the engine returned no hidden states", 500)
            vector = pool(hidden, params).float().cpu()
            if req.encoding_format == "base64":
                encoded: list[float] | str = base64.b64encode(vector.numpy().astype(np.float32).tobytes()).decode()
            else:
                encoded = vector.tolist()
            data.append(EmbeddingData(index=i, embedding=encoded))
        num_tokens = sum(len(p) for p in prompts)
        cached = sum(out.num_cached_tokens for out in finals.values())
        return EmbeddingResponse(
            id=rid,
            created=int(time.time()),
            model=model,
            data=data,
            usage=UsageInfo(
                prompt_tokens=num_tokens,
                total_tokens=num_tokens,
                prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
            ),
        )
