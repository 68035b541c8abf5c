"""Mamba2 (transformers' Mamba2ForCausalLM): a state-space mixer in every layer, its recurrent state
kept per block.

Where an attention layer keeps K/V rows in a block, a Mamba layer keeps its state after the block's
last computed token: the SSM state [heads, head_dim, state_size] and the conv state
[conv_dim, conv_kernel - 1] (the last inputs of the causal depthwise conv). A chunk of new tokens
covering [start, end) reads its initial state from the block holding start - 1 (zeros at 0) and
writes, into every block it touches, the state after its last token in that block. A prefix hit of
k blocks then restores the state at the end of block k - 1, and eviction is consistent: the state
lives in the block.

The scan runs over block-aligned segments (each chunk split at absolute block boundaries): the
state at a block boundary is computed from the previous boundary's state by the same operations
whether the prefix came from the cache or not, so caching on equals caching off.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionMetadata
from .config import ModelConfig
from .layers import RMSNorm
from .llama import LlamaModel
from .static_decode import StaticDecodeView
from .static_mixed import StaticMixedView


@dataclass
class RecurrentState:
    """One Mamba layer's per-block state tensors, as the model's forward takes them in place of a
    K/V cache: `ssm` [num_blocks, heads, head_dim, state_size] (None for a short convolution,
    whose state is its conv's alone), `conv` [num_blocks, conv_dim, conv_kernel - 1]."""

    ssm: torch.Tensor | None
    conv: torch.Tensor
    block_size: int


def as_state(cache: object) -> RecurrentState:
    """A recurrent layer's cache as it must be: its per-block state, not a K/V tensor."""
    if not isinstance(cache, RecurrentState):
        raise TypeError(f"a recurrent layer takes a RecurrentState (its state per block), not a {type(cache).__name__}")
    return cache


def as_kv(cache: object) -> torch.Tensor:
    """An attention layer's cache as it must be: its K/V tensor."""
    if not isinstance(cache, torch.Tensor):
        raise TypeError(f"an attention layer takes a K/V cache, not a {type(cache).__name__}")
    return cache


def recurrent_state_shapes(config: ModelConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per block and layer: the SSM state's shape and the conv state's."""
    conv_dim = config.ssm_intermediate_size + 2 * config.ssm_n_groups * config.ssm_state_size
    return (
        (config.ssm_num_heads, config.ssm_head_dim, config.ssm_state_size),
        (conv_dim, config.ssm_conv_kernel - 1),
    )


@dataclass
class _Plan:
    """A step's layout for the scan, the same for every layer: requests cut into block-aligned
    segments, each padded to block_size rows."""

    read_blocks: torch.Tensor  # [R] block holding each request's position start - 1 (0 where none)
    has_prev: torch.Tensor  # [R] bool: start > 0
    pad_index: torch.Tensor  # [S, bs] token row of each segment slot, T for padding
    out_index: torch.Tensor  # [T] flat segment slot of each token row
    seg_blocks: torch.Tensor  # [S] block each segment's final state goes to
    # the recurrence in dependency order: (segments, the segment each continues from, -1: the
    # request's initial state, and their requests); a round of one segment as plain ints (one
    # request's prefill is all such rounds: views, not index ops, a round)
    rounds: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | tuple[int, int, int]]
    # per request: (row0, row1, block read or -1, [(local end, block written)])
    conv_writes: list[tuple[int, int, int, list[tuple[int, int]]]]
    decode_only: bool  # one new token a request and no request reads a block written in this step
    # over a mixed step's fixed buffers (static_scan.py), in place of rounds and conv_writes: each
    # request's segments in order and their count (kernels/triton_scan.py walks them), each row's
    # conv window and each segment's last conv inputs, as rows of the step's conv table
    chains: torch.Tensor | None = None
    chain_len: torch.Tensor | None = None
    conv_rows: torch.Tensor | None = None
    conv_ends: torch.Tensor | None = None


def _plan(meta: AttentionMetadata, bs: int, device: torch.device) -> _Plan:
    key = ("mamba2", bs, device)
    plan = meta._plans.get(key)
    if plan is not None:
        return plan
    if meta.static is not None:
        plan = meta._plans[key] = _static_plan(meta)
        return plan
    # the host's copy of the tables where they live on a GPU: no wait for the device
    host = meta.host_block_tables if meta.host_block_tables is not None else meta.block_tables
    qsl, tables = meta.query_start_loc, host.tolist()
    T = qsl[-1]
    read_blocks: list[int] = []
    has_prev: list[bool] = []
    pad_rows: list[list[int]] = []
    seg_blocks: list[int] = []
    out_index = [0] * T
    round_of: list[list[tuple[int, int, int]]] = []
    conv_writes = []
    written: dict[int, tuple[int, int]] = {}  # block -> (segment writing it in this step, its round)
    for r, end in enumerate(meta.seq_lens):
        q0, q1 = qsl[r], qsl[r + 1]
        start = end - (q1 - q0)
        table = tables[r]
        read = table[(start - 1) // bs] if start else 0
        read_blocks.append(read)
        has_prev.append(start > 0)
        # a prefix hit on a block an earlier request of this step computes: continue from its segment
        prev, k = written[read] if start and read in written else (-1, -1)
        writes = []
        pos = start
        while pos < end:
            seg_end = min(end, (pos // bs + 1) * bs)
            s, k = len(seg_blocks), k + 1
            seg_blocks.append(table[pos // bs])
            rows = list(range(q0 + pos - start, q0 + seg_end - start))
            for j, row in enumerate(rows):
                out_index[row] = s * bs + j
            pad_rows.append(rows + [T] * (bs - len(rows)))
            if len(round_of) <= k:
                round_of.append([])
            round_of[k].append((s, prev, r))
            writes.append((seg_end - start, table[pos // bs]))
            written[table[pos // bs]] = (s, k)
            pos, prev = seg_end, s
        conv_writes.append((q0, q1, read if start else -1, writes))

    def t(x: list[Any], dtype: torch.dtype = torch.long) -> torch.Tensor:
        return torch.tensor(x, dtype=dtype, device=device)

    plan = _Plan(
        read_blocks=t(read_blocks),
        has_prev=t(has_prev, torch.bool),
        pad_index=t(pad_rows).reshape(-1, bs),
        out_index=t(out_index),
        seg_blocks=t(seg_blocks),
        rounds=[
            rnd[0] if len(rnd) == 1 else (t([x[0] for x in rnd]), t([x[1] for x in rnd]), t([x[2] for x in rnd]))
            for rnd in round_of
        ],
        conv_writes=conv_writes,
        decode_only=T == len(meta.seq_lens) and len(round_of) == 1,
    )
    meta._plans[key] = plan
    return plan


def _static_plan(meta: AttentionMetadata) -> _Plan:
    """A step over fixed buffers (what a CUDA graph replays). A decode step (static_decode.py): the
    one-token path's blocks read from the buffers' rows, whose values each step copies in - the
    same operations as an eager decode step's, over padded rows. A mixed step
    (static_mixed.py, static_scan.py): the segments, chains and conv windows from the buffers."""
    view = meta.static
    if isinstance(view, StaticMixedView):
        scan = view.scan
        if scan is None:
            raise ValueError("a recurrent layer over a mixed step's fixed buffers needs the scan's buffers")
        return _Plan(
            read_blocks=scan.state_read,
            has_prev=scan.has_prev,
            pad_index=scan.pad_index,
            out_index=scan.out_index,
            seg_blocks=scan.seg_blocks,
            rounds=[],
            conv_writes=[],
            decode_only=False,
            chains=scan.chains,
            chain_len=scan.chain_len,
            conv_rows=scan.conv_rows,
            conv_ends=scan.conv_ends,
        )
    if not isinstance(view, StaticDecodeView) or view.state_read is None or view.state_written is None:
        raise ValueError("a recurrent layer over fixed buffers needs decode buffers with the state's rows")
    assert view.has_prev is not None
    none = torch.zeros(0, dtype=torch.long, device=view.state_read.device)
    return _Plan(
        read_blocks=view.state_read,
        has_prev=view.has_prev,
        pad_index=none.view(0, 0),
        out_index=none,
        seg_blocks=view.state_written,
        rounds=[],
        conv_writes=[],
        decode_only=True,
    )


def block_causal_conv(
    conv1d: nn.Conv1d, x: torch.Tensor, conv_state: torch.Tensor, plan: _Plan, silu: bool = True
) -> torch.Tensor:
    """The causal depthwise conv (+ silu where `silu`) of every request's rows x [T, channels],
    continuing from the conv state of the block before its chunk; the state after each touched
    block's last row written back (conv_state [num_blocks, channels, kernel - 1])."""
    act = F.silu if silu else _identity
    w, channels = conv1d.weight, x.shape[1]
    kernel = w.shape[-1]
    if plan.decode_only:  # every request at once: its row after its block's last K - 1 inputs
        prev = conv_state.index_select(0, plan.read_blocks)
        prev = torch.where(plan.has_prev[:, None, None], prev, torch.zeros_like(prev))
        seq = torch.cat([prev, x[:, :, None].to(prev.dtype)], dim=2)  # [R, channels, K]
        conv_state[plan.seg_blocks] = seq[:, :, 1:]
        out = F.conv1d(seq.to(w.dtype), w, conv1d.bias, groups=channels)[:, :, 0]
        return act(out.to(x.dtype))
    if plan.conv_rows is not None and plan.conv_ends is not None:  # a mixed step over fixed buffers
        prev = conv_state.index_select(0, plan.read_blocks)  # [R, channels, K - 1], all reads first
        prev = torch.where(plan.has_prev[:, None, None], prev, torch.zeros_like(prev))
        # the step's rows, each request's state columns, a zero row: what the windows index
        table = torch.cat([x.to(prev.dtype), prev.transpose(1, 2).reshape(-1, channels), prev.new_zeros(1, channels)])
        conv_state[plan.seg_blocks] = table[plan.conv_ends].transpose(1, 2)
        windows = table[plan.conv_rows].transpose(1, 2)  # [T, channels, K]: each row's inputs
        out = F.conv1d(windows.to(w.dtype), w, conv1d.bias, groups=channels)[:, :, 0]
        return act(out.to(x.dtype))
    zeros = conv_state.new_zeros(conv_state.shape[1:])
    out = torch.empty_like(x)
    # request by request in batch order: a block a request reads was written by itself or by an
    # earlier request (a hit on a block computed in this same step)
    for q0, q1, read, writes in plan.conv_writes:
        prev = conv_state[read] if read >= 0 else zeros
        seq = torch.cat([prev, x[q0:q1].t().to(prev.dtype)], dim=1)  # [channels, K - 1 + n]
        out[q0:q1] = F.conv1d(seq[None].to(w.dtype), w, conv1d.bias, groups=channels)[0].t()
        for local_end, block in writes:
            conv_state[block] = seq[:, local_end : local_end + kernel - 1]
    return act(out)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


class GatedRMSNorm(nn.Module):
    """RMS norm of x * silu(gate) in float32, over groups of `group_size` channels."""

    def __init__(self, dim: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group_size = group_size
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float() * F.silu(gate.float())
        g = h.view(*h.shape[:-1], -1, self.group_size)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * g.view_as(h).to(dtype)


class NormThenGate(nn.Module):
    """RMS norm of x over groups of `group_size` channels, then times silu(gate), in float32
    (Falcon-H1's mamba_norm_before_gate)."""

    def __init__(self, dim: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group_size = group_size
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float()
        g = h.view(*h.shape[:-1], -1, self.group_size)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * g.view_as(h) * F.silu(gate.float())).to(x.dtype)


class SiluGate(nn.Module):
    """x * silu(gate), no norm (Falcon-H1 without mamba_rms_norm)."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return (x.float() * F.silu(gate.float())).to(x.dtype)


def gated_norm(config: ModelConfig) -> nn.Module:
    """The mixer's gate and norm of its scan output, as `config.ssm_norm` says."""
    dim = config.ssm_intermediate_size
    if config.ssm_norm == "none":
        return SiluGate()
    if config.ssm_norm == "norm_then_gate":
        return NormThenGate(dim, dim // config.ssm_n_groups, config.rms_norm_eps)
    return GatedRMSNorm(dim, dim // config.ssm_n_groups, config.rms_norm_eps)


class Mamba2Mixer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.heads, self.head_dim = config.ssm_num_heads, config.ssm_head_dim
        self.groups, self.state_size = config.ssm_n_groups, config.ssm_state_size
        self.intermediate = config.ssm_intermediate_size
        self.conv_dim = self.intermediate + 2 * self.groups * self.state_size
        self.kernel = config.ssm_conv_kernel
        self.dt_limit = config.ssm_time_step_limit
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=config.ssm_use_conv_bias
        )
        self.in_proj = nn.Linear(
            config.hidden_size, self.intermediate + self.conv_dim + self.heads, bias=config.ssm_use_bias
        )
        self.dt_bias = nn.Parameter(torch.empty(self.heads))
        self.A_log = nn.Parameter(torch.empty(self.heads))
        self.D = nn.Parameter(torch.empty(self.heads))
        self.norm = gated_norm(config)
        self.out_proj = nn.Linear(self.intermediate, config.hidden_size, bias=config.ssm_use_bias)

    def forward(self, x: torch.Tensor, state: RecurrentState, meta: AttentionMetadata) -> torch.Tensor:
        plan = _plan(meta, state.block_size, x.device)
        gate, xbc, dt = self.in_proj(x).split([self.intermediate, self.conv_dim, self.heads], dim=-1)
        xbc = self._conv(xbc, state.conv, plan)
        xs, B, C = xbc.split([self.intermediate, self.groups * self.state_size, self.groups * self.state_size], -1)
        assert state.ssm is not None  # a Mamba layer's state has both parts
        y = self._scan(xs, B, C, dt, state.ssm, plan)
        return self.out_proj(self.norm(y, gate).to(x.dtype))

    def _conv(self, xbc: torch.Tensor, conv_state: torch.Tensor, plan: _Plan) -> torch.Tensor:
        return block_causal_conv(self.conv1d, xbc, conv_state, plan)

    def _scan(
        self, xs: torch.Tensor, B: torch.Tensor, C: torch.Tensor, dt: torch.Tensor, ssm: torch.Tensor, plan: _Plan
    ) -> torch.Tensor:
        """The selective scan over block-aligned segments: within a segment the quadratic (dual)
        form, across a request's segments the state recurrence, in order."""
        T, H, P, N, G = xs.shape[0], self.heads, self.head_dim, self.state_size, self.groups
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(self.dt_limit[0], self.dt_limit[1])
        A = -torch.exp(self.A_log.float())
        x = xs.float().view(T, H, P)
        Bh = B.float().view(T, G, N).repeat_interleave(H // G, dim=1)
        Ch = C.float().view(T, G, N).repeat_interleave(H // G, dim=1)
        if plan.decode_only:  # the one-token recurrence, every request at once
            st = ssm.index_select(0, plan.read_blocks).float()
            st = torch.where(plan.has_prev[:, None, None, None], st, torch.zeros_like(st))
            dA = torch.exp(dt * A)[:, :, None, None]
            st = st * dA + (dt[:, :, None] * x)[..., None] * Bh[:, :, None, :]
            ssm[plan.seg_blocks] = st.to(ssm.dtype)
            y1 = torch.einsum("thpn,thn->thp", st, Ch) + self.D.float()[:, None] * x
            return y1.reshape(T, H * P)

        def padded(t: torch.Tensor) -> torch.Tensor:  # [T, ...] -> [S, bs, ...], zero rows as padding
            z = torch.cat([t, t.new_zeros(1, *t.shape[1:])])
            return z[plan.pad_index]

        xdt, Bs, Cs, dts = padded(x * dt[..., None]), padded(Bh), padded(Ch), padded(dt)
        xp = padded(x)
        cum = torch.cumsum(dts * A, dim=1)  # [S, bs, H]: padding (dt = 0) leaves it where it was
        seg_len = cum.shape[1]
        causal = torch.ones(seg_len, seg_len, dtype=torch.bool, device=x.device).tril()
        diff = (cum[:, :, None, :] - cum[:, None, :, :]).masked_fill(~causal[None, :, :, None], float("-inf"))
        M = torch.einsum("slhn,sthn->slth", Cs, Bs) * torch.exp(diff)  # [S, l, t, H]
        y = torch.einsum("slth,sthp->slhp", M, xdt)
        last = cum[:, -1:, :]
        chunk_state = torch.einsum("slhn,slhp->shpn", Bs * torch.exp(last - cum)[..., None], xdt)
        decay = torch.exp(last[:, 0])  # [S, H]

        initial = ssm.index_select(0, plan.read_blocks).float()  # all reads before any write
        initial = torch.where(plan.has_prev[:, None, None, None], initial, torch.zeros_like(initial))
        if plan.chains is not None and plan.chain_len is not None:  # fixed buffers: one kernel walks the chains
            from .kernels.triton_scan import chain_states

            # padding segments stay zero states: their rows (zeros) give zeros, their block is the null one
            before, after = torch.zeros_like(chunk_state), torch.zeros_like(chunk_state)
            chain_states(initial, decay, chunk_state, plan.chains, plan.chain_len, before, after)
        else:
            before = chunk_state.new_empty(chunk_state.shape)
            after = chunk_state.new_empty(chunk_state.shape)
        for rnd in plan.rounds:
            match rnd:
                case (int() as seg, int() as prev_seg, int() as req):
                    one = after[prev_seg] if prev_seg >= 0 else initial[req]
                    before[seg] = one
                    after[seg] = one * decay[seg][:, None, None] + chunk_state[seg]
                case (torch.Tensor() as segs, torch.Tensor() as prev, torch.Tensor() as reqs):
                    st = torch.where((prev >= 0)[:, None, None, None], after[prev.clamp(min=0)], initial[reqs])
                    before[segs] = st
                    after[segs] = st * decay[segs][:, :, None, None] + chunk_state[segs]
        # every block a segment ends in, once: all reads of ssm came before (initial)
        ssm[plan.seg_blocks] = after.to(ssm.dtype)
        y = y + torch.einsum("slhn,shpn->slhp", Cs, before) * torch.exp(cum)[..., None]
        y = y + self.D.float()[:, None] * xp
        return y.reshape(-1, H * P)[plan.out_index]


class Mamba2Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mixer = Mamba2Mixer(config)
        self.residual_in_fp32 = config.residual_in_fp32

    def forward(self, h: torch.Tensor, state: RecurrentState, meta: AttentionMetadata) -> torch.Tensor:
        w = self.norm.weight
        out = self.mixer(self.norm(h.to(w.dtype)), state, meta)
        residual = h.float() if self.residual_in_fp32 else h
        return residual + out


_HF_NAME = re.compile(r"^backbone\.(layers\.\d+\..+)$")
_HF_GLOBAL = {
    "backbone.embeddings.weight": "embed_tokens.weight",
    "backbone.embedding.weight": "embed_tokens.weight",
    "backbone.norm_f.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}


class Mamba2Model(LlamaModel):
    """forward(input_ids [T], positions [T], states (one RecurrentState a layer), meta) ->
    final-normed hidden [T, H]. The Llama decoder's embedding, final norm, head and loading
    plumbing with Mamba2 blocks."""

    fused_decode_layout = False

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ) -> None:
        # no rotary table: the base class sizes one by max_position_embeddings, which a model
        # without positions sets as high as it likes
        super().__init__(dataclasses.replace(config, max_position_embeddings=1), dtype, device)
        self.config = config

    def make_layer(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        return Mamba2Block(config)

    def pack_for_cpu(self) -> bool:
        """Nothing to lay out: the mixer's matmuls stay torch's."""
        return False

    def static_decode_unsupported(self) -> str | None:
        """Every layer a Mamba2 block, whose decode step reads its blocks from the buffers."""
        return None

    def reserve_positions(self, n: int) -> None:
        """Nothing to reserve: no layer reads positions."""

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[Any],
        meta: AttentionMetadata,
        lora_mapping: object | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        input_ids, positions = self.begin_step(input_ids, positions, kv_caches, meta, lora_mapping)
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds.to(self.device)
        for layer, state in zip(self.layers, kv_caches):
            if not isinstance(state, RecurrentState):
                raise TypeError("a Mamba2 layer takes a RecurrentState (per-block SSM and conv state), not a K/V cache")
            h = layer(h, state, meta)
        return self.norm(h.to(self.dtype))

    def init_random_weights(self, seed: int = 0, std: float = 0.02) -> None:
        super().init_random_weights(seed, std)
        with torch.no_grad():
            for layer in self.layers:
                mixer = cast(Mamba2Block, layer).mixer
                mixer.A_log.copy_(torch.log(torch.arange(1, mixer.heads + 1, dtype=torch.float32)))
                mixer.D.fill_(1.0)

    def load_hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """transformers' names (backbone.embeddings / backbone.layers.N.{norm,mixer.*} /
        backbone.norm_f / lm_head); ValueError on an unknown name, a wrong shape or a missing one."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            m = _HF_NAME.match(name)
            target = m.group(1) if m else _HF_GLOBAL.get(name)
            if target == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the head
            if target is None or target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {self.config.architecture}")
            p = params[target]
            if tuple(tensor.shape) != tuple(p.shape):
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(p.shape)}"
                )
            with torch.no_grad():
                p.copy_(tensor.to(p.dtype))
            loaded.add(target)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint misses {len(missing)} tensor(s) of {self.config.architecture}: {missing[:5]}")
