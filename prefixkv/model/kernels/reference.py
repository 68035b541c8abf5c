"""The PyTorch formulations of the native CPU kernels: the oracles their checks and tests compare
against, and the path that runs where a kernel does not."""

from __future__ import annotations

import torch


def reference_decode_attention(
    q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """The PyTorch formulation of `decode_attention` (gather, then SDPA): the kernel's oracle."""
    return reference_decode_attention_lse(q, k_flat, v_flat, slots, lens, scale)[0]


def reference_decode_attention_lse(
    q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference_decode_attention` and the log-sum-exp [B, Hq] of each row's scaled scores."""
    B, Hq, D = q.shape
    L, Hkv = slots.shape[1], k_flat.shape[1]
    mask = torch.arange(L)[None, :] < lens[:, None]
    kc = k_flat.index_select(0, slots.reshape(-1)).view(B, L, Hkv, D).transpose(1, 2).float()
    vc = v_flat.index_select(0, slots.reshape(-1)).view(B, L, Hkv, D).transpose(1, 2).float()
    qg = q.float().reshape(B, Hkv, Hq // Hkv, D)
    scores = torch.matmul(qg, kc.transpose(-1, -2)) * scale  # [B, Hkv, G, L]
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.softmax(scores, dim=-1), vc)
    return out.reshape(B, Hq, D).to(q.dtype), lse.reshape(B, Hq)


def reference_prefill_attention(
    q: torch.Tensor,
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    seqs: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor | None = None,
) -> None:
    """The PyTorch formulation of `prefill_attention` (gather, masked softmax in float32): its oracle."""
    Hq, D = q.shape[1], q.shape[2]
    Hkv = k_flat.shape[1]
    for row0, n, kv, offset in seqs.tolist():
        idx = slots[offset : offset + kv]
        kc = k_flat.index_select(0, idx).float().transpose(0, 1)  # [Hkv, kv, D]
        vc = v_flat.index_select(0, idx).float().transpose(0, 1)
        qs = q[row0 : row0 + n].float().view(n, Hkv, Hq // Hkv, D).permute(1, 0, 2, 3).reshape(Hkv, -1, D)
        scores = torch.matmul(qs, kc.transpose(1, 2)) * scale  # [Hkv, n * G, kv]
        qpos = (torch.arange(n) + kv - n).repeat_interleave(Hq // Hkv)
        scores = scores.masked_fill(torch.arange(kv)[None, :] > qpos[:, None], float("-inf"))
        o = torch.matmul(torch.softmax(scores, dim=-1), vc)  # [Hkv, n * G, D]
        out[row0 : row0 + n] = o.view(Hkv, n, Hq // Hkv, D).permute(1, 0, 2, 3).reshape(n, Hq, D).to(out.dtype)
        if lse is not None:
            lse[row0 : row0 + n] = (
                torch.logsumexp(scores, dim=-1).view(Hkv, n, Hq // Hkv).permute(1, 0, 2).reshape(n, Hq)
            )


def reference_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """The PyTorch formulation of `silu_and_mul`: its oracle."""
    g, u = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(g) * u


def reference_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The PyTorch formulation of `rotary_`, out of place into a new contiguous tensor (what
    layers.RotaryEmbedding.apply runs where the kernel does not).

    transformers' x * cos + rotate_half(x) * sin, bit for bit: with the sine's sign folded into the
    table, rotate_half becomes a swap of the halves, and x2 * (-s) = -(x2 * s) and a + (-b) = a - b
    are exact in IEEE arithmetic. Four operations over whole rows, where the half-by-half form
    takes seven."""
    half = x.shape[-1] // 2
    cos, sin = cos.reshape(x.shape[0], 1, -1), sin.reshape(x.shape[0], 1, -1)
    out = x * cos
    out += torch.cat((x[..., half:], x[..., :half]), dim=-1).mul_(sin)
    return out


def reference_add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch formulation of `add_rms_norm` (out of place): (h + delta, its norm)."""
    if delta is not None:
        h = h + delta
    normed = torch.nn.functional.rms_norm(h.float(), (h.shape[-1],), None, eps).to(h.dtype)
    return h, weight * normed
