"""Decode steps replayed as CUDA graphs: on a GPU a small model's decode step is bound by the host
launching its kernels one by one; a graph launches the whole recorded step at once (vLLM's
CUDA graphs).

Per batch size of `capture_sizes` (vLLM's: 1, 2, 4, then multiples of 8 up to `max_num_seqs`,
at most MAX_CAPTURE_SIZE) the model's decode forward up to the final hidden states is recorded
once over fixed buffers (model/static_decode.py) after an eager warm-up (Triton compiles there).
A step whose every sequence has one new token, fits the largest size and the buffers' context
width (`max_seq_len_to_capture`), and needs nothing the graph lacks (no LoRA adapter, image
input, prompt logprobs or hidden states: `ModelRunner.takes_graph`) copies its ids,
positions, slots, block tables and lengths into the buffers, padded up to the next size, and
replays. Padding rows write their K/V to a null block the scheduler never hands out and have
length 0 (nothing read). Everything else runs eagerly.

`mode` "static" runs the same buffers and forward without capturing: how a CPU checks the path
under Triton's interpreter (PREFIXKV_CUDA_GRAPHS=static with TRITON_INTERPRET=1).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from collections.abc import Sequence

import torch

from ..model import LlamaModel
from ..model.attention import static_decode_meta
from ..model.host_copy import pinned_for, tensor_on
from ..model.static_decode import StaticDecodeInputs
from .decode_host_inputs import DecodeHostInputs
from .scheduler_output import ScheduledRequest

logger = logging.getLogger("prefixkv")

MAX_CAPTURE_SIZE = 512  # vLLM's default cap
ENV = "PREFIXKV_CUDA_GRAPHS"
MIB = 1 << 20


def default_capture_sizes(max_num_seqs: int, max_capture_size: int = MAX_CAPTURE_SIZE) -> list[int]:
    """vLLM's sizes: 1, 2, 4, then every multiple of 8, up to max_num_seqs and the cap."""
    top = min(max_num_seqs, max_capture_size)
    return [s for s in [1, 2, 4, *range(8, top + 1, 8)] if s <= top] or [1]


def capture_sizes(max_num_seqs: int, compilation_config: dict[str, object] | int | None) -> list[int]:
    """The batch sizes to capture: compilation_config's `cudagraph_capture_sizes` if given (those
    above max_num_seqs dropped), else vLLM's defaults up to its `max_capture_size`."""
    cc = compilation_config if isinstance(compilation_config, dict) else {}
    sizes = cc.get("cudagraph_capture_sizes")
    if sizes is not None:
        assert isinstance(sizes, list)
        return sorted({int(s) for s in sizes if int(s) <= max_num_seqs}) or [1]
    cap = cc.get("max_capture_size")
    return default_capture_sizes(max_num_seqs, int(cap) if isinstance(cap, int) else MAX_CAPTURE_SIZE)


def graph_mode(
    device: torch.device, enforce_eager: bool, compilation_config: dict[str, object] | int | None
) -> tuple[str | None, str]:
    """ "capture", "static" (the buffers without a capture) or None (eager), and why."""
    if enforce_eager:
        return None, "enforce_eager=True"
    if isinstance(compilation_config, dict) and str(compilation_config.get("cudagraph_mode", "")).upper() == "NONE":
        return None, "compilation_config cudagraph_mode NONE"
    wanted = os.environ.get(ENV, "").strip().lower()
    if wanted not in ("", "static", "capture"):
        raise ValueError(f"{ENV}={wanted!r}: expected 'capture', 'static' or nothing")
    if device.type == "cpu":
        if wanted == "static" and os.environ.get("TRITON_INTERPRET") == "1":
            return "static", f"{ENV}=static under Triton's interpreter"
        return None, "a CPU runs every step eagerly"
    if device.type != "cuda":
        return None, f"no CUDA graphs on {device.type}"
    if importlib.util.find_spec("triton") is None:
        return None, "Triton is not installed (the captured decode attention is Triton's)"
    if not wanted:
        # verified on an H100 (2026-11-27): replays equal eager steps bit for bit in float32, the
        # engine's outputs equal transformers', a decode step of the default model 7.3x faster
        return "capture", "CUDA with Triton"
    return wanted, f"CUDA with Triton, {ENV}={wanted}"


class DecodeGraphs:
    """The fixed buffers, one graph (or, `static`, one metadata) per size, and their outputs."""

    def __init__(
        self,
        model: LlamaModel,
        kv_caches: list[torch.Tensor],
        sizes: Sequence[int],
        max_blocks: int,
        block_size: int,
        null_block: int,
        device: torch.device,
        mode: str,
        max_model_len: int = 0,
    ) -> None:
        """`null_block`: a block of the caches no sequence holds, where padding rows write.
        `max_model_len`: the longest context any step (eager ones too) may have: the model's
        position tables are built that far before a capture, never replaced after."""
        if mode not in ("capture", "static"):
            raise ValueError(f"unknown graph mode {mode!r}")
        self.model, self.kv_caches, self.mode = model, kv_caches, mode
        self.sizes = sorted(set(sizes))
        self.max_size = self.sizes[-1]
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.null_slot = null_block * block_size
        self.inputs = StaticDecodeInputs(self.max_size, max_blocks, block_size, device)
        self.host_inputs = DecodeHostInputs(self.max_size, max_blocks, block_size, self.null_slot)
        self.max_context = self.inputs.max_context
        self.metas = {s: static_decode_meta(self.inputs.view(s)) for s in self.sizes}
        self.outputs: dict[int, torch.Tensor] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.graph_bytes = 0  # the card's free memory the capture took
        self.capture_seconds = 0.0
        self.replays = 0  # steps that took this path (a test checks the path ran)

    # -- a step ------------------------------------------------------------------------------------
    def takes(self, scheduled: list[ScheduledRequest]) -> bool:
        """Whether a step's shape fits: one new token a sequence, at most the largest size, every
        context within the buffers' width."""
        if not scheduled or len(scheduled) > self.max_size:
            return False
        top = self.max_context
        return all(len(sr.token_ids) == 1 and sr.start < top for sr in scheduled)

    def size_for(self, batch: int) -> int:
        return next(s for s in self.sizes if s >= batch)

    @torch.inference_mode()
    def run(
        self, scheduled: list[ScheduledRequest], carried: tuple[list[int], torch.Tensor] | None = None
    ) -> torch.Tensor:
        """The step's final hidden states [len(scheduled), H]: a view of the graph's output,
        overwritten by the next step. `carried`: rows whose input token is on the device already
        (the previous step's draws, async scheduling). The buffers are filled in stream order from
        page-locked copies: the host never waits for the device here."""
        b = len(scheduled)
        size = self.size_for(b)
        every_id_carried = carried is not None and len(carried[0]) == b
        rows, lens, tables = self.host_inputs.build(scheduled, size, ids_on_device=every_id_carried)
        buf = self.inputs
        dev = buf.tokens.device
        buf.tokens[:, :size].copy_(pinned_for(rows, dev), non_blocking=True)
        buf.seq_lens[:size].copy_(pinned_for(lens, dev), non_blocking=True)
        if carried is not None:
            carried_rows, tokens = carried
            if every_id_carried:  # every row (rows strictly increase): a plain copy
                buf.tokens[0, :b].copy_(tokens)
            else:
                buf.tokens[0].index_copy_(0, tensor_on(carried_rows, tokens.device, torch.long), tokens)
        # columns past a row's blocks, and padding rows' tables, are never read (their lengths)
        buf.block_tables[:b, : tables.shape[1]].copy_(pinned_for(tables, dev), non_blocking=True)
        self.replays += 1
        graph = self.graphs.get(size)
        if graph is not None:
            graph.replay()
            return self.outputs[size][:b]
        return self._forward(size)[:b]

    def _forward(self, size: int) -> torch.Tensor:
        meta = self.metas[size]
        view = meta.static
        assert view is not None
        hidden: torch.Tensor = self.model(view.input_ids, view.positions, self.kv_caches, meta)
        return hidden

    # -- capture -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        """Record every size's forward, largest first, into one memory pool (the smaller graphs
        reuse the larger one's memory), after two eager runs of each (Triton compiles, the
        allocator settles). Buffers hold padding rows only: nothing real is written or read."""
        buf = self.inputs
        self.model.reserve_positions(max(self.max_model_len, self.max_context))
        buf.slot_mapping.fill_(self.null_slot)
        buf.seq_lens.zero_()
        buf.input_ids.zero_()
        buf.positions.zero_()
        if self.mode != "capture":
            for size in self.sizes:
                self._forward(size)
            return
        device = buf.input_ids.device
        start = time.perf_counter()
        torch.cuda.synchronize(device)
        free_before = torch.cuda.mem_get_info(device)[0]
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        for size in reversed(self.sizes):
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._forward(size)
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize(device)
        self.graph_bytes = max(0, free_before - torch.cuda.mem_get_info(device)[0])
        self.capture_seconds = time.perf_counter() - start
        logger.info("CUDA graphs captured: %s", self.summary())

    def summary(self) -> str:
        return (
            f"decode batch sizes {_ranges(self.sizes)} (contexts up to {self.max_context} tokens) in "
            f"{self.capture_seconds:.1f} s, {self.graph_bytes / MIB:.0f} MiB"
        )


def _ranges(sizes: list[int]) -> str:
    """1, 2, 4, 8..256 (step 8) rather than 35 numbers in a log line."""
    if len(sizes) <= 6:
        return ", ".join(map(str, sizes))
    return f"{', '.join(map(str, sizes[:3]))}, {sizes[3]}..{sizes[-1]} ({len(sizes)} sizes)"
