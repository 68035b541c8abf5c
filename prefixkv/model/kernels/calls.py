"""The native kernels' calls through ctypes, one function each: the arguments laid out as the C
source takes them (csrc/kernels.h), nothing checked - ops.py decides when a call applies and
self_check.py runs them against the PyTorch path before first use."""

from __future__ import annotations

import ctypes

import torch

from ... import huge_pages

HEAD_DIMS = (32, 64, 128)
MAX_GROUP = 16  # query heads per KV head the kernel takes (kMaxGroup in the source)
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
SMALL_LINEAR_BLOCK = 16  # output columns per block of the packed weight (kBlock in the source)
SMALL_LINEAR_PAIR = 2  # blocks side by side in each step of the layout (kPair in the source)


def decode_attention_call(
    fn: ctypes._CFuncPtr,  # type: ignore[name-defined]
    code: int,
    q: torch.Tensor,
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    slots: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    lse: torch.Tensor | None = None,
) -> torch.Tensor | None:
    B, Hq, D = q.shape
    Hkv = k_flat.shape[1]
    q = q.contiguous()
    slots = slots.contiguous()
    lens = lens.contiguous()
    out = torch.empty_like(q)
    rc = fn(
        code,
        D,
        q.data_ptr(),
        k_flat.data_ptr(),
        v_flat.data_ptr(),
        slots.data_ptr(),
        lens.data_ptr(),
        out.data_ptr(),
        None if lse is None else lse.data_ptr(),
        B,
        slots.shape[1],
        Hkv,
        Hq // Hkv,
        float(scale),
        torch.get_num_threads(),
    )
    return out if rc == 0 else None


def prefill_attention_call(
    fn: ctypes._CFuncPtr,  # type: ignore[name-defined]
    code: int,
    q: torch.Tensor,
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    seqs: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor | None,
) -> bool:
    rc = fn(
        code,
        q.shape[2],
        q.data_ptr(),
        q.stride(0),
        k_flat.data_ptr(),
        v_flat.data_ptr(),
        seqs.data_ptr(),
        slots.data_ptr(),
        out.data_ptr(),
        None if lse is None else lse.data_ptr(),
        seqs.shape[0],
        k_flat.shape[1],
        q.shape[1] // k_flat.shape[1],
        float(scale),
        torch.get_num_threads(),
    )
    return bool(rc == 0)


def silu_and_mul_call(fn: ctypes._CFuncPtr, code: int, gate_up: torch.Tensor) -> torch.Tensor | None:  # type: ignore[name-defined]
    inner = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], inner, dtype=gate_up.dtype)
    rows = gate_up.numel() // (2 * inner)
    rc = fn(code, gate_up.data_ptr(), out.data_ptr(), rows, inner, torch.get_num_threads())
    return out if rc == 0 else None


def rotary_call(
    fn: ctypes._CFuncPtr,  # type: ignore[name-defined]
    code: int,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> bool:
    T, H, D = x.shape
    rc = fn(code, x.data_ptr(), x.stride(0), T, H, D, cos.data_ptr(), sin.data_ptr(), torch.get_num_threads())
    return bool(rc == 0)


def small_linear_call(
    fn: ctypes._CFuncPtr,  # type: ignore[name-defined]
    x: torch.Tensor,
    packed: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None,
) -> torch.Tensor | None:
    M, K = x.shape
    y = torch.empty(M, out_features, dtype=x.dtype)
    rc = fn(
        DTYPE_CODES[x.dtype],
        x.data_ptr(),
        x.stride(0),
        packed.data_ptr(),
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        M,
        K,
        out_features,
        torch.get_num_threads(),
    )
    return y if rc == 0 else None


def add_rms_norm_call(
    fn: ctypes._CFuncPtr,  # type: ignore[name-defined]
    code: int,
    h: torch.Tensor,
    delta: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
) -> torch.Tensor | None:
    out = torch.empty_like(h)
    dim = h.shape[-1]
    rc = fn(
        code,
        h.data_ptr(),
        None if delta is None else delta.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        h.numel() // dim if dim else 0,
        dim,
        float(eps),
        torch.get_num_threads(),
    )
    return out if rc == 0 else None


def small_linear_pairs(out_features: int) -> int:
    columns = SMALL_LINEAR_BLOCK * SMALL_LINEAR_PAIR
    return -(-out_features // columns)


def small_linear_layout(weight: torch.Tensor) -> torch.Tensor:
    # written straight into the result (the whole pairs from the weight, a zero-padded copy of the
    # last one only): a padded copy of the whole weight first made every start's layout ~2x slower,
    # its fresh pages faulted in once more
    N, K = weight.shape
    pairs, block, pair = small_linear_pairs(N), SMALL_LINEAR_BLOCK, SMALL_LINEAR_PAIR
    columns, whole = block * pair, N // (block * pair)
    f32 = weight.dtype == torch.float32
    # on huge pages where Linux offers them: a decode step streams every weight once (huge_pages.py)
    out = huge_pages.empty((pairs, K, pair, block) if f32 else (pairs, K // 2, pair, block, 2), weight.dtype)

    def arranged(rows: torch.Tensor, count: int) -> torch.Tensor:
        if f32:
            return rows.view(count, pair, block, K).permute(0, 3, 1, 2)
        return rows.view(count, pair, block, K // 2, 2).permute(0, 3, 1, 2, 4)

    if whole:
        out[:whole].copy_(arranged(weight[: whole * columns], whole))
    if whole < pairs:
        tail = weight.new_zeros(columns, K)
        tail[: N - whole * columns] = weight[whole * columns :]
        out[whole:].copy_(arranged(tail, 1))
    return out


def small_linear_unlayout(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The [out_features, K] weight that `small_linear_layout` laid out as `packed` (a new tensor)."""
    if packed.dim() == 4:  # float32 [pairs, K, pair, block]
        rows = packed.permute(0, 2, 3, 1)
    else:  # bfloat16 [pairs, K/2, pair, block, 2]
        rows = packed.permute(0, 2, 3, 1, 4)
    pairs = packed.shape[0]
    return rows.reshape(pairs * SMALL_LINEAR_BLOCK * SMALL_LINEAR_PAIR, -1)[:out_features].contiguous()
