"""Paged attention over a block-structured KV cache.

Per layer the cache is one tensor ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
(index 0 = keys, 1 = values). A token's *slot* is ``block_id * block_size + offset``.

Every layer first writes the step's new K/V into the cache through ``slot_mapping`` and
then reads each sequence's whole context through its block table, so a sequence can
attend to blocks that another sequence of the same batch has just written, and a
prefill that follows a prefix-cache hit only computes its new tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from .attention_path import triton_kernels, uses_triton
from .explicit_attention import ExplicitPlan, explicit_attention
from .host_copy import tensor_on
from .kernels import gpu_fused, ops

if TYPE_CHECKING:
    from .static_decode import StaticDecodeView
    from .static_mixed import StaticMixedView


def kv_cache_block_shape(
    block_size: int, num_kv_heads: int, head_dim: int, value_is_key: bool = False
) -> tuple[tuple[int, ...], int]:
    """The layout `paged_attention` reads: a layer's cache is ``[2, num_blocks, block_size,
    num_kv_heads, head_dim]``, keys then values; where each token's value is its key
    (`value_is_key`: multi-head latent attention, model/deepseek.py) ``[1, ...]``, which the layer
    hands over as that one tensor seen twice (`expand`). Returns the shape without the block axis,
    and where that axis goes (the engine's per-block tensor registry sizes and allocates the
    caches)."""
    return (1 if value_is_key else 2, block_size, num_kv_heads, head_dim), 1


@dataclass
class AttentionMetadata:
    """What one forward step needs to know about the batch layout.

    slot_mapping:    LongTensor [T], cache slot of every new token of this step.
    query_start_loc: B+1 ints; new tokens of sequence i are rows qsl[i]:qsl[i+1].
    seq_lens:        B ints; total context of sequence i after this step (cached + new).
    block_tables:    LongTensor [B, max_blocks], padded (padding is never read).
    group_tables:    a hybrid model's KV-cache groups after the first, (slot_mapping,
                     block_tables) each, and `layer_groups` each layer's group (0: the fields
                     above); `for_layer` gives a layer its group's view.
    host_block_tables: the same tables on the host, when `block_tables` is on a GPU (optional).
    static:          a step over fixed buffers (what a CUDA graph captures): every row one
                     decode (static_decode.py) or any mix (static_mixed.py); attention reads
                     the view's tensors only (`static_meta`: each row its own sequence here,
                     its `seq_lens` an upper bound, its block tables the view's).
    output_rows:     the rows whose final hidden states the step reads, each the last of its
                     sequence (None: every row). A model whose later layers write no K/V (Gemma
                     4's KV-shared layers) runs them for these rows alone and returns their
                     hidden states alone, in this order; any other model returns every row's.

    Build a new object per step: index tensors derived from it are computed once (on the
    first layer) and reused by all layers, so do not mutate it after the first forward.
    """

    slot_mapping: torch.Tensor
    query_start_loc: list[int]
    seq_lens: list[int]
    block_tables: torch.Tensor
    group_tables: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    layer_groups: list[int] | None = None
    static: StaticDecodeView | StaticMixedView | None = None
    # `block_tables` on the host too, where they live on a GPU: the cascade is decided from them
    # without waiting for the device
    host_block_tables: torch.Tensor | None = None
    output_rows: list[int] | None = None
    # built once per step for each (block size, device, window, dtype) the layers ask for: layers
    # with and without a window alternate in one forward (Gemma), each kind keeps its own plan
    _plans: dict[tuple[Any, ...], Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        qsl = [int(x) for x in self.query_start_loc]
        self.query_start_loc = qsl
        self.seq_lens = [int(x) for x in self.seq_lens]
        B = len(self.seq_lens)
        if len(qsl) != B + 1 or qsl[0] != 0:
            raise ValueError("query_start_loc must have length len(seq_lens)+1 and start at 0")
        for i in range(B):
            n = qsl[i + 1] - qsl[i]
            if n < 0 or n > self.seq_lens[i]:
                raise ValueError(f"sequence {i}: {n} new tokens but seq_len {self.seq_lens[i]}")
        if self.slot_mapping.numel() != qsl[-1]:
            raise ValueError(f"slot_mapping has {self.slot_mapping.numel()} entries, expected {qsl[-1]}")
        if self.block_tables.dim() != 2 or self.block_tables.shape[0] != B:
            raise ValueError(f"block_tables must be [B={B}, max_blocks], got {tuple(self.block_tables.shape)}")

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]

    def for_layer(self, layer: int) -> AttentionMetadata:
        """What layer `layer` reads and writes: its KV-cache group's slots and block tables (this
        object itself without groups, and for group 0)."""
        groups = self.layer_groups
        if groups is None or not groups[layer]:
            return self
        key = ("group", groups[layer])
        view = self._plans.get(key)
        if view is None:
            slots, tables = self.group_tables[groups[layer] - 1]
            view = self._plans[key] = AttentionMetadata(slots, self.query_start_loc, self.seq_lens, tables)
        return view

    def of_output_rows(self) -> AttentionMetadata:
        """The step as `output_rows` alone see it: one query a sequence that has one (its last
        position) over the same context, writing nothing (what layers that read K/V written by
        earlier layers of the step attend with)."""
        rows = self.output_rows
        if rows is None or self.layer_groups is not None or self.static is not None:
            raise ValueError("a step's output rows alone: set output_rows, without KV-cache groups or fixed buffers")
        last_row = {end - 1: i for i, end in enumerate(self.query_start_loc[1:]) if end > self.query_start_loc[i]}
        if any(r not in last_row for r in rows):
            raise ValueError(f"output_rows {rows} are not each the last row of a sequence")
        seqs = [last_row[r] for r in rows]
        picked = torch.tensor(seqs, dtype=torch.long, device=self.block_tables.device)
        host = self.host_block_tables
        return AttentionMetadata(
            self.slot_mapping[torch.tensor(rows, dtype=torch.long, device=self.slot_mapping.device)],
            list(range(len(rows) + 1)),
            [self.seq_lens[i] for i in seqs],
            self.block_tables[picked],
            host_block_tables=None if host is None else host[torch.tensor(seqs, dtype=torch.long)],
        )

    def set_layer_group(self, group: int, meta: AttentionMetadata) -> None:
        """What `for_layer` gives group `group`'s layers (a step over fixed buffers: the group's
        own static metadata)."""
        self._plans[("group", group)] = meta

    # ------------------------------------------------------------------
    def plan(
        self, block_size: int, device: torch.device, window: int | None = None, dtype: torch.dtype = torch.float32
    ) -> _Plan:
        """Index tensors shared by all layers of one step (built once per step and kind of layer)."""
        key = ("paged", block_size, device, window, dtype)
        p = self._plans.get(key)
        if p is None:
            p = self._plans[key] = _Plan(self, block_size, device, window, dtype)
        return p

    def explicit_plan(self, block_size: int, device: torch.device, window: int | None) -> ExplicitPlan:
        """What the explicit-softmax layers read (built once per step and window)."""
        key = ("explicit", block_size, device, window)
        p = self._plans.get(key)
        if p is None:
            p = self._plans[key] = ExplicitPlan(
                self.query_start_loc, self.seq_lens, self.block_tables, block_size, device, window
            )
        return p

    def whole_contexts(self, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every sequence of the step with new tokens, for the native prefill kernel over its
        whole context: (seqs [S, 4] int64 - first row, new tokens, keys, where its slots start -
        and the cache slot of each of its positions), built once per step."""
        key = ("whole", block_size)
        batch = self._plans.get(key)
        if batch is None:
            tables = self.block_tables.to(device="cpu", dtype=torch.long)
            rows, slots, at = [], [], 0
            for i, s in enumerate(self.seq_lens):
                a, b = self.query_start_loc[i], self.query_start_loc[i + 1]
                if b == a:
                    continue
                pos = torch.arange(s)
                slots.append(tables[i, pos // block_size] * block_size + pos % block_size)
                rows.append([a, b - a, s, at])
                at += s
            seqs = torch.tensor(rows, dtype=torch.int64).reshape(-1, 4)
            flat = torch.cat(slots) if slots else torch.zeros(0, dtype=torch.int64)
            batch = self._plans[key] = (seqs, flat.contiguous())
        return batch


class _Plan:
    def __init__(
        self,
        meta: AttentionMetadata,
        block_size: int,
        device: torch.device,
        window: int | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        qsl, seq_lens = meta.query_start_loc, meta.seq_lens
        # A sliding window only changes anything for sequences longer than it.
        self.window = window if window is not None and max(seq_lens, default=0) > window else None
        W = self.window
        bt = meta.block_tables.to(device=device, dtype=torch.long)
        needed_blocks = [(s + block_size - 1) // block_size for s in seq_lens]
        if needed_blocks and max(needed_blocks) > bt.shape[1]:
            raise ValueError(f"block_tables has {bt.shape[1]} columns but a sequence needs {max(needed_blocks)} blocks")
        self.slot_mapping = meta.slot_mapping.to(device=device, dtype=torch.long)
        # Triton's kernels read chunks' and decodes' context through the block tables in place
        self.triton = uses_triton(device)
        bt32 = meta.block_tables.to(device=device, dtype=torch.int32) if self.triton else None
        self.scratch: dict[tuple[Any, ...], Any] = {}  # buffers the step's layers share (Triton's)
        # (start, end, mask): prefill without cached context; mask None = plain causal
        self.fresh: list[tuple[int, int, torch.Tensor | _Band | None]] = []
        others: list[int] = []  # sequences that read cached context: chunked prefills and decodes
        for i, s in enumerate(seq_lens):
            a, b = qsl[i], qsl[i + 1]
            n = b - a
            if n == 0:
                continue
            if n == s and n > 1:
                mask: torch.Tensor | _Band | None = None
                if W is not None and n > _Band.MIN_WINDOWS * W:
                    mask = _Band(n, W, device)  # each query against its own window only
                elif W is not None and n > W:
                    qpos = torch.arange(n, device=device)
                    diff = qpos[:, None] - qpos[None, :]
                    mask = (diff >= 0) & (diff < W)
                self.fresh.append((a, b, mask))
            else:
                others.append(i)
        # Cascade: when several such sequences share leading blocks (a system prompt, a document,
        # n > 1 samples), their queries attend to that prefix together - one gather, one matmul -
        # and each attends alone only to the rest; the two parts merge by log-sum-exp. Not with
        # a sliding window in play: the shared prefix would not be the same for every query.
        # Not on a CPU with the native decode kernel when every such sequence decodes: reading each
        # whole context in place was faster than the cascade's gather, SDPA and merge at every
        # batch measured (32 and 64 sequences on a 480-token prefix, bfloat16: 52 / 90 ms a step
        # against 64 / 110; docs/benchmarks.md).
        in_place = (
            not self.triton
            and device.type == "cpu"
            and all(qsl[i + 1] - qsl[i] == 1 for i in others)
            and ops.decode_attention_available(dtype)
        )
        host_bt = meta.host_block_tables if meta.host_block_tables is not None else bt
        P = 0 if W is not None or in_place else self._common_prefix_tokens(others, qsl, seq_lens, host_bt, block_size)
        self.prefix_slots: torch.Tensor | None = None
        self.prefix_tokens = P
        if P:
            pos = torch.arange(P, device=device)
            self.prefix_slots = bt[others[0], pos // block_size] * block_size + pos % block_size
        self.chunked: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []  # (start, end, slots, mask)
        chunk_specs: list[tuple[int, int, int, int, int]] = []  # (start, end, sequence length, first key, sequence)
        decode: list[int] = []
        for i in others:
            a, b = qsl[i], qsl[i + 1]
            s, n = seq_lens[i], b - a
            if n == 1:
                decode.append(i)
                continue
            # keys from the first one any query of the chunk can see (P, or the window's start)
            lo = P if W is None else max(0, s - n - W + 1)
            chunk_specs.append((a, b, s, lo, i))
        self.chunk_ranges = [(a, b) for a, b, *_ in chunk_specs]
        # Where no native kernel takes the chunks (CUDA; a CPU without the kernels) they go through
        # one padded attention a layer, not one each: on a GPU every chunk's gather and attention
        # are launches of the host's time, and a step of requests behind a cached prefix has many.
        self.chunk_batch: _ChunkBatch | None = None
        self.triton_chunks: _TritonChunks | None = None
        if chunk_specs and bt32 is not None:
            self.triton_chunks = _TritonChunks(chunk_specs, bt32, device)
        elif chunk_specs and (device.type != "cpu" or not ops.prefill_max_new_tokens(dtype)):
            self.chunk_batch = _ChunkBatch.of(chunk_specs, bt, block_size, W, device)
        if self.chunk_batch is None and self.triton_chunks is None:
            for a, b, s, lo, i in chunk_specs:
                pos = torch.arange(lo, s, device=device)
                slots = bt[i, pos // block_size] * block_size + pos % block_size
                qpos = torch.arange(s - (b - a), s, device=device)
                mask = pos[None, :] <= qpos[:, None]  # [n, s - lo]
                if W is not None:
                    mask &= qpos[:, None] - pos[None, :] < W
                self.chunked.append((a, b, slots, mask))
        # Decode group: one new token each, batched into a single padded attention.
        self.decode_rows: torch.Tensor | None = None
        self.decode_all = False
        self.decode_mask = None
        self.decode_tables: torch.Tensor | None = None  # Triton's: block tables and lengths, int32
        if decode and bt32 is not None:
            self.decode_tables = bt32[decode]
            self.decode_seq_lens = tensor_on([seq_lens[i] for i in decode], device, torch.int32)
            self.decode_all = len(decode) == meta.num_tokens
            self.decode_rows = tensor_on([qsl[i] for i in decode], device, torch.long)
        elif decode:
            # each decode reads its keys from `starts` on: P, or where its window begins
            starts_list = [P] * len(decode) if W is None else [max(0, seq_lens[i] - W) for i in decode]
            lens_list = [seq_lens[i] - lo for i, lo in zip(decode, starts_list)]
            lens = tensor_on(lens_list, device, torch.long)
            L = max(lens_list)
            if W is None:
                pos = torch.arange(L, device=device) + P
                rows = bt[decode][:, pos // block_size]  # [Bd, L]
            else:  # per-row starts; positions past a row's end are clamped (and masked below)
                pos = torch.arange(L, device=device)[None, :] + tensor_on(starts_list, device, torch.long)[:, None]
                pos = torch.minimum(pos, tensor_on([seq_lens[i] - 1 for i in decode], device, torch.long)[:, None])
                rows = bt[decode].gather(1, pos // block_size)
            self.decode_slots = rows * block_size + pos % block_size
            if min(lens_list) != L or P:
                offs = torch.arange(L, device=device)
                self.decode_mask = (offs[None, :] < lens[:, None]).view(len(decode), 1, 1, L)
                # padded slots point at valid memory; they are masked out
                self.decode_slots = torch.where(
                    self.decode_mask.view(len(decode), L), self.decode_slots, self.decode_slots[:, :1]
                )
            self.decode_all = len(decode) == meta.num_tokens
            self.decode_rows = tensor_on([qsl[i] for i in decode], device, torch.long)
            self.decode_lens = lens  # valid positions of each row of decode_slots
        if P:
            chunk_rows = [r for a, b in self.chunk_ranges for r in range(a, b)]
            self.group_rows = tensor_on([qsl[i] for i in decode] + chunk_rows, device, torch.long)
        # The native prefill kernel (CPU, no window): which prompts and chunks it takes, described
        # once for all layers. Long bfloat16 prompts stay with PyTorch's flash kernel, faster there
        # (bf16_kernel_max_new_tokens).
        self.fresh_kernel: _KernelBatch | None = None
        self.chunked_kernel: _KernelBatch | None = None
        self.fresh_rest, self.chunked_rest = self.fresh, self.chunked
        if device.type == "cpu" and W is None:
            self.fresh_kernel, self.fresh_rest = _KernelBatch.of(
                [(a, b, b - a, self.slot_mapping[a:b], entry) for entry in self.fresh for a, b in [entry[:2]]], dtype
            )
            self.chunked_kernel, self.chunked_rest = _KernelBatch.of(
                [(a, b, slots.numel(), slots, entry) for entry in self.chunked for a, b, slots in [entry[:3]]], dtype
            )

    @staticmethod
    def _common_prefix_tokens(
        others: list[int], qsl: list[int], seq_lens: list[int], bt: torch.Tensor, block_size: int
    ) -> int:
        """Tokens in the leading blocks that every sequence of `others` holds and none of them
        computes in this step; 0 when a cascade would not pay."""
        if len(others) < 2:
            return 0
        first_new = min(seq_lens[i] - (qsl[i + 1] - qsl[i]) for i in others)
        limit = first_new // block_size
        if limit * block_size < CASCADE_MIN_TOKENS:
            return 0
        tables = bt[others, :limit]
        same = (tables == tables[:1]).all(dim=0).tolist()
        common = same.index(False) if False in same else limit
        return common * block_size if common * block_size >= CASCADE_MIN_TOKENS else 0


CASCADE_MIN_TOKENS = 64


class _Band:
    """A sliding-window prefill as one batched attention over windows: the prompt's queries in
    chunks of `window` rows, each chunk against the window + chunk - 1 keys it can see, rather
    than every query against every key under an n x n mask (n x 2W work and memory, not n x n)."""

    MIN_WINDOWS = 2  # below this many windows of prompt the plain masked attention is as cheap

    def __init__(self, n: int, window: int, device: torch.device) -> None:
        C, L = window, 2 * window - 1
        self.n, self.chunk = n, C
        self.num_chunks = -(-n // C)
        first = torch.arange(self.num_chunks, device=device) * C - (window - 1)  # each chunk's first key
        pos = first[:, None] + torch.arange(L, device=device)[None, :]  # [chunks, L] key positions
        valid = (pos >= 0) & (pos < n)
        self.keys = pos.clamp(0, n - 1)
        i = torch.arange(C, device=device)[:, None]
        j = torch.arange(L, device=device)[None, :]
        # query i of a chunk sits at key column i + window - 1: it sees columns i .. i + window - 1
        band = (j >= i) & (j <= i + window - 1)
        self.mask = (band[None] & valid[:, None, :])[:, None]  # [chunks, 1, C, L]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, gqa: bool) -> torch.Tensor:
        """q [n, Hq, D], k / v [n, Hkv, D] -> [n, Hq, D]."""
        n, C, nc = self.n, self.chunk, self.num_chunks
        qp = q.new_zeros(nc * C, *q.shape[1:])
        qp[:n] = q
        qc = qp.view(nc, C, *q.shape[1:]).transpose(1, 2)  # [chunks, Hq, C, D]
        kc = k[self.keys].transpose(1, 2)  # [chunks, Hkv, L, D]
        vc = v[self.keys].transpose(1, 2)
        o = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=self.mask, scale=scale, enable_gqa=gqa)
        return o.transpose(1, 2).reshape(nc * C, *q.shape[1:])[:n]


class _KernelBatch:
    """Sequences for one call of the native prefill kernel: seqs [S, 4] (first row, new tokens,
    keys read, first slot) and their slots, one run per sequence."""

    def __init__(self, seqs: torch.Tensor, slots: torch.Tensor) -> None:
        self.seqs, self.slots = seqs, slots

    @staticmethod
    def of(
        candidates: list[tuple[int, int, int, torch.Tensor, Any]], dtype: torch.dtype
    ) -> tuple[_KernelBatch | None, list[Any]]:
        """(start, end, keys read, their slots, plan entry) -> the kernel's batch and the entries
        left to the PyTorch path."""
        limit = ops.prefill_max_new_tokens(dtype)
        rows: list[list[int]] = []
        runs: list[torch.Tensor] = []
        rest: list[Any] = []
        offset = 0
        for a, b, keys, slots, entry in candidates:
            if b - a > limit:
                rest.append(entry)
                continue
            rows.append([a, b - a, keys, offset])
            runs.append(slots)
            offset += keys
        if not rows:
            return None, rest
        return _KernelBatch(torch.tensor(rows, dtype=torch.long), torch.cat(runs)), rest


class _TritonChunks:
    """Chunks after cached context for Triton's prefill kernel, which reads each context through
    its block table in place: rows q_start .. + q_len of the step, seq_lens keys, int32 each."""

    def __init__(self, specs: list[tuple[int, int, int, int, int]], bt32: torch.Tensor, device: torch.device) -> None:
        starts, ends, lengths, _, seqs = zip(*specs)
        news = [b - a for a, b in zip(starts, ends)]
        self.q_start = tensor_on(starts, device, torch.int32)
        self.q_len = tensor_on(news, device, torch.int32)
        self.seq_lens = tensor_on(lengths, device, torch.int32)
        self.tables = bt32[list(seqs)]
        self.max_new = max(news)
        self.specs = specs
        self._out_rows: torch.Tensor | None = None

    def out_rows(self, device: torch.device) -> torch.Tensor:
        """The chunks' rows of the step, in chunk order (the cascade's order); built by the first
        layer that merges them."""
        if self._out_rows is None:
            self._out_rows = tensor_on([r for a, b, *_ in self.specs for r in range(a, b)], device, torch.long)
        return self._out_rows

    def attend(
        self,
        q: torch.Tensor,
        k_flat: torch.Tensor,
        v_flat: torch.Tensor,
        plan: _Plan,
        scale: float,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
    ) -> None:
        """Writes the chunks' rows of `out` (and of `lse`): keys from the cascade's prefix end on."""
        k_cache, v_cache = _blocks(k_flat, plan), _blocks(v_flat, plan)
        triton_kernels().paged_prefill(
            q, k_cache, v_cache, self.tables, self.q_start, self.q_len, self.seq_lens, self.max_new, scale, out,
            window=plan.window, start=plan.prefix_tokens, lse=lse,
        )  # fmt: skip


def _blocks(flat: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """A layer's [num_slots, Hkv, D] keys or values as the [num_blocks, block_size, Hkv, D] blocks
    Triton's kernels read."""
    return flat.view(-1, plan.block_size, *flat.shape[1:])


def _triton_decode(
    q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, plan: _Plan, scale: float, lse: torch.Tensor | None
) -> torch.Tensor:
    """The decode rows' attention by Triton's kernel, each context read in place; a split context's
    workspace allocated by the step's first layer and reused by the others."""
    tables = plan.decode_tables
    assert tables is not None
    kernels = triton_kernels()
    qd = q if plan.decode_all else q[plan.decode_rows]
    Bd, Hq, D = qd.shape
    key = ("triton decode", Hq, D)
    if key not in plan.scratch:
        splits = kernels.decode_splits(Bd, k_flat.shape[1], tables.shape[1] * plan.block_size, q.device)
        plan.scratch[key] = (splits, kernels.decode_workspace(Bd, Hq, D, splits, q.device) if splits > 1 else None)
    splits, workspace = plan.scratch[key]
    return kernels.paged_decode(
        qd, _blocks(k_flat, plan), _blocks(v_flat, plan), tables, plan.decode_seq_lens, scale,
        window=plan.window, start=plan.prefix_tokens, lse=lse, num_splits=splits, workspace=workspace,
    )  # fmt: skip


class _ChunkBatch:
    """Chunks after cached context padded into one attention: queries `rows` [C, M] (indices into
    the step's rows; padding repeats a chunk's first), keys `slots` [C, L] (padding repeats a valid
    slot), `mask` [C, 1, M, L] (causal, window, padding), and where the real rows' results go:
    `picked` (indices into the flattened [C * M]) to `out_rows` (the step's rows)."""

    # Padding may at most double the attention's work (scores computed), or cost at most
    # SMALL_PADDED_WORK scores a head in all (a few short chunks: the launches saved weigh more);
    # past both the chunks run one by one.
    MAX_PADDED_WORK = 2.0
    SMALL_PADDED_WORK = 1 << 20

    def __init__(
        self, rows: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor, picked: torch.Tensor, out_rows: torch.Tensor
    ) -> None:
        self.rows, self.slots, self.mask, self.picked, self.out_rows = rows, slots, mask, picked, out_rows

    @staticmethod
    def of(
        specs: list[tuple[int, int, int, int, int]],
        bt: torch.Tensor,
        block_size: int,
        window: int | None,
        device: torch.device,
    ) -> _ChunkBatch | None:
        """(start, end, sequence length, first key, sequence) per chunk -> the batch, or None where
        padding to the longest chunk and context would cost too much (see SMALL_PADDED_WORK)."""
        news = [b - a for a, b, *_ in specs]
        keys = [s - lo for _, _, s, lo, _ in specs]
        C, M, L = len(specs), max(news), max(keys)
        padded = C * M * L
        if padded > _ChunkBatch.SMALL_PADDED_WORK and padded > _ChunkBatch.MAX_PADDED_WORK * sum(
            n * k for n, k in zip(news, keys)
        ):
            return None
        start, end, length, first, seq = (tensor_on(col, device) for col in zip(*specs))
        new = end - start
        m = torch.arange(M, device=device)[None, :]
        j = torch.arange(L, device=device)[None, :]
        qpos = (length - new)[:, None] + m  # [C, M]
        kpos = first[:, None] + j  # [C, L]
        q_real = m < new[:, None]
        k_real = j < (length - first)[:, None]
        mask = (kpos[:, None, :] <= qpos[:, :, None]) & q_real[:, :, None] & k_real[:, None, :]
        if window is not None:
            mask &= qpos[:, :, None] - kpos[:, None, :] < window
        kpos = torch.minimum(kpos, (length - 1)[:, None])  # padding reads the last real key (masked)
        slots = bt[seq].gather(1, kpos // block_size) * block_size + kpos % block_size
        rows = torch.where(q_real, start[:, None] + m, start[:, None])
        picked = tensor_on([c * M + r for c, n in enumerate(news) for r in range(n)], device, torch.long)
        out_rows = tensor_on([r for a, b, *_ in specs for r in range(a, b)], device, torch.long)
        return _ChunkBatch(rows, slots, mask[:, None], picked, out_rows)

    def _gathered(
        self, q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The padded queries [C, Hq, M, D] and their keys and values [C, Hkv, L, D]."""
        qb = q[self.rows].permute(0, 2, 1, 3)
        kc = _gather(k_flat, self.slots).permute(0, 2, 1, 3).to(q.dtype)
        vc = _gather(v_flat, self.slots).permute(0, 2, 1, 3).to(q.dtype)
        return qb, kc, vc

    def _real_rows(self, x: torch.Tensor) -> torch.Tensor:
        """[C, H, M, ...] per padded query -> [R, H, ...] for the real rows, in `out_rows` order."""
        C, H, M = x.shape[:3]
        return x.transpose(1, 2).reshape(C * M, H, *x.shape[3:]).index_select(0, self.picked)

    def attend(self, q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, scale: float) -> torch.Tensor:
        """The real rows' outputs [R, Hq, D] in `out_rows` order."""
        qb, kc, vc = self._gathered(q, k_flat, v_flat)
        gqa = qb.shape[1] != kc.shape[1]
        return self._real_rows(
            F.scaled_dot_product_attention(qb, kc, vc, attn_mask=self.mask, scale=scale, enable_gqa=gqa)
        )

    def attend_with_lse(
        self, q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The real rows' outputs [R, Hq, D] and log-sum-exp [R, Hq] (float32), for the cascade's
        merge: the explicit softmax, GQA by broadcasting each KV head over its G query heads."""
        qb, kc, vc = self._gathered(q, k_flat, v_flat)
        C, Hq, M, D = qb.shape
        Hkv, L = kc.shape[1], kc.shape[2]
        q5 = qb.reshape(C, Hkv, Hq // Hkv, M, D)
        scores = torch.matmul(q5, kc[:, :, None].transpose(-1, -2)).float() * scale  # [C, Hkv, G, M, L]
        scores = scores.masked_fill(~self.mask.view(C, 1, 1, M, L), float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        o = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)).to(q.dtype), vc[:, :, None])  # [C, Hkv, G, M, D]
        return self._real_rows(o.reshape(C, Hq, M, D)), self._real_rows(lse.reshape(C, Hq, M))


def _sdpa_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention that also returns its log-sum-exp (float32), for merging partial results.
    q [B, H, M, D], k, v [B, H, L, D], mask broadcastable to [B, H, M, L] (True = visible).
    On CPU this is PyTorch's fused flash kernel; elsewhere the explicit softmax."""
    B, H, M, _ = q.shape
    L = k.shape[2]
    if q.device.type == "cpu":
        add = None
        if mask is not None:
            add = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
            add = add.expand(B, H, M, L)
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=add, scale=scale
        )
        return o, lse.float()
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse.unsqueeze(-1)).to(q.dtype), v), lse


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [M, Hq, D] against k, v [L, Hkv, D] (mask [M, L]); returns o [M, Hq, D], lse [M, Hq]."""
    M, Hq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    # GQA without expanding K/V: the G query heads sharing a KV head become G x M query rows.
    qh = q.view(M, Hkv, G, D).permute(1, 0, 2, 3).reshape(1, Hkv, M * G, D)
    if mask is not None:
        mask = mask[:, None, :].expand(M, G, mask.shape[1]).reshape(1, 1, M * G, mask.shape[1])
    o, lse = _sdpa_lse(qh, k.permute(1, 0, 2)[None].to(q.dtype), v.permute(1, 0, 2)[None].to(q.dtype), mask, scale)
    o = o.view(Hkv, M, G, D).permute(1, 0, 2, 3).reshape(M, Hq, D)
    return o, lse.view(Hkv, M, G).permute(1, 0, 2).reshape(M, Hq)


def _attend_batched(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One query per sequence: q [B, Hq, D] against k, v [B, Hkv, L, D] (mask [B, 1, 1, L])."""
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    o, lse = _sdpa_lse(q.view(B, Hkv, Hq // Hkv, D), k.to(q.dtype), v.to(q.dtype), mask, scale)
    return o.reshape(B, Hq, D), lse.reshape(B, Hq)


def _merge(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor) -> torch.Tensor:
    lse = torch.logaddexp(lse1, lse2)
    return o1 * torch.exp(lse1 - lse).unsqueeze(-1).to(o1.dtype) + o2 * torch.exp(lse2 - lse).unsqueeze(-1).to(o2.dtype)


def _gather(flat: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """flat[slots] for a [num_slots, Hkv, D] cache and slots of any shape: index_select on the
    flattened slots copies the same rows as advanced indexing, 1.8-5x faster on CPU for the K/V a
    decode step gathers (docs/benchmarks.md)."""
    return flat.index_select(0, slots.reshape(-1)).view(*slots.shape, *flat.shape[1:])


def rotate_and_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    window: int | None = None,
    qk_norms: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> bool:
    """Where a GPU's fused kernels run: q and k rotated in place (layers.RotaryEmbedding's tables
    `cos`, `sin`) and this step's k, v written to ``kv_cache`` at the step's slots, in one kernel
    instead of three (the rotation, then two index copies); the caller then passes
    ``kv_written=True`` to `paged_attention`. `qk_norms` (q's norm weight, k's, eps): q and k
    RMS-normed first, in the same kernel. False elsewhere, with nothing done. Not for
    soft-capped layers (their write is their own). The step's plan it reads its slots from is the
    one `paged_attention` builds anyway (the same key), so asking where the kernel cannot run costs
    nothing more; the caller asks `gpu_fused.runs_on` first where preparing `qk_norms` would."""
    if not q.shape[0]:
        return False
    Hkv, D = k.shape[1], k.shape[2]
    if meta.static is not None:
        slots = meta.static.slot_mapping
    else:
        slots = meta.plan(kv_cache.shape[2], q.device, window, q.dtype).slot_mapping
    k_flat, v_flat = kv_cache[0].view(-1, Hkv, D), kv_cache[1].view(-1, Hkv, D)
    return gpu_fused.rotary_write_kv_(q, k, v, cos, sin, k_flat, v_flat, slots, qk_norms)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    kv_written: bool = False,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D] (new tokens, already rotated).

    Writes k/v into ``kv_cache`` at ``meta.slot_mapping`` (unless `kv_written`: done already, by
    `rotate_and_write_kv`) and returns attention output
    [T, Hq, D] with causal masking over each sequence's full (cached + new) context - or, with
    a sliding `window`, over its last `window` positions up to each query (Mistral's rule).
    With `softcap`, the scores are soft-capped first (Gemma 2); with `sinks` [Hq], each head's
    sink logit joins the softmax (gpt-oss): both by chunks of queries in PyTorch
    (explicit_attention.py; a static step's soft cap by Triton's kernels).
    """
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    block_size = kv_cache.shape[2]
    if meta.static is not None:  # Triton's kernels over the buffers (a soft cap theirs too)
        if sinks is not None:
            raise ValueError("attention sinks have no static step (the model refuses one)")
        scale = D**-0.5 if scale is None else scale
        return _static_step(q, k, v, kv_cache, meta.static, scale, window, kv_written, softcap)
    if softcap is not None or sinks is not None:
        if kv_written:
            raise ValueError("an explicit-softmax layer writes its own K/V")
        k_flat = kv_cache[0].view(-1, Hkv, D)
        v_flat = kv_cache[1].view(-1, Hkv, D)
        slots = meta.slot_mapping.to(device=q.device, dtype=torch.long)
        if T:
            k_flat.index_copy_(0, slots, k.to(kv_cache.dtype))
            v_flat.index_copy_(0, slots, v.to(kv_cache.dtype))
        scale = D**-0.5 if scale is None else scale
        # the native prefill kernel where some sequence brings more than one token (a decode-only
        # step ran 1.7-2.6x faster on the explicit softmax: the kernel is built for query tiles)
        if sinks is not None and softcap is None and window is None and T > len(meta.seq_lens):
            out = _with_sinks_natively(q, k_flat, v_flat, meta, block_size, scale, sinks)
            if out is not None:
                return out
        plan_explicit = meta.explicit_plan(block_size, q.device, window)
        return explicit_attention(q, k, v, k_flat, v_flat, plan_explicit, scale, softcap, sinks)
    plan = meta.plan(block_size, q.device, window, q.dtype)
    k_flat = kv_cache[0].view(-1, Hkv, D)
    v_flat = kv_cache[1].view(-1, Hkv, D)
    # 1) write this step's K/V
    if T and not kv_written and not ops.write_kv(k, v, k_flat, v_flat, plan.slot_mapping):
        k_flat.index_copy_(0, plan.slot_mapping, k.to(kv_cache.dtype))
        v_flat.index_copy_(0, plan.slot_mapping, v.to(kv_cache.dtype))
    gqa = Hq != Hkv
    if scale is None:
        scale = D**-0.5
    if plan.decode_all:  # one query per sequence: no output buffer to fill row by row
        if plan.prefix_slots is not None:
            return _cascade(q, k_flat, v_flat, plan, plan.prefix_slots, None, scale)
        return _decode(q, k_flat, v_flat, plan, scale)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)

    # 2a) prefills without cached context: on CPU the native kernel (reading the just-written
    # cache in place); else SDPA over the local K/V (the same values)
    fresh = plan.fresh_rest
    if plan.fresh_kernel is not None:
        batch = plan.fresh_kernel
        if not ops.prefill_attention(q, k_flat, v_flat, batch.seqs, batch.slots, scale, out):
            fresh = plan.fresh
    for a, b, mask in fresh:
        if isinstance(mask, _Band):
            out[a:b] = mask.attend(q[a:b], k[a:b], v[a:b], scale, gqa)
            continue
        o = F.scaled_dot_product_attention(
            q[a:b].transpose(0, 1).unsqueeze(0),
            k[a:b].transpose(0, 1).unsqueeze(0),
            v[a:b].transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=gqa,
        )
        out[a:b] = o[0].transpose(0, 1)

    if plan.prefix_slots is not None:
        return _cascade(q, k_flat, v_flat, plan, plan.prefix_slots, out, scale)

    # 2b) chunks after cached context: the native kernel reads the context in place on CPU; else
    # gather it through the block table
    chunked = plan.chunked_rest
    if plan.chunked_kernel is not None:
        batch = plan.chunked_kernel
        if not ops.prefill_attention(q, k_flat, v_flat, batch.seqs, batch.slots, scale, out):
            chunked = plan.chunked
    if plan.chunk_batch is not None:
        out[plan.chunk_batch.out_rows] = plan.chunk_batch.attend(q, k_flat, v_flat, scale)
    if plan.triton_chunks is not None:
        plan.triton_chunks.attend(q, k_flat, v_flat, plan, scale, out)
    for a, b, slots, mask in chunked:
        kc = _gather(k_flat, slots).transpose(0, 1).unsqueeze(0).to(q.dtype)
        vc = _gather(v_flat, slots).transpose(0, 1).unsqueeze(0).to(q.dtype)
        o = F.scaled_dot_product_attention(
            q[a:b].transpose(0, 1).unsqueeze(0), kc, vc, attn_mask=mask, scale=scale, enable_gqa=gqa
        )
        out[a:b] = o[0].transpose(0, 1)

    if plan.decode_rows is not None:
        out[plan.decode_rows] = _decode(q, k_flat, v_flat, plan, scale)
    return out


def _with_sinks_natively(
    q: torch.Tensor,
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    meta: AttentionMetadata,
    block_size: int,
    scale: float,
    sinks: torch.Tensor,
) -> torch.Tensor | None:
    """Full-context attention with sinks on the native prefill kernel (CPU): a sink adds
    exp(sink) to the softmax's denominator, so each row's output is the kernel's times
    sigmoid(lse - sink), from the log-sum-exp it returns. None where the kernel does not take
    the step (the explicit softmax then runs). At gpt-oss's heads (64 / 8, head 64), float32 on
    a 2-vCPU AMD EPYC Zen 2: 273 against the explicit softmax's 835 ms for a 2,048-token prompt,
    115 against 381 ms for a 512-token chunk after 1,536 cached (docs/design.md, gpt-oss)."""
    T, Hq, _ = q.shape
    seqs, slots = meta.whole_contexts(block_size)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(T, Hq, dtype=torch.float32, device=q.device)
    if not ops.prefill_attention(q, k_flat, v_flat, seqs, slots, scale, out, lse):
        return None
    keep = torch.sigmoid(lse.sub_(sinks.to(torch.float32))).unsqueeze(-1)
    if out.dtype == torch.float32:
        return out.mul_(keep)
    return (out.float() * keep).to(out.dtype)


def static_meta(view: StaticDecodeView | StaticMixedView) -> AttentionMetadata:
    """The metadata of a step over fixed buffers: to the model each of its `size` rows is a
    sequence of one new token whose length is bounded by the buffers' width (what the rotary table
    is built up to before a capture); the view holds the real layout."""
    size = view.size
    no_tables = torch.zeros(size, 0, dtype=torch.int32, device=view.slot_mapping.device)
    meta = AttentionMetadata(view.slot_mapping, list(range(size + 1)), [view.max_context] * size, no_tables)
    meta.static = view
    return meta


def _static_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    view: StaticDecodeView | StaticMixedView,
    scale: float,
    window: int | None,
    kv_written: bool,
    softcap: float | None = None,
) -> torch.Tensor:
    """A static step's layer: K/V written at the view's slots (unless `kv_written`), then
    Triton's attention over the view's tables and lengths (scores soft-capped by `softcap` if
    given); nothing allocated that depends on the values, no read-back."""
    Hkv, D = k.shape[1], k.shape[2]
    k_flat = kv_cache[0].view(-1, Hkv, D)
    v_flat = kv_cache[1].view(-1, Hkv, D)
    if not kv_written and not ops.write_kv(k, v, k_flat, v_flat, view.slot_mapping):
        k_flat.index_copy_(0, view.slot_mapping, k.to(kv_cache.dtype))
        v_flat.index_copy_(0, view.slot_mapping, v.to(kv_cache.dtype))
    return view.attend(q, k_flat, v_flat, scale, window, softcap)


def _decode(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, plan: _Plan, scale: float) -> torch.Tensor:
    """The decode rows' attention: Triton's kernel or, on CPU, the native one reads each context in
    place (kernels/ops.py); else every context gathered at once for one padded SDPA."""
    if plan.decode_tables is not None:
        return _triton_decode(q, k_flat, v_flat, plan, scale, None)
    slots = plan.decode_slots  # [Bd, L]
    Bd, L = slots.shape
    Hq, D = q.shape[1], q.shape[2]
    Hkv = k_flat.shape[1]
    qd = q if plan.decode_all else q[plan.decode_rows]
    o = ops.decode_attention(qd, k_flat, v_flat, slots, plan.decode_lens, scale)
    if o is None:
        kc = _gather(k_flat, slots).transpose(1, 2)  # [Bd, Hkv, L, D]
        vc = _gather(v_flat, slots).transpose(1, 2)
        # GQA without expanding K/V: the G query heads of a group become G "query rows".
        qd = qd.view(Bd, Hkv, Hq // Hkv, D)
        o = F.scaled_dot_product_attention(
            qd, kc.to(q.dtype), vc.to(q.dtype), attn_mask=plan.decode_mask, scale=scale
        ).reshape(Bd, Hq, D)
    return o


def _cascade(
    q: torch.Tensor,
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    plan: _Plan,
    prefix_slots: torch.Tensor,
    out: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Shared prefix once for every reading sequence, then each one's own suffix, merged."""
    rows = plan.group_rows
    o_pre, lse_pre = _attend(q[rows], _gather(k_flat, prefix_slots), _gather(v_flat, prefix_slots), None, scale)
    if out is None:
        out = torch.empty_like(q)
    done = 0
    if plan.decode_rows is not None and plan.decode_tables is not None:
        # each decode's own suffix: Triton's kernel in place, from the prefix's end on
        Bd = plan.decode_rows.numel()
        suffix_lse = torch.empty(Bd, q.shape[1], dtype=torch.float32, device=q.device)
        suffix_o = _triton_decode(q, k_flat, v_flat, plan, scale, suffix_lse)
        out[plan.decode_rows] = _merge(o_pre[:Bd], lse_pre[:Bd], suffix_o, suffix_lse)
        done = Bd
    elif plan.decode_rows is not None:
        Bd = plan.decode_rows.numel()
        slots = plan.decode_slots
        qd = q[plan.decode_rows]
        # each decode's own suffix: the native kernel in place on CPU, else gather + SDPA
        lse = torch.empty(Bd, qd.shape[1], dtype=torch.float32, device=qd.device)
        o = ops.decode_attention(qd, k_flat, v_flat, slots, plan.decode_lens, scale, lse)
        if o is None:
            o, lse = _attend_batched(
                qd,
                _gather(k_flat, slots).transpose(1, 2),
                _gather(v_flat, slots).transpose(1, 2),
                plan.decode_mask,
                scale,
            )
        out[plan.decode_rows] = _merge(o_pre[:Bd], lse_pre[:Bd], o, lse)
        done = Bd
    # each chunk's own suffix: the native kernel for those it takes (with their log-sum-exp)
    suffix: tuple[torch.Tensor, torch.Tensor] | None = None
    if plan.chunked_kernel is not None:
        batch = plan.chunked_kernel
        suffix = torch.empty(q.shape, dtype=q.dtype), torch.empty(q.shape[:2], dtype=torch.float32)
        if not ops.prefill_attention(q, k_flat, v_flat, batch.seqs, batch.slots, scale, *suffix):
            suffix = None
    if plan.triton_chunks is not None:  # every chunk's suffix by Triton's kernel, in place
        suffix_o = torch.empty_like(q)
        suffix_lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        plan.triton_chunks.attend(q, k_flat, v_flat, plan, scale, suffix_o, suffix_lse)
        rows = plan.triton_chunks.out_rows(q.device)
        n = rows.numel()
        out[rows] = _merge(o_pre[done : done + n], lse_pre[done : done + n], suffix_o[rows], suffix_lse[rows])
        return out
    if plan.chunk_batch is not None:  # every chunk in one padded attention (no native kernel here)
        batch_o, batch_lse = plan.chunk_batch.attend_with_lse(q, k_flat, v_flat, scale)
        n = batch_o.shape[0]
        out[plan.chunk_batch.out_rows] = _merge(o_pre[done : done + n], lse_pre[done : done + n], batch_o, batch_lse)
        return out
    # the kernel took every chunk but those the plan left to PyTorch (chunked_rest)
    left = {id(entry) for entry in plan.chunked_rest}
    for entry in plan.chunked:
        a, b, slots, mask = entry
        if suffix is not None and id(entry) not in left:
            o, lse = suffix[0][a:b], suffix[1][a:b]
        else:
            o, lse = _attend(q[a:b], _gather(k_flat, slots), _gather(v_flat, slots), mask, scale)
        n = b - a
        out[a:b] = _merge(o_pre[done : done + n], lse_pre[done : done + n], o, lse)
        done += n
    return out
