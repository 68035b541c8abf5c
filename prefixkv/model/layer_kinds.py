"""The layer kinds of `ModelConfig.layer_types`.

Two attention kinds, with HF's names; a recurrent (Mamba2 mixer) layer, which keeps a state per
block in place of K/V rows; a layer with both a Mamba2 mixer and full attention side by side,
keeping both (HF's Falcon-H1 name); a gated delta net layer (Qwen3-Next's linear attention),
a recurrent state per block as MAMBA; and a gated short convolution (LFM2's), whose state per
block is its convolution's last inputs alone.
"""

from __future__ import annotations

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
MAMBA = "mamba"
HYBRID = "hybrid"
LINEAR_ATTENTION = "linear_attention"
SHORT_CONV = "conv"

LAYER_KINDS = (FULL_ATTENTION, SLIDING_ATTENTION, MAMBA, HYBRID, LINEAR_ATTENTION, SHORT_CONV)
# the kinds that keep a state per block instead of (or beside) K/V rows
RECURRENT_KINDS = (MAMBA, HYBRID, LINEAR_ATTENTION, SHORT_CONV)
