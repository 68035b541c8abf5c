"""Qwen3-Next's gated delta net (transformers' Qwen3NextGatedDeltaNet), a linear attention: per
value head a state S [head_k_dim, head_v_dim], per token decayed by exp(g) and corrected towards
v along k (the delta rule: S <- exp(g) S + k beta (v - (exp(g) S)^T k)^T), read by q. q, k and v
pass a causal depthwise conv first; the output is norm-gated by z.

The state lives per block as model/mamba2.py keeps Mamba2's (a `RecurrentState`: `ssm` holds S,
`conv` the conv's last inputs), the state after each block's last computed token, so a prefix hit
of k blocks restores the state at the end of block k - 1.

Prefill runs the chunked form (transformers' torch_chunk_gated_delta_rule; the WY / UT
transform) with each block-aligned segment of mamba2.py's plan as one chunk: within a segment a
few batched matmuls and one triangular inverse, across a request's segments the state recurrence
in order (S <- A S + B, A and B a segment's own). The state at a block boundary is computed from
the previous boundary's by the same operations whether the prefix came from the cache or not.
Decode: the one-token recurrence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionMetadata
from .config import ModelConfig
from .mamba2 import RecurrentState, _Plan, _plan, block_causal_conv


def gated_delta_state_shapes(config: ModelConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per block and layer: the delta rule's state [value heads, head_k_dim, head_v_dim] and the
    conv state [q, k and v channels, conv kernel - 1]."""
    Hk, Hv = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    return (Hv, dk, dv), (2 * Hk * dk + Hv * dv, config.linear_conv_kernel - 1)


class HeadGatedRMSNorm(nn.Module):
    """RMS norm of each head's x [..., heads, dim] (float32, one weight [dim] for every head), then
    times silu(gate) (transformers' Qwen3NextRMSNormGated)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return (h * F.silu(gate.float())).to(dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / |x| over the last dimension, as the FLA kernels (and transformers) compute it."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    """forward(x [T, hidden], state, meta) -> [T, hidden]."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.k_heads, self.v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.dk, self.dv = config.linear_key_head_dim, config.linear_value_head_dim
        self.ratio = self.v_heads // self.k_heads  # value heads per q/k head
        self.key_dim, self.value_dim = self.k_heads * self.dk, self.v_heads * self.dv
        conv_dim = 2 * self.key_dim + self.value_dim
        H = config.hidden_size
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, config.linear_conv_kernel, groups=conv_dim, bias=False)
        # per q/k head group: q, k, its value heads' v, their z (transformers' layout)
        self.in_proj_qkvz = nn.Linear(H, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(H, 2 * self.v_heads, bias=False)  # per group: its heads' b, then a
        self.dt_bias = nn.Parameter(torch.ones(self.v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.v_heads))
        self.norm = HeadGatedRMSNorm(self.dv, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, H, bias=False)

    def forward(self, x: torch.Tensor, state: RecurrentState, meta: AttentionMetadata) -> torch.Tensor:
        plan = _plan(meta, state.block_size, x.device)
        T, r = x.shape[0], self.ratio
        qkvz = self.in_proj_qkvz(x).view(T, self.k_heads, 2 * self.dk + 2 * r * self.dv)
        q, k, v, z = qkvz.split([self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
        b, a = self.in_proj_ba(x).view(T, self.k_heads, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)
        mixed = block_causal_conv(self.conv1d, mixed, state.conv, plan)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        beta = b.reshape(T, self.v_heads).sigmoid().float()
        g = -self.A_log.float().exp() * F.softplus(a.reshape(T, self.v_heads).float() + self.dt_bias)
        # each q/k head serves `ratio` consecutive value heads
        q = l2norm(q.float().view(T, self.k_heads, self.dk)).repeat_interleave(r, dim=1) * self.dk**-0.5
        k = l2norm(k.float().view(T, self.k_heads, self.dk)).repeat_interleave(r, dim=1)
        v = v.float().view(T, self.v_heads, self.dv)
        assert state.ssm is not None  # a delta net's state has both parts
        if plan.decode_only:
            y = self._decode(q, k, v, g, beta, state.ssm, plan)
        else:
            y = self._chunked(q, k, v, g, beta, state.ssm, plan)
        out = self.norm(y.to(x.dtype), z.reshape(T, self.v_heads, self.dv))
        return self.out_proj(out.reshape(T, self.value_dim))

    @staticmethod
    def _decode(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        ssm: torch.Tensor,
        plan: _Plan,
    ) -> torch.Tensor:
        """One token a request, every request at once (transformers' recurrent form)."""
        st = ssm.index_select(0, plan.read_blocks).float()  # [R, Hv, dk, dv]
        st = torch.where(plan.has_prev[:, None, None, None], st, torch.zeros_like(st))
        st = st * g.exp()[:, :, None, None]
        kv_mem = (st * k[..., None]).sum(dim=-2)
        delta = (v - kv_mem) * beta[..., None]
        st = st + k[..., None] * delta[..., None, :]
        ssm[plan.seg_blocks] = st.to(ssm.dtype)
        return (st * q[..., None]).sum(dim=-2)

    @staticmethod
    def _chunked(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        ssm: torch.Tensor,
        plan: _Plan,
    ) -> torch.Tensor:
        """The chunked form, one block-aligned segment a chunk (padding rows: zero k, v, beta and
        decay, which leave the state as it is)."""

        def padded(t: torch.Tensor) -> torch.Tensor:  # [T, Hv, ...] -> [S, Hv, bs, ...]
            z = torch.cat([t, t.new_zeros(1, *t.shape[1:])])
            return z[plan.pad_index].transpose(1, 2)

        qs, ks, vs, gs, betas = (padded(t) for t in (q, k, v, g, beta))
        bs = qs.shape[2]
        cum = gs.cumsum(dim=-1)  # [S, Hv, bs]: the log decay from the segment's start
        upper = torch.ones(bs, bs, dtype=torch.bool, device=q.device).triu(1)
        pair = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
        k_beta = ks * betas[..., None]
        ut = (k_beta @ ks.transpose(-1, -2)) * pair
        # the UT system's inverse once, then two matmuls: solving for the wide right-hand sides
        # directly is several times slower on CPU
        eye = torch.eye(bs, dtype=ut.dtype, device=ut.device).expand_as(ut)
        inv = torch.linalg.solve_triangular(ut, eye, upper=False, unitriangular=True)
        u = inv @ (vs * betas[..., None])
        w = inv @ (k_beta * cum.exp()[..., None])
        intra = (qs @ ks.transpose(-1, -2)) * pair
        q_decayed = qs * cum.exp()[..., None]
        k_decayed = (ks * (cum[..., -1:] - cum).exp()[..., None]).transpose(-1, -2)
        decay = cum[..., -1].exp()[..., None]

        # across segments S <- A S + B: the chunk's decay less what its keys' deltas remove, and
        # what they write
        A = -(k_decayed @ w)
        A.diagonal(dim1=-2, dim2=-1).add_(decay)
        B = k_decayed @ u
        initial = ssm.index_select(0, plan.read_blocks).float()  # all reads before any write
        initial = torch.where(plan.has_prev[:, None, None, None], initial, torch.zeros_like(initial))
        if plan.chains is not None and plan.chain_len is not None:  # fixed buffers: one kernel walks the chains
            from .kernels.triton_scan import matrix_chain_states

            # padding segments stay zero states: their rows (zeros) give zeros, their block is the null one
            before, after = torch.zeros_like(B), torch.zeros_like(B)
            matrix_chain_states(initial, A, B, plan.chains, plan.chain_len, before, after)
        else:
            before = torch.empty_like(B)
            after = torch.empty_like(B)
        for rnd in plan.rounds:
            match rnd:
                case (int() as seg, int() as prev_seg, int() as req):  # one segment: views, no index ops
                    one = after[prev_seg] if prev_seg >= 0 else initial[req]
                    before[seg] = one
                    torch.baddbmm(B[seg], A[seg], one, out=after[seg])
                case (torch.Tensor() as segs, torch.Tensor() as prev, torch.Tensor() as reqs):
                    st = torch.where((prev >= 0)[:, None, None, None], after[prev.clamp(min=0)], initial[reqs])
                    before[segs] = st
                    # the lone segment's operation (baddbmm), over [segments x heads]
                    flat = torch.baddbmm(B[segs].flatten(0, 1), A[segs].flatten(0, 1), st.flatten(0, 1))
                    after[segs] = flat.view_as(st)
        # every segment its own block: no block is computed twice in a step
        ssm[plan.seg_blocks] = after.to(ssm.dtype)
        y = q_decayed @ before + intra @ (u - w @ before)  # [S, Hv, bs, dv]
        return y.transpose(1, 2).flatten(0, 1)[plan.out_index]
