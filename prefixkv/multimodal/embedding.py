"""The model runner's multimodal step: the input embeddings of a step's tokens, with the image
embeddings spliced in at the placeholder positions. Encoder outputs come from the encoder cache
or, for the items it lacks, from one batched encoder call; each chunk takes only the rows of an
item that fall inside it (`EncoderInput.rows`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..model.llava.vision import VisionEncoder
from .encoder_cache import EncoderCache, EncoderKey
from .encoder_input import EncoderInput


class MultiModalEmbedder:
    def __init__(self, encoder: VisionEncoder, cache: EncoderCache) -> None:
        self.encoder = encoder
        self.cache = cache

    def encoder_outputs(self, inputs: Sequence[EncoderInput]) -> dict[EncoderKey, torch.Tensor]:
        """Every needed item's full encoder output by its cache key (identity, cache salt): cached,
        or encoded now (items shared by several requests of the step with the same salt are
        encoded once)."""
        outputs: dict[EncoderKey, torch.Tensor] = {}
        missing: dict[EncoderKey, torch.Tensor] = {}
        for inp in inputs:
            key: EncoderKey = inp.cache_key
            if key in outputs or key in missing:
                continue
            cached = self.cache.get(key)
            if cached is not None:
                outputs[key] = cached
            else:
                missing[key] = inp.data
        if missing:
            encoded = self.encoder.encode(torch.stack(list(missing.values())))
            self.cache.encoder_runs += len(missing)
            for i, key in enumerate(missing):
                # a copy: a view would keep the whole batch alive in the cache
                out = encoded[i].clone() if len(missing) > 1 else encoded[0]
                outputs[key] = out
                self.cache.put(key, out)
        return outputs

    def spliced_rows(self, placements: Sequence[tuple[int, Sequence[EncoderInput]]]) -> list[tuple[int, torch.Tensor]]:
        """The encoder rows a step splices in: (first row in the step, the rows), one per item
        a chunk holds. `placements`: (index of the chunk's first token in the step, the chunk's
        encoder inputs)."""
        outputs = self.encoder_outputs([inp for _, inputs in placements for inp in inputs])
        spliced = []
        for base, inputs in placements:
            for inp in inputs:
                a, b = inp.rows
                spliced.append((base + inp.dest, outputs[inp.cache_key][a:b]))
        return spliced

    def inputs_embeds(
        self,
        embed: Callable[[torch.Tensor], torch.Tensor],
        input_ids: torch.Tensor,
        placements: Sequence[tuple[int, Sequence[EncoderInput]]],
    ) -> torch.Tensor:
        """The step's input embeddings: its tokens' with the encoder's rows in place (`spliced_rows`)."""
        h = embed(input_ids)
        for dst, rows in self.spliced_rows(placements):
            h[dst : dst + rows.shape[0]] = rows.to(h.device, h.dtype)
        return h
