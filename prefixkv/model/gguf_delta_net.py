"""Qwen3-Next's and Qwen3.5's GGUF tensors (llama.cpp's `qwen3next`, `qwen35`, `qwen35moe`) back in
transformers' names and layouts, which model/qwen3_next.py and model/qwen3_5.py load.

What llama.cpp's converter (Qwen3NextModel and its Qwen3.5 subclasses) changed, undone here:
- the gated delta net's projections: Qwen3-Next's in_proj_qkvz split into attn_qkv (every q head,
  every k head, every v head) and attn_gate (z), its in_proj_ba kept whole (ssm_ba, per q/k head
  its value heads' b rows then their a rows); Qwen3.5's in_proj_qkv / _z / _b / _a kept apart
  (attn_qkv, attn_gate, ssm_beta, ssm_alpha);
- Qwen3.5's value heads reordered where there are more of them than q/k heads: transformers keeps
  them grouped by q/k head (g0v0, g0v1, ..., g1v0, ...), the file tiled (g0v0, g1v0, ..., g0v1,
  ...), in every tensor indexed by value head (v rows, z rows, b, a, A, dt bias, the convolution's
  v channels, the output projection's columns);
- A_log stored as A = -exp(A_log), dt_bias named ssm_dt.bias, the convolution kernel squeezed to
  [channels, kernel];
- every zero-centred norm stored as 1 + w (the delta net's own gated norm is a plain one);
- Qwen3.5's multi-token-prediction block appended as the last `nextn_predict_layers` blocks, which
  the causal LM does not load (transformers' neither).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from .config import ModelConfig
from .gguf_names import BLOCK_TENSOR, GGUF_GLOBAL_MAP, GGUF_LAYER_MAP

DELTA_NET_ARCHITECTURES = ("qwen3next", "qwen35", "qwen35moe")

# the Llama decoder's names (attention, MLPs, routed and shared experts), then the delta nets'
_LAYER = {
    **GGUF_LAYER_MAP,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate_up_exps.weight": "mlp.experts.gate_up_proj",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_a": "linear_attn.A_log",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
}
_CENTRED = ("attn_norm.weight", "post_attention_norm.weight", "attn_q_norm.weight", "attn_k_norm.weight")


def delta_net_tensors_from_gguf(
    tensors: Iterator[tuple[str, np.ndarray]], g_arch: str, config: ModelConfig
) -> Iterator[tuple[str, np.ndarray]]:
    """(transformers name, array) for each (GGUF name, dequantized array) of a `g_arch` file; the
    multi-token-prediction blocks left out. ValueError for a tensor with no place."""
    tiled = g_arch != "qwen3next"  # Qwen3.5's converter tiles the value heads
    Hk, dk, dv = config.linear_num_key_heads, config.linear_key_head_dim, config.linear_value_head_dim
    r = config.linear_num_value_heads // Hk if Hk else 1
    for name, w in tensors:
        if name in GGUF_GLOBAL_MAP:
            yield GGUF_GLOBAL_MAP[name], (w - 1 if name == "output_norm.weight" else w)
            continue
        m = BLOCK_TENSOR.match(name)
        if m is None:
            raise ValueError(f"unsupported GGUF tensor {name!r} in a {g_arch} file")
        layer, rest = int(m.group(1)), m.group(2)
        if layer >= config.num_hidden_layers:
            continue  # the multi-token-prediction block
        prefix = f"model.layers.{layer}."
        if rest == "ssm_ba.weight":  # Qwen3-Next: per q/k head, b rows then a rows
            ba = w.reshape(Hk, 2 * r, -1)
            yield prefix + "linear_attn.in_proj_b.weight", ba[:, :r].reshape(Hk * r, -1)
            yield prefix + "linear_attn.in_proj_a.weight", ba[:, r:].reshape(Hk * r, -1)
            continue
        if rest not in _LAYER:
            raise ValueError(f"unsupported GGUF tensor {name!r} in a {g_arch} file")
        if rest in _CENTRED:
            w = w - 1
        elif rest == "ssm_a":
            if not (w < 0).all():
                raise ValueError(f"GGUF tensor {name!r} holds A = -exp(A_log): every entry must be negative")
            w = np.log(-w.astype(np.float64)).astype(np.float32)
        if tiled and r > 1:
            w = _grouped(rest, w, Hk, r, dk, dv)
        if rest == "ssm_conv1d.weight":
            w = w.reshape(w.shape[0], 1, w.shape[-1])
        yield prefix + _LAYER[rest], w


def _grouped(rest: str, w: np.ndarray, Hk: int, r: int, dk: int, dv: int) -> np.ndarray:
    """A tensor indexed by value head with the heads back in grouped order (the converter's tiled
    order undone); any other tensor as it is."""
    if rest == "attn_qkv.weight":
        return np.concatenate((w[: 2 * Hk * dk], _untile(w[2 * Hk * dk :], 0, Hk, r, dv)))
    if rest == "attn_gate.weight":
        return _untile(w, 0, Hk, r, dv)
    if rest in ("ssm_beta.weight", "ssm_alpha.weight", "ssm_a", "ssm_dt.bias"):
        return _untile(w, 0, Hk, r, 1)
    if rest == "ssm_conv1d.weight":
        return np.concatenate((w[: 2 * Hk * dk], _untile(w[2 * Hk * dk :], 0, Hk, r, dv)))
    if rest == "ssm_out.weight":
        return _untile(w, 1, Hk, r, dv)
    return w


def _untile(w: np.ndarray, axis: int, Hk: int, r: int, d: int) -> np.ndarray:
    """Along `axis`, [r, Hk, d] (tiled: head j of every group, then head j + 1) -> [Hk, r, d]."""
    shape = w.shape
    tiled = w.reshape(*shape[:axis], r, Hk, d, *shape[axis + 1 :])
    return np.ascontiguousarray(np.swapaxes(tiled, axis, axis + 1)).reshape(shape)
