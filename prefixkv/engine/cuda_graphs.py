"""Steps replayed as CUDA graphs: on a GPU a small model's step is bound by the host launching its
kernels one by one; a graph launches the whole recorded step at once (vLLM's CUDA graphs; mixed
steps too where cudagraph_mode asks for them, each captured whole).

Decode steps: per batch size of `capture_sizes` (vLLM's: 1, 2, 4, then multiples of 8 up to
`max_num_seqs`, at most MAX_CAPTURE_SIZE) the model's decode forward up to the final hidden states is
recorded once over fixed buffers (model/static_decode.py) after an eager warm-up (Triton compiles
there). A step whose every sequence has one new token, fits the largest size and the buffers'
context width (`max_seq_len_to_capture`) copies its ids, positions, slots, block tables and lengths
into the buffers in one copy (static_decode.DecodeLayout: the host's page-locked twin of the
device's flat buffer), padded up to the next size, and replays. Padding rows write their K/V to a
null block the scheduler never hands out and have length 0 (nothing read). The graphs of small
batches also run the LM head, each row's finite check and the argmax (DecodeTail): a greedy step
launches nothing else.

Mixed steps (prompts or chunks, with or without decodes), up to the token count where their replay
timed faster than the eager step on this card (mixed_graph_choice.py; all of them under
cudagraph_mode FULL): per token count of `mixed_capture_sizes` the forward over fixed buffers of
that many rows (model/static_mixed.py), attention by one kernel over a fixed grid that a host-built
tile map steers. A step of at most the largest count whose contexts fit the width is padded up to
the next count and replayed.

A model with KV-cache groups (sliding and full layers, memory/kv_groups.py) has its later groups'
slots and block tables in buffers of their own, for decode and mixed graphs (the lengths, the
sequences and the tile map shared).
A recurrent model (Mamba2, its hybrids, Qwen3-Next's delta net) has each row's state blocks - the
one it continues from, the one it writes - in the decode buffers too, and its mixed steps replay
over the scan's buffers (model/static_scan.py: segments padded to the size's most, each request's
chain of them walked by one kernel, the conv as windows of row indices), built by the host each
step (scan_host_inputs.py), a request continuing from a block another request of the step writes
walking that request's chain first.

A vision-language model's mixed graphs take image rows: the encoder runs outside the graph and its
rows go into a buffer the graph selects from in place of the token embeddings
(static_image_rows.py); a decode graph takes none, so a one-token step holding a placeholder
replays a mixed one. Steps larger than the graphs run eagerly. Prompt logprobs, returned hidden
states and the stage-output cache read the replay's output (each row's final hidden state),
outside the graph. Where LoRA is attached, each size has a second graph that computes each row's
adapter update through the masked dense path over every slot (lora/layers.StaticLoRAMapping), the
rows' slots in a buffer: steps with adapters replay too, and steps without them read no adapter
weights.

`mode` "static" runs the same buffers and forward without capturing: how a CPU checks the path
under Triton's interpreter (PREFIXKV_CUDA_GRAPHS=static with TRITON_INTERPRET=1).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..lora.layers import StaticLoRAMapping
from ..model import AttentionMetadata, LlamaModel
from ..model.attention import static_meta
from ..model.attention_path import triton_kernels
from ..model.host_copy import pinned_for, tensor_on
from ..model.kernels import gpu_fused
from ..model.static_decode import StaticDecodeInputs, StaticDecodeView
from ..model.static_mixed import StaticMixedInputs, StaticMixedView
from ..model.static_scan import StaticScanInputs
from ..sampling_params import SamplingParams
from .decode_host_inputs import DecodeHostInputs
from .graph_sampling import GraphSampling
from .mixed_host_inputs import MixedHostBuffer, build_mixed
from .sampler import SampledTensors, mark_unfinished, rows_finite
from .scan_host_inputs import build_scan
from .scheduler_output import ScheduledRequest
from .static_image_rows import StaticImageRows

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

logger = logging.getLogger("prefixkv")

MAX_CAPTURE_SIZE = 512  # vLLM's default cap
ENV = "PREFIXKV_CUDA_GRAPHS"
MIB = 1 << 20
# int32 entries a step copies in one span at most (256 KiB: 128 rows of 512-block tables); past
# that, its header, then its tables' used columns (DecodeLayout, MixedLayout)
SPAN_COPY_MAX = 1 << 16
# Decode graphs of at most this much float32 logits (one buffer, shared by every size) also run the
# LM head and a greedy step's tail (DecodeTail): a greedy decode step then launches nothing outside
# its graph but its copies. 32 MiB: 170 rows of a 49,152-token vocabulary, 64 of a 128,256 one.
TAIL_LOGITS_BYTES = 32 * MIB
# the batch-1 decode graph with its norms and SiLU folded into its products (_choose_one_row) is
# kept where its replay takes less than this share of the layer by layer one's (a tie keeps cuBLAS)
ONE_ROW_MARGIN = 0.98
REPLAYS_TIMED = 20  # back to back, a timed run of a graph's replays


def tail_rows(sizes: Sequence[int], vocab: int) -> int:
    """The largest decode size whose float32 logits fit TAIL_LOGITS_BYTES (0: none): the sizes up
    to it run their tail in the graph."""
    return max((s for s in sizes if s * vocab * 4 <= TAIL_LOGITS_BYTES), default=0)


@dataclass(slots=True)
class DecodeTail:
    """A replayed decode step's first `rows` rows past the final hidden states, computed in its
    graph: float32 `logits` [rows, vocab] (a view of the shared buffer, overwritten by the next
    step), whether each row is finite, its argmax, and that argmax marked (sampler.mark_unfinished)."""

    logits: torch.Tensor
    finite: torch.Tensor
    tokens: torch.Tensor
    marked: torch.Tensor


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


# Token counts of mixed steps captured by default: 1.2-1.5x apart from 32 on (a step pads to the
# next), up to the scheduler's max_num_batched_tokens and MAX_MIXED_TOKENS. Above vLLM's 512: on an
# H200 a 135M model's 1k-token prefill took 14 ms eagerly, likely mostly launches (not profiled).
MIXED_LADDER = (8, 16, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512, 640, 768, 1024, 1280, 1536, 2048)
MAX_MIXED_TOKENS = 2048


def mixed_capture_sizes(max_num_batched_tokens: int, compilation_config: dict[str, object] | int | None) -> list[int]:
    """The token counts of mixed steps to capture where mixed steps replay at all
    (mixed_graph_choice.policy): compilation_config's `cudagraph_capture_sizes` if given (vLLM
    captures those token counts for every kind of step), else MIXED_LADDER; at most
    max_num_batched_tokens (a step holds no more) and `max_capture_size` if given, else
    MAX_MIXED_TOKENS, that bound itself the last size."""
    cc = compilation_config if isinstance(compilation_config, dict) else {}
    cap = cc.get("max_capture_size")
    top = min(max_num_batched_tokens, int(cap) if isinstance(cap, int) else MAX_MIXED_TOKENS)
    sizes = cc.get("cudagraph_capture_sizes")
    if sizes is not None:
        assert isinstance(sizes, list)
        return sorted({int(s) for s in sizes if int(s) <= top})
    return sorted({*(s for s in MIXED_LADDER if s < top), top})


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


class StepGraphs:
    """The fixed buffers, one graph (or, `static`, one metadata) per size, and their outputs: decode
    steps by batch size (`sizes`), mixed steps by token count (`mixed_sizes`; none: mixed steps
    run eagerly)."""

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
        *,
        mixed_sizes: Sequence[int] = (),
        max_seqs: int = 0,
        lora: tuple[int, int] | None = None,
        layer_groups: list[int] | None = None,
        recurrent: bool = False,
        image_rows: bool = False,
    ) -> None:
        """`null_block`: a block of the caches no sequence holds, where padding rows write.
        `max_model_len`: the longest context any step (eager ones too) may have: the model's
        position tables are built that far before a capture, never replaced after. `max_seqs`:
        the most sequences a mixed step holds (the scheduler's max_num_seqs). `lora`: (max_loras,
        max_lora_rank) where LoRA is attached to the model: each size is captured twice, the second
        graph ("decode-lora", "mixed-lora") computing the adapters' updates of its rows (none for a
        base row: an exact 0), each row's slot in a buffer the step fills; a step without adapters
        replays the first, reading no adapter weights. `layer_groups`: each layer's KV-cache group
        (memory/kv_groups.py; None: one group): each later group has its own slots and block
        tables (the same lengths), read by its layers. `recurrent`: layers keep a state per block
        (model/mamba2.py), each row's read and written blocks in the decode buffers, the scan's
        plan in the mixed ones. `image_rows`: the model takes image embeddings (a vision-language
        checkpoint): its mixed graphs read their input embeddings through StaticImageRows."""
        if mode not in ("capture", "static"):
            raise ValueError(f"unknown graph mode {mode!r}")
        self.model, self.kv_caches, self.mode = model, kv_caches, mode
        self.sizes = sorted(set(sizes))
        self.max_size = self.sizes[-1]
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.null_slot = null_block * block_size
        self.null_block = null_block
        self.inputs = StaticDecodeInputs(self.max_size, max_blocks, block_size, device, recurrent=recurrent)
        pinned = device.type == "cuda"
        self.host_inputs = DecodeHostInputs(self.max_size, max_blocks, block_size, self.null_slot, recurrent, pinned)
        # the page-locked inputs are rewritten only once the copy from them is done (a GPU): one
        # event, recorded again after each step's copies (none created a step)
        self._inputs_copied: torch.cuda.Event | None = None
        if pinned:
            self._inputs_copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
        self.mixed_host: MixedHostBuffer | None = None
        self.mixed_group_views: dict[int, list[StaticMixedView]] = {}  # per size, each group's
        self.max_context = self.inputs.max_context
        self.metas = {s: static_meta(self.inputs.view(s)) for s in self.sizes}
        # a later KV-cache group's slots and tables, and the mirror its host half keeps
        self.group_inputs: list[StaticDecodeInputs] = []
        self.group_hosts: list[DecodeHostInputs] = []
        self.group_views: dict[int, list[StaticDecodeView]] = {}  # per size, each group's
        if layer_groups is not None and max(layer_groups, default=0) > 0:
            for _ in range(max(layer_groups)):
                self.group_inputs.append(
                    StaticDecodeInputs(self.max_size, max_blocks, block_size, device, lengths_of=self.inputs)
                )
                self.group_hosts.append(
                    DecodeHostInputs(self.max_size, max_blocks, block_size, self.null_slot, pinned=pinned)
                )
            for size, meta in self.metas.items():
                meta.layer_groups = layer_groups
                self.group_views[size] = [group.view(size) for group in self.group_inputs]
                for g, group_view in enumerate(self.group_views[size], start=1):
                    meta.set_layer_group(g, static_meta(group_view))
        self.mixed_sizes = sorted(set(mixed_sizes))
        self.mixed: StaticMixedInputs | None = None
        self.mixed_metas: dict[int, AttentionMetadata] = {}
        self.mixed_groups: list[StaticMixedInputs] = []
        self.image_rows: StaticImageRows | None = None
        if self.mixed_sizes:
            if max_seqs < 1:
                raise ValueError("mixed-step graphs need max_seqs")
            heads = model.config.num_attention_heads // model.config.num_key_value_heads
            tile_tokens = triton_kernels().prefill_tile_tokens(model.dtype, device.type == "cuda", heads)
            top = self.mixed_sizes[-1]
            conv_kernel = model.config.recurrent_conv_kernel if recurrent else None
            self.mixed = StaticMixedInputs(
                top, min(max_seqs, top), max_blocks, block_size, tile_tokens, device, conv_kernel=conv_kernel
            )
            self.mixed_metas = {s: static_meta(self.mixed.view(s)) for s in self.mixed_sizes}
            mixed = self.mixed
            # a later KV-cache group's slots and tables, the step's layout shared
            self.mixed_groups = [
                StaticMixedInputs(top, mixed.max_seqs, max_blocks, block_size, tile_tokens, device, layout=mixed)
                for _ in self.group_inputs
            ]
            if image_rows:
                self.image_rows = StaticImageRows(top, model.config.hidden_size, model.dtype, device)
            self.mixed_host = MixedHostBuffer(mixed.layout, pinned)
            for size, meta in self.mixed_metas.items():
                if self.mixed_groups:
                    meta.layer_groups = layer_groups
                self.mixed_group_views[size] = [group.view(size) for group in self.mixed_groups]
                for g, mixed_group_view in enumerate(self.mixed_group_views[size], start=1):
                    meta.set_layer_group(g, static_meta(mixed_group_view))
        self.lora = lora
        self.lora_maps: dict[tuple[str, int], StaticLoRAMapping] = {}
        if lora is not None:
            rows = max([self.max_size, *self.mixed_sizes])
            self.row_slots = torch.full((rows,), -1, dtype=torch.long, device=device)
            slots, rank = lora
            for kind, sizes in (("decode", self.sizes), ("mixed", self.mixed_sizes)):
                for size in sizes:
                    mapping = StaticLoRAMapping(self.row_slots[:size], slots, rank, model.dtype)
                    self.lora_maps[f"{kind}-lora", size] = mapping
        self.outputs: dict[tuple[str, int], torch.Tensor] = {}
        self.graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        self.graph_bytes = 0  # the card's free memory the capture took
        self.capture_seconds = 0.0
        self.replays = 0  # decode steps that took this path (a test checks the path ran)
        self.mixed_replays = 0  # mixed steps that did
        self.lora_replays = 0  # steps of either kind with an adapter's rows
        self.draws = 0  # sampled decode steps whose draws ran in the graphs (`draw`)
        self.failed: set[str] = set()  # kinds whose capture failed: they run eagerly
        # decode sizes up to `tail_rows` compute their DecodeTail in the graph, logits into `logits`
        self.tail_rows = 0
        self.logits: torch.Tensor | None = None
        # their sampled steps' draws (graph_sampling.py), after the decode graph
        self.sampling: GraphSampling | None = None
        self._tails: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._last: tuple[str, int] | None = None  # the last replayed (kind, size)
        # the batch-1 decode replay's microseconds (layer by layer, folded: _choose_one_row)
        self.one_row_timing: tuple[float, float] | None = None

    # -- a step ------------------------------------------------------------------------------------
    def kind(self, scheduled: list[ScheduledRequest]) -> str | None:
        """Which graph a step's shape fits: "decode" (one new token a sequence, at most the largest
        batch, every context within the buffers' width), "mixed" (at most the largest token count
        and the most sequences, every context within the width; a decode-shaped step whose one
        token is an image placeholder too, where mixed graphs take image rows) or None."""
        if not scheduled:
            return None
        top = self.max_context
        if len(scheduled) <= self.max_size and all(len(sr.token_ids) == 1 and sr.start < top for sr in scheduled):
            if self.image_rows is None or not any(sr.mm_inputs for sr in scheduled):
                return None if "decode" in self.failed else "decode"
        mixed = self.mixed
        if mixed is None or not self.mixed_sizes or len(scheduled) > mixed.max_seqs or "mixed" in self.failed:
            return None
        tokens = 0
        for sr in scheduled:
            n = len(sr.token_ids)
            if sr.start + n > top:
                return None
            tokens += n
        return "mixed" if tokens <= self.mixed_sizes[-1] else None

    def size_for(self, batch: int) -> int:
        return next(s for s in self.sizes if s >= batch)

    def mixed_size_for(self, tokens: int) -> int:
        return next(s for s in self.mixed_sizes if s >= tokens)

    @torch.inference_mode()
    def run(
        self,
        scheduled: list[ScheduledRequest],
        carried: tuple[list[int], torch.Tensor] | None = None,
        kind: str | None = None,
        lora_slots: list[int] | None = None,
        spliced: list[tuple[int, torch.Tensor]] | None = None,
    ) -> tuple[torch.Tensor, list[int] | None]:
        """The step's final hidden states - a view of the graph's output, overwritten by the next
        step - and each request's first row (None: row i is request i's, a decode step). `kind`:
        what `kind` said of this step (asked here if not given). `carried`: rows whose input token
        is on the device already (the previous step's draws, async scheduling). `lora_slots`: each
        request's adapter slot, -1 for the base model (None: every request's). The buffers are
        filled in stream order from page-locked copies: the host never waits for the device here.
        `spliced`: image rows (first row in the step, the encoder's rows) of a mixed step
        (`takes_images`)."""
        kind = kind or self.kind(scheduled)
        if kind is None:
            raise ValueError("this step fits no graph")
        if spliced and not self.takes_images(kind):
            raise ValueError(f"image rows in a step, but the {kind} graphs take none")
        if lora_slots is not None and self.lora is None:
            raise ValueError("adapter rows in a step, but the graphs were captured without LoRA")
        if kind == "decode":
            return self._run_decode(scheduled, carried, lora_slots), None
        return self._run_mixed(scheduled, carried, lora_slots, spliced or ())

    def takes_images(self, kind: str) -> bool:
        """Whether a step of `kind` with image rows replays a graph: mixed steps of a
        vision-language model."""
        return kind == "mixed" and self.image_rows is not None

    def _with_adapters(self, kind: str, size: int, row_slots: np.ndarray | None) -> str:
        """The graph a step of `kind` and `size` replays: with adapter rows (each real row's slot in
        `row_slots`, -1 for the base model), their slots copied into the buffer (padding rows -1)
        and the kind's "-lora" graph; without, `kind` itself."""
        if row_slots is None:
            return kind
        slots = np.full(size, -1, dtype=np.int64)
        slots[: len(row_slots)] = row_slots
        self.row_slots[:size].copy_(pinned_for(torch.from_numpy(slots), self.row_slots.device), non_blocking=True)
        self.lora_replays += 1
        return f"{kind}-lora"

    def _run_decode(
        self,
        scheduled: list[ScheduledRequest],
        carried: tuple[list[int], torch.Tensor] | None,
        lora_slots: list[int] | None = None,
    ) -> torch.Tensor:
        b = len(scheduled)
        size = self.size_for(b)
        kind = self._with_adapters("decode", size, None if lora_slots is None else np.asarray(lora_slots))
        every_id_carried = carried is not None and len(carried[0]) == b
        if self._inputs_copied is not None:  # the last step's copy from the host buffers is done
            self._inputs_copied.synchronize()  # (at once where never recorded)
        host = self.host_inputs.build(scheduled, size, ids_on_device=every_id_carried)
        view = self.metas[size].static
        assert isinstance(view, StaticDecodeView)
        tables_at = self.inputs.layout.tables_at
        self._copy_inputs(self.inputs.flat, self.host_inputs.flat, host.span, tables_at, view.block_tables, host.tables)
        if carried is not None:
            carried_rows, tokens = carried
            if every_id_carried:  # every row (rows strictly increase): a plain copy
                view.input_ids[:b].copy_(tokens)
            else:
                view.input_ids.index_copy_(0, tensor_on(carried_rows, tokens.device, torch.long), tokens)
        for g, group_host in enumerate(self.group_hosts):
            # (a sliding group's table holds 0 where a block left the window: never read)
            g_step = group_host.build(scheduled, size, True, [sr.group_block_tables[g] for sr in scheduled])
            g_view = self.group_views[size][g]
            g_view.slot_mapping.copy_(g_step.rows[2], non_blocking=True)
            self._copy_tables(g_view.block_tables, g_step.tables)
        if self._inputs_copied is not None:  # after the copies, on their device's stream
            self._inputs_copied.record(torch.cuda.current_stream(self.inputs.device))
        self.replays += 1
        return self._replay(kind, size)[:b]

    @staticmethod
    def _copy_inputs(
        flat: torch.Tensor,
        host_flat: torch.Tensor,
        span: tuple[int, int],
        tables_at: int,
        tables: torch.Tensor,
        step_tables: torch.Tensor | np.ndarray,
    ) -> None:
        """A step's inputs from the host's flat buffer into the device's (DecodeLayout,
        MixedLayout): its whole span in one copy while that is small; past SPAN_COPY_MAX entries
        (many rows of wide tables) the header, then the rows' used table columns (`step_tables`
        [rows, width] into `tables`)."""
        lo, hi = span
        if hi - lo <= SPAN_COPY_MAX:
            flat[lo:hi].copy_(host_flat[lo:hi], non_blocking=True)
            return
        flat[lo:tables_at].copy_(host_flat[lo:tables_at], non_blocking=True)
        StepGraphs._copy_tables(tables, step_tables)

    @staticmethod
    def _copy_tables(tables: torch.Tensor, step_tables: torch.Tensor | np.ndarray) -> None:
        """A step's block tables [rows, width] (host memory) into the corner of the device's
        `tables`: columns past a row's blocks, and other rows, are never read (the lengths)."""
        n, width = step_tables.shape
        host = (
            torch.from_numpy(np.ascontiguousarray(step_tables)) if isinstance(step_tables, np.ndarray) else step_tables
        )
        tables[:n, :width].copy_(pinned_for(host.contiguous(), tables.device), non_blocking=True)

    def _run_mixed(
        self,
        scheduled: list[ScheduledRequest],
        carried: tuple[list[int], torch.Tensor] | None,
        lora_slots: list[int] | None = None,
        spliced: Sequence[tuple[int, torch.Tensor]] = (),
    ) -> tuple[torch.Tensor, list[int]]:
        buf = self.mixed
        assert buf is not None
        tokens = sum(len(sr.token_ids) for sr in scheduled)
        size = self.mixed_size_for(tokens)
        view = self.mixed_metas[size].static
        assert isinstance(view, StaticMixedView)
        group_tables = [[sr.group_block_tables[g] for sr in scheduled] for g in range(len(self.mixed_groups))]
        host = build_mixed(
            scheduled, size, view.tiles, buf.tile_tokens, buf.padding_seq, self.block_size, self.null_slot,
            self.max_blocks, group_tables,
        )  # fmt: skip
        if self._inputs_copied is not None:  # the last step's copy from the host buffers is done
            self._inputs_copied.synchronize()  # (at once where never recorded)
        assert self.mixed_host is not None
        span = self.mixed_host.fill(host, size)
        # columns past a sequence's blocks, and other sequences' rows, are never read (the lengths
        # and the tile map)
        self._copy_inputs(buf.flat, self.mixed_host.flat, span, buf.layout.tables_at, view.block_tables, host.tables)
        for g, (g_slots, g_tables) in enumerate(host.groups):
            g_view = self.mixed_group_views[size][g]
            g_view.slot_mapping.copy_(pinned_for(g_slots, g_view.slot_mapping.device), non_blocking=True)
            self._copy_tables(g_view.block_tables, g_tables)
        qsl = host.query_start_loc
        rows = None if lora_slots is None else np.repeat(np.asarray(lora_slots, dtype=np.int64), np.diff(qsl))
        kind = self._with_adapters("mixed", size, rows)
        if carried is not None:
            carried_rows, ids = carried
            view.input_ids.index_copy_(0, tensor_on([qsl[i] for i in carried_rows], ids.device, torch.long), ids)
        if self.image_rows is not None:
            self.image_rows.fill(spliced)
        if buf.scan is not None:
            assert view.scan is not None
            self._copy_scan(buf.scan, view.scan.segments, scheduled, qsl, size)
        if self._inputs_copied is not None:  # after the copies, on their device's stream
            self._inputs_copied.record(torch.cuda.current_stream(self.inputs.device))
        self.mixed_replays += 1
        return self._replay(kind, size)[:tokens], qsl

    def _copy_scan(
        self, scan: StaticScanInputs, segs: int, scheduled: list[ScheduledRequest], qsl: list[int], size: int
    ) -> None:
        """A recurrent model's mixed step of `size` rows and `segs` segments: its scan's plan
        (scan_host_inputs.py) into the buffers."""
        plan = build_scan(scheduled, qsl, size, segs, scan.max_seqs, self.block_size, scan.conv_kernel, self.null_block)
        dev = scan.states.device
        scan.states.copy_(pinned_for(plan.states, dev), non_blocking=True)
        scan.pad_index[:segs].copy_(pinned_for(plan.pad_index, dev), non_blocking=True)
        scan.seg_blocks[:segs].copy_(pinned_for(plan.seg_blocks, dev), non_blocking=True)
        scan.out_index[:size].copy_(pinned_for(plan.out_index, dev), non_blocking=True)
        requests, longest = plan.chains.shape  # the other entries lie past their chains: never read
        scan.chains[:requests, :longest].copy_(pinned_for(plan.chains, dev), non_blocking=True)
        scan.chain_len.copy_(pinned_for(plan.chain_len, dev), non_blocking=True)
        scan.conv_rows[:size].copy_(pinned_for(plan.conv_rows, dev), non_blocking=True)
        scan.conv_ends[:segs].copy_(pinned_for(plan.conv_ends, dev), non_blocking=True)

    def step_slots(self, kind: str, rows: int) -> torch.Tensor:
        """The KV slots of the last step's first `rows` rows (a step of `kind`), as the buffers hold
        them until the next step is copied in."""
        assert self._last is not None and self._last[0].startswith(kind)
        size = self._last[1]
        view = (self.metas[size] if kind == "decode" else self.mixed_metas[size]).static
        assert isinstance(view, (StaticDecodeView, StaticMixedView))
        return view.slot_mapping[:rows]

    def decode_tail(self, rows: int) -> DecodeTail | None:
        """The last step's DecodeTail, its first `rows` rows, where it was a decode computing one."""
        last = self._last
        tail = self._tails.get(last) if last is not None and last[0].startswith("decode") else None
        if tail is None or self.logits is None:
            return None
        finite, tokens, marked = tail
        return DecodeTail(self.logits[:rows], finite[:rows], tokens[:rows], marked[:rows])

    def samples(self, params: list[SamplingParams]) -> bool:
        """Whether the rows of the last step's DecodeTail (the caller holds it, for every row of
        the step) draw their tokens in a graph (`draw`): none asks for more logprobs than the
        graphs score (the caller edits the logits for penalties and constraints first, the raw
        ones kept aside where rows are scored: `keep_raw`)."""
        return self.sampling is not None and "sample" not in self.failed and self.sampling.takes(params)

    def draw(
        self,
        params: list[SamplingParams],
        generators: list[torch.Generator],
        raw: torch.Tensor | None = None,
    ) -> SampledTensors:
        """What the last decode step's rows draw (`samples`), as the eager sampler draws it (each
        row's uniform from its generator): the tokens, the same tokens marked (-1 where a row's
        logits were not finite), and where a row asks for logprobs the tokens' logprobs and ranks
        and every row's top logprobs (GraphSampling.scores), each row's list cut to its count when
        read; views of buffers the next draw rewrites. `raw`: the rows' logits before the caller
        edited them for the draws (`keep_raw`), put back before the scores. In inference mode (the
        buffers were made in it)."""
        assert self.sampling is not None and self.logits is not None and self._last is not None
        size = self._last[1]
        sort = self.sampling.fill(params, generators, size)
        self.draws += 1
        logits = self.logits[:size]
        tokens, marked = self.sampling.replay(logits, sort)
        n = len(params)
        drawn = SampledTensors(tokens[:n], n, marked=marked[:n])
        if any(p.logprobs is not None for p in params):
            if raw is not None:
                logits[: raw.shape[0]].copy_(raw)
            chosen, ranks, values, ids = self.sampling.scores(logits, tokens)
            drawn.chosen, drawn.ranks = chosen[:n], ranks[:n]
            drawn.tops = [(list(range(n)), [p.logprobs or 0 for p in params], values[:n], ids[:n])]
        return drawn

    def keep_raw(self, rows: int) -> torch.Tensor:
        """The last decode step's first `rows` logits, copied aside before they are edited in place
        for the draws, for `draw` to score the raw ones (GraphSampling.keep_raw)."""
        assert self.sampling is not None and self.logits is not None
        return self.sampling.keep_raw(self.logits[:rows])

    def _replay(self, kind: str, size: int) -> torch.Tensor:
        self._last = (kind, size)
        graph = self.graphs.get((kind, size))
        if graph is not None:
            graph.replay()
            return self.outputs[kind, size]
        return self._forward(kind, size)

    @torch.inference_mode()
    def _forward(self, kind: str, size: int) -> torch.Tensor:
        """One forward over the buffers of `kind` ("decode", "mixed", each with "-lora") and size."""
        meta = self.metas[size] if kind.startswith("decode") else self.mixed_metas[size]
        view = meta.static
        assert view is not None
        if isinstance(view, (StaticDecodeView, StaticMixedView)):
            view.prepare()  # what the layers derive from the buffers, recorded into the graph
        lora = self.lora_maps.get((kind, size))
        if lora is not None:
            lora.refresh()  # the rows' masks from the slots buffer: recorded into the graph
        extra: dict[str, torch.Tensor] = {}
        if self.image_rows is not None and not kind.startswith("decode"):
            extra["inputs_embeds"] = self.image_rows.embeds(self.model.embed_tokens, view.input_ids)
        hidden: torch.Tensor = self.model(
            view.input_ids, view.positions, self.kv_caches, meta, lora_mapping=lora, **extra
        )
        if self.logits is not None and kind.startswith("decode") and size <= self.tail_rows:
            logits = self.logits[:size]
            logits.copy_(self.model.compute_logits(hidden))
            finite = rows_finite(logits)
            tokens = logits.argmax(dim=-1)
            self._tails[kind, size] = (finite, tokens, mark_unfinished(tokens, finite))
        return hidden

    def _allocate_logits(self) -> None:
        """The shared logits buffer of the decode sizes whose step computes its tail in the graph
        (TAIL_LOGITS_BYTES), its width the LM head's."""
        device = self.inputs.device
        probe = torch.zeros(1, self.model.config.hidden_size, dtype=self.model.dtype, device=device)
        vocab = self.model.compute_logits(probe).shape[-1]
        self.tail_rows = tail_rows(self.sizes, vocab)
        if self.tail_rows:
            self.logits = torch.zeros(self.tail_rows, vocab, dtype=torch.float32, device=device)
            self.sampling = GraphSampling(self.tail_rows, vocab, device, device.type == "cuda")

    # -- capture -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        """Record every size's forward, largest first, into one memory pool (the smaller graphs
        reuse the larger one's memory), after two eager runs of each (Triton compiles, the
        allocator settles). Buffers hold padding rows only: nothing real is written or read."""
        self.model.reserve_positions(max(self.max_model_len, self.max_context))
        if self.lora is not None:
            self.row_slots.fill_(-1)
        work = [("decode", s) for s in self.sizes]
        if self.mixed is not None:
            mixed = self.mixed
            if mixed.scan is not None:  # no request: every segment a padding one, writing the null block
                mixed.scan.states.zero_()
                mixed.scan.chain_len.zero_()
                mixed.scan.seg_blocks.fill_(self.null_block)
            work += [("mixed", s) for s in self.mixed_sizes]
        work += list(self.lora_maps)
        if self.mode != "capture":
            self._allocate_logits()
            for kind, size in work:
                self._pad(kind, size)
                self._forward(kind, size)
            return
        device = self.inputs.device
        start = time.perf_counter()
        torch.cuda.synchronize(device)
        free_before = torch.cuda.mem_get_info(device)[0]
        self._allocate_logits()  # counted with the graphs' memory
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        # the most rows first: a pool's later graphs fit in what the first one's freed
        for kind, size in sorted(work, key=lambda w: -w[1]):
            if kind in self.failed:
                continue
            try:
                self._pad(kind, size)
                graph, self.outputs[kind, size] = _captured(partial(self._forward, kind, size), pool, stream)
            except Exception as e:  # noqa: BLE001 (that kind of step runs eagerly, said once)
                self.refuse(kind, f"capturing its {size}-row graph raised {type(e).__name__}: {e}")
                continue
            self.graphs[kind, size] = graph
            mapping = self.lora_maps.get((kind, size))
            if mapping is not None:  # the replay remakes its masks first: their memory goes back to the pool
                mapping.masks = None
        self._capture_sampling(pool, stream)
        self._choose_one_row(pool, stream)
        torch.cuda.synchronize(device)
        self.graph_bytes = max(0, free_before - torch.cuda.mem_get_info(device)[0])
        self.capture_seconds = time.perf_counter() - start
        logger.info("CUDA graphs captured: %s", self.summary())

    def _capture_sampling(self, pool: _POOL_HANDLE, stream: torch.cuda.Stream) -> None:
        """The draws' graphs (graph_sampling.py) of each size computing its tail, both variants,
        largest first, into the decode graphs' pool: they run after them, never beside them."""
        sampling, logits = self.sampling, self.logits
        if sampling is None or logits is None or "decode" in self.failed:
            return
        for size in sorted((s for s in self.sizes if s <= self.tail_rows), reverse=True):
            rows = logits[:size]
            try:
                for sort in (True, False):
                    sampling.graphs[sort, size] = _captured(partial(sampling.record, rows, sort), pool, stream)[0]
                # the scores of what either variant drew (its buffer of tokens)
                sampling.score_graphs[size] = _captured(partial(sampling.record_scores, rows), pool, stream)[0]
            except Exception as e:  # noqa: BLE001 (sampled steps then draw eagerly, said once)
                self.refuse("sample", f"capturing its {size}-row draws' graphs raised {type(e).__name__}: {e}")
                return

    def _choose_one_row(self, pool: _POOL_HANDLE, stream: torch.cuda.Stream) -> None:
        """The batch-1 decode graph captured again with the model's one-row products
        (LlamaModel.one_row_products: norms and SiLU folded into the products after them), both
        replays timed on this card, the faster kept - the folded one's product is Triton's, not
        cuBLAS's, and which wins is the card's to say. Logged either way."""
        key = ("decode", 1)
        model = self.model
        unsupported = model.one_row_products_unsupported()
        if key not in self.graphs or unsupported is not None or not gpu_fused.runs_on(model.embed_tokens.weight):
            return
        plain = self.graphs[key], self.outputs[key], self._tails.get(key)
        model.one_row_products = True
        folded: torch.cuda.CUDAGraph | None
        try:
            self._pad("decode", 1)
            folded, self.outputs[key] = _captured(partial(self._forward, "decode", 1), pool, stream)
            runs: tuple[list[float], list[float]] = ([], [])
            for _ in range(3):  # alternated: a card's clock drifts
                runs[0].append(_replay_us(plain[0]))
                runs[1].append(_replay_us(folded))
            self.one_row_timing = min(runs[0]), min(runs[1])
        except Exception as e:  # noqa: BLE001 (the layer by layer step stays, said once)
            self.one_row_timing = None
            logger.warning("CUDA graphs: a one-row step with folded products could not be captured: %s", e)
            folded = None
        plain_us, folded_us = self.one_row_timing or (0.0, float("inf"))
        if folded is not None and folded_us < ONE_ROW_MARGIN * plain_us:
            self.graphs[key] = folded
        else:
            model.one_row_products = False
            self.graphs[key], self.outputs[key] = plain[0], plain[1]
            if plain[2] is not None:
                self._tails[key] = plain[2]
        if self.one_row_timing is not None:
            logger.info(
                "CUDA graphs: a batch-1 decode step replayed in %.1f us with its norms and SiLU folded into its "
                "products, %.1f us without: %s",
                folded_us, plain_us, "folded" if model.one_row_products else "not folded",
            )  # fmt: skip

    def _pad(self, kind: str, size: int) -> None:
        """A size's rows all padding before its capture (the sizes' headers overlap: each size's is
        written just before its own runs)."""
        if kind.startswith("decode"):
            view = self.metas[size].static
            assert isinstance(view, StaticDecodeView)
            view.pad(self.null_slot)
            for group_view in self.group_views.get(size, []):
                group_view.pad(self.null_slot)
            return
        mixed_view = self.mixed_metas[size].static
        assert isinstance(mixed_view, StaticMixedView)
        mixed_view.pad(self.null_slot)
        for mixed_group_view in self.mixed_group_views.get(size, []):
            mixed_group_view.slot_mapping.fill_(self.null_slot)

    def refuse(self, kind: str, why: str) -> None:
        """A kind of step ("decode", "mixed", each with "-lora"; "sample": the draws' graphs) that
        could not be captured, or whose replay disagreed with the eager step (graph_check.py), runs
        eagerly from now on (slower, the same outputs): its graphs dropped, the reason logged."""
        self.failed.add(kind)
        for key in [key for key in self.graphs if key[0] == kind]:
            del self.graphs[key], self.outputs[key]
        for key in [key for key in self._tails if key[0] == kind]:
            del self._tails[key]
        if kind == "sample" and self.sampling is not None:
            self.sampling.graphs.clear()
            self.sampling.score_graphs.clear()
        what = "sampled decode steps draw" if kind == "sample" else f"{kind} steps run"
        logger.warning("CUDA graphs: %s eagerly: %s", what, why)

    def limit_mixed(self, max_tokens: int) -> None:
        """Mixed steps of at most `max_tokens` tokens replay (0: none; mixed_graph_choice.py), the
        larger counts' graphs dropped."""
        self.mixed_sizes = [s for s in self.mixed_sizes if s <= max_tokens]
        for key in [key for key in self.graphs if key[0].startswith("mixed") and key[1] > max_tokens]:
            del self.graphs[key], self.outputs[key]
        self.mixed_metas = {s: meta for s, meta in self.mixed_metas.items() if s <= max_tokens}
        self.lora_maps = {key: m for key, m in self.lora_maps.items() if key[0] != "mixed-lora" or key[1] <= max_tokens}

    def takes_lora(self, kind: str) -> bool:
        """Whether a step of `kind` with adapters replays a graph."""
        return self.lora is not None and f"{kind}-lora" not in self.failed

    def summary(self) -> str:
        mixed = f", mixed steps of {_ranges(self.mixed_sizes)} tokens" if self.mixed_sizes else ""
        lora = ", each with and without LoRA" if self.lora_maps else ""
        return (
            f"decode batch sizes {_ranges(self.sizes)}{mixed}{lora} (contexts up to {self.max_context} tokens) in "
            f"{self.capture_seconds:.1f} s, {self.graph_bytes / MIB:.0f} MiB"
        )


def _captured(
    run: Callable[[], Any], pool: _POOL_HANDLE, stream: torch.cuda.Stream
) -> tuple[torch.cuda.CUDAGraph, Any]:
    """`run` twice on `stream` (Triton compiles, the allocator settles), then recorded into a graph
    of `pool`: the graph and what the recorded run returned."""
    device = stream.device
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            run()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = run()
    return graph, out


def _replay_us(graph: torch.cuda.CUDAGraph) -> float:
    """A graph's replay on its card, microseconds: the median of five runs of REPLAYS_TIMED, timed
    by events (after one untimed run)."""
    replays = REPLAYS_TIMED
    graph.replay()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(float(start.elapsed_time(end)) * 1e3 / replays)
    return sorted(times)[len(times) // 2]


def _ranges(sizes: list[int]) -> str:
    """1, 2, 4, 8..256 (step 8) rather than 35 numbers in a log line."""
    if len(sizes) <= 6:
        return ", ".join(map(str, sizes))
    return f"{', '.join(map(str, sizes[:3]))}, {sizes[3]}..{sizes[-1]} ({len(sizes)} sizes)"
