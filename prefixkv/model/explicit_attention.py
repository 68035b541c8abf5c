"""Attention with an explicit softmax, for what no fused kernel (SDPA, the native ones) takes:
soft-capped scores (Gemma 2: cap * tanh(scores / cap) before the mask and the softmax) and
attention sinks (gpt-oss: a learned logit per query head that joins every softmax's denominator
and adds no value), as transformers' eager attention computes them. In bounded memory: each
sequence's new tokens go by chunks of query rows, and a chunk scores only the keys its rows can
see (up to its last row's position; with a sliding window, from its first row's window start).
At most [Hq, chunk, keys] scores live at once, never the [n, n] of a whole prompt; the causal and
window masks are built from positions, for the few columns of a chunk that need one. A decode
reads its context (or its window) whole and needs no mask."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

# Query rows per chunk, and the most scores (rows x heads x keys) a chunk may hold: a context past
# MAX_CHUNK_SCORES / (heads x QUERY_CHUNK) keys takes fewer rows. At Gemma 2 2B's shapes 128 and
# 256 rows ran alike from 512 to 8,192 tokens, float32 and bfloat16, and 32-64 rows slower at
# 8,192 (each chunk packs its keys for the product anew); 128 holds half the scores of 256
# (docs/benchmarks.md). Tests lower both to cross chunk edges.
QUERY_CHUNK = 128
MAX_CHUNK_SCORES = 1 << 24


class _Sequence(NamedTuple):
    start: int  # its first row of the step
    end: int
    first_query: int  # position of its first new token
    first_key: int  # the first position any of its queries sees
    slots: torch.Tensor | None  # cache slots of positions first_key..; None: a fresh prompt, keys of the step


class ExplicitPlan:
    """What a step's explicit-softmax layers of one kind (window or none) read, built once per step:
    each sequence's rows, the positions of its queries and keys, and where its cached keys lie.
    A prompt without cached context reads the step's own keys (the same values the cache holds)."""

    def __init__(
        self,
        query_start_loc: list[int],
        seq_lens: list[int],
        block_tables: torch.Tensor,
        block_size: int,
        device: torch.device,
        window: int | None,
    ) -> None:
        self.window = window
        self.device = device
        self.sequences: list[_Sequence] = []
        self.masks: dict[tuple[int, ...], torch.Tensor] = {}  # per chunk shape, shared by the layers
        self._scratch: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        bt = block_tables.to(device=device, dtype=torch.long)
        for i, s in enumerate(seq_lens):
            a, b = query_start_loc[i], query_start_loc[i + 1]
            n = b - a
            if n == 0:
                continue
            first_key = 0 if window is None else max(0, s - n - window + 1)
            slots = None
            if n < s:
                pos = torch.arange(first_key, s, device=device)
                slots = bt[i, pos // block_size] * block_size + pos % block_size
            self.sequences.append(_Sequence(a, b, s - n, first_key, slots))

    def scratch(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A buffer of `shape` the step's layers and sequences take in turn (each done with it
        before the next asks): a context's keys gathered into fresh memory every layer cost more in
        page faults than in copying (docs/journal/2026-11-27-softcap.md)."""
        numel = math.prod(shape)
        buf = self._scratch.get((name, dtype))
        if buf is None or buf.numel() < numel:
            buf = self._scratch[(name, dtype)] = torch.empty(numel, dtype=dtype, device=self.device)
        return buf[:numel].view(shape)

    def mask(self, rows: int, offset: int, cols: int, window: int | None) -> torch.Tensor:
        """[rows, cols] True where key j is hidden from query i, which sits at key position
        offset + i: the key lies past it (causal), or `window` or more positions before it."""
        key = (rows, offset, cols, -1 if window is None else window)
        m = self.masks.get(key)
        if m is None:
            rows_at = offset + torch.arange(rows, device=self.device)[:, None]
            diff = rows_at - torch.arange(cols, device=self.device)[None, :]
            m = diff < 0 if window is None else diff >= window
            self.masks[key] = m
        return m


def explicit_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    plan: ExplicitPlan,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, Hq, D], the step's k, v [T, Hkv, D], a layer's cache k_flat, v_flat [slots, Hkv, D]
    (the step's K/V written already) -> [T, Hq, D]; `softcap`: the scores' cap, `sinks` [Hq]:
    each query head's sink logit (float32)."""
    Hq = q.shape[1]
    out = torch.empty_like(q)
    W = plan.window
    for a, b, first_query, first_key, slots in plan.sequences:
        n = b - a
        # keys [Hkv, L, D] of positions first_key..: a fresh prompt's own, or gathered from the cache
        if slots is None:
            kc, vc = _per_head(k[a + first_key : b], plan, "k"), _per_head(v[a + first_key : b], plan, "v")
        else:
            kc = _per_head(_gather(k_flat, slots, plan, "k gathered").to(q.dtype), plan, "k")
            vc = _per_head(_gather(v_flat, slots, plan, "v gathered").to(q.dtype), plan, "v")
        keys = first_query + n - first_key  # a chunk's keys at most: all, or its rows' windows
        if W is not None:
            keys = min(keys, QUERY_CHUNK + W - 1)
        rows = max(1, min(QUERY_CHUNK, MAX_CHUNK_SCORES // (Hq * keys)))
        for c0 in range(0, n, rows):
            c1 = min(n, c0 + rows)
            p0 = first_query + c0  # the chunk's first query position
            lo = first_key if W is None else max(first_key, p0 - W + 1)  # the first key it sees
            hi = first_query + c1  # past the last key its last query sees
            out[a + c0 : a + c1] = _chunk(
                q[a + c0 : a + c1], kc[:, lo - first_key : hi - first_key], vc[:, lo - first_key : hi - first_key],
                p0 - lo, plan, scale, softcap, sinks,
            )  # fmt: skip
    return out


def _gather(flat: torch.Tensor, slots: torch.Tensor, plan: ExplicitPlan, name: str) -> torch.Tensor:
    """flat[slots] [L, Hkv, D] into the step's buffer."""
    return torch.index_select(flat, 0, slots, out=plan.scratch(name, (slots.numel(), *flat.shape[1:]), flat.dtype))


def _per_head(x: torch.Tensor, plan: ExplicitPlan, name: str) -> torch.Tensor:
    """[L, Hkv, D] -> [Hkv, L, D]. float32 as a strided view: BLAS reads it as it is, and the
    copy cost a float32 decode 1.5-1.8x its time; bfloat16's products ran 4-6x slower on the
    strided view, so it is copied per head (into the step's buffer)."""
    x = x.transpose(0, 1)
    if x.dtype == torch.float32:
        return x
    return plan.scratch(name, tuple(x.shape), x.dtype).copy_(x)


def _chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offset: int,
    plan: ExplicitPlan,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """q [c, Hq, D] at key positions offset.. of k, v [Hkv, L, D] (the chunk's last query sees the
    last key) -> [c, Hq, D]."""
    c, Hq, D = q.shape
    Hkv, L = k.shape[0], k.shape[1]
    G = Hq // Hkv
    # GQA without expanding K/V: a KV head's G query heads are G x c rows of one product
    # the queries scaled by scale (/ cap) first: one pass over c x D values, not over c x L scores
    qh = (q * (scale if softcap is None else scale / softcap)).view(c, Hkv, G, D).permute(1, 2, 0, 3)
    scores = torch.bmm(qh.reshape(Hkv, G * c, D), k.transpose(1, 2))  # [Hkv, G * c, L]
    if softcap is not None:
        scores.tanh_().mul_(softcap)
    s4 = scores.view(Hkv, G, c, L)
    if c > 1:  # the last c - 1 keys lie past the chunk's first queries
        s4[..., L - c + 1 :].masked_fill_(plan.mask(c, offset - (L - c + 1), c - 1, None), float("-inf"))
    W = plan.window
    if W is not None and L - W > 0:  # the first keys lie before the window of the chunk's last queries
        s4[..., : L - W].masked_fill_(plan.mask(c, offset, L - W, W), float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    else:  # the sink is one more column of the softmax, dropped after it
        sink = sinks.to(torch.float32).view(Hkv, G, 1, 1).expand(Hkv, G, c, 1)
        joined = torch.cat((s4.float(), sink), dim=-1)
        probs = torch.softmax(joined, dim=-1)[..., :L].to(q.dtype).reshape(Hkv, G * c, L)
    o = torch.bmm(probs, v)  # [Hkv, G * c, D]
    return o.view(Hkv, G, c, D).permute(2, 0, 1, 3).reshape(c, Hq, D)
