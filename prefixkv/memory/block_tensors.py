"""The one owner of every per-block tensor on the worker side, and of the memory budget that
sizes them.

A block id names a slot in every per-block tensor at once: today the K/V cache of each layer;
later hidden-state / stage-output caches, multimodal encoder outputs, offload staging buffers.
Each registers a `BlockTensorSpec`; `num_blocks_for(kv_cache_memory_bytes)` divides ONE budget
by the bytes a block costs across all of them, and `allocate` creates them together. The model
only declares its KV layout (`model.attention.kv_cache_block_shape`) and does the math.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .. import huge_pages
from ..model import ModelConfig, kv_cache_block_shape
from ..model.gated_delta import gated_delta_state_shapes
from ..model.layer_kinds import LINEAR_ATTENTION, SHORT_CONV
from ..model.mamba2 import RecurrentState, recurrent_state_shapes
from .kv_groups import KVCacheGroups


@dataclass(frozen=True)
class BlockTensorSpec:
    """A tensor with one slot per block id: its shape without the block axis, where that axis
    goes, and its dtype."""

    name: str
    shape_per_block: tuple[int, ...]
    dtype: torch.dtype
    block_dim: int = 0
    # Where it lives: None = the device `allocate` is given; "cpu" for caches kept off the device
    # (pinned when the model runs on CUDA).
    device: str | None = None
    # Counted in the budget from the start but allocated on first use (`ensure`): a cache that an
    # engine may never fill costs no memory until it does.
    lazy: bool = False

    @property
    def bytes_per_block(self) -> int:
        n = 1
        for d in self.shape_per_block:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        s = self.shape_per_block
        return (*s[: self.block_dim], num_blocks, *s[self.block_dim :])


class BlockTensors:
    """Registry of per-block tensors; `tensors[name]` once allocated."""

    def __init__(self, specs: list[BlockTensorSpec] | None = None) -> None:
        self.specs: dict[str, BlockTensorSpec] = {}
        self.tensors: dict[str, torch.Tensor] = {}
        self.num_blocks = 0
        self.device = torch.device("cpu")
        for spec in specs or ():
            self.register(spec)

    def register(self, spec: BlockTensorSpec) -> None:
        if self.num_blocks:
            raise RuntimeError("register every per-block tensor before allocating: the budget counts them all")
        if spec.name in self.specs:
            raise ValueError(f"per-block tensor {spec.name!r} is registered twice")
        self.specs[spec.name] = spec

    @property
    def bytes_per_block(self) -> int:
        """What one block id costs across every registered tensor."""
        return sum(s.bytes_per_block for s in self.specs.values())

    def num_blocks_for(self, budget_bytes: int) -> int:
        per_block = self.bytes_per_block
        return budget_bytes // per_block if per_block else 0

    def allocate(self, num_blocks: int, device: torch.device | str) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        self.tensors = {name: self._new(s) for name, s in self.specs.items() if not s.lazy}

    def _new(self, spec: BlockTensorSpec) -> torch.Tensor:
        device = torch.device(spec.device) if spec.device is not None else self.device
        pin = device.type == "cpu" and self.device.type == "cuda"
        if device.type == "cpu" and not pin:  # read block by block all over: huge pages (huge_pages.py)
            # faulted in by a thread while the engine goes on starting (huge_pages.py)
            return huge_pages.zeros(spec.shape(self.num_blocks), spec.dtype, populate="background")
        return torch.zeros(spec.shape(self.num_blocks), dtype=spec.dtype, device=device, pin_memory=pin)

    def ensure(self, name: str) -> torch.Tensor:
        """The tensor `name`, allocated now if it is a lazy one used for the first time."""
        tensor = self.tensors.get(name)
        if tensor is None:
            if not self.num_blocks:
                raise RuntimeError("allocate the block tensors before using them")
            tensor = self.tensors[name] = self._new(self.specs[name])  # KeyError: never registered
        return tensor

    def group(self, prefix: str) -> list[torch.Tensor]:
        """The allocated tensors whose names start with `prefix`, in registration order."""
        return [t for name, t in self.tensors.items() if name.startswith(prefix)]

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        """One K/V tensor per layer, as the model's forward takes them."""
        return self.group(KV_PREFIX)

    def layer_caches(self, config: ModelConfig, block_size: int, groups: KVCacheGroups | None = None) -> list[Any]:
        """What the model's forward takes per layer: its K/V tensor (with KV-cache `groups`, the
        tensor its group shares, kv_groups.py; a KV-shared layer its source layer's), or for a
        recurrent layer (every layer of Mamba2, the Mamba layers of a hybrid) a `RecurrentState`
        (SSM and conv state per block), or for a layer with both (Falcon-H1) the pair (K/V
        tensor, RecurrentState)."""
        if groups is not None:
            shared = self.kv_caches
            return [shared[j] for j in groups.layer_tensor(config.num_hidden_layers)]
        if not config.is_recurrent:  # a KV-shared layer (Gemma 4) gets its source layer's tensor
            sources = (config.kv_source_layer(i) for i in range(config.num_hidden_layers))
            return [self.tensors[f"{KV_PREFIX}{j}"] for j in sources]
        caches: list[Any] = []
        for i in range(config.num_hidden_layers):
            kv = self.tensors[f"{KV_PREFIX}{i}"] if config.is_attention_layer(i) else None
            state = None
            if config.is_recurrent_layer(i):
                ssm = self.tensors.get(f"{STATE_PREFIX}{i}.ssm")  # none for a short convolution
                state = RecurrentState(ssm, self.tensors[f"{STATE_PREFIX}{i}.conv"], block_size)
            caches.append(state if kv is None else kv if state is None else (kv, state))
        return caches


KV_PREFIX = "kv."
# a recurrent layer's state after each block's last computed token, in place of K/V rows
STATE_PREFIX = "state."


def recurrent_state_specs(config: ModelConfig, layer: int, dtype: torch.dtype) -> list[BlockTensorSpec]:
    """A recurrent layer's SSM (or delta rule) state and conv state, one slot per block; a short
    convolution's conv state alone."""
    kind = config.layer_types[layer]
    conv_spec = f"{STATE_PREFIX}{layer}.conv"
    if kind == SHORT_CONV:
        return [BlockTensorSpec(conv_spec, (config.hidden_size, config.short_conv_kernel - 1), dtype)]
    ssm, conv = gated_delta_state_shapes(config) if kind == LINEAR_ATTENTION else recurrent_state_shapes(config)
    return [BlockTensorSpec(f"{STATE_PREFIX}{layer}.ssm", ssm, dtype), BlockTensorSpec(conv_spec, conv, dtype)]


def kv_cache_specs(
    config: ModelConfig, block_size: int, dtype: torch.dtype, groups: KVCacheGroups | None = None
) -> list[BlockTensorSpec]:
    """Per layer, in layer order: attention's K/V in the layout the model's paged attention reads
    (each layer its own heads and head size; none for a KV-shared layer, which reads another's),
    and/or a Mamba mixer's per-block state (one block id names all, so a block's bytes count
    all). With KV-cache `groups` (attention only), one K/V spec per layer of a group: every
    group's layers share them (kv_groups.py)."""
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")

    def kv_spec(name: str, layer: int) -> BlockTensorSpec:
        heads, head_dim = config.layer_num_kv_heads(layer), config.layer_head_dim(layer)
        shape, block_dim = kv_cache_block_shape(block_size, heads, head_dim, config.is_mla)
        return BlockTensorSpec(name, shape, dtype, block_dim)

    if groups is not None:  # (groups are planned for uniform layers only: layer 0's shape is every one's)
        return [kv_spec(f"{KV_PREFIX}{j}", 0) for j in range(groups.group_size)]
    specs: list[BlockTensorSpec] = []
    for layer in range(config.num_hidden_layers):
        if config.is_attention_layer(layer) and config.kv_source_layer(layer) == layer:
            specs.append(kv_spec(f"{KV_PREFIX}{layer}", layer))
        if config.is_recurrent_layer(layer):
            specs.extend(recurrent_state_specs(config, layer, dtype))
    return specs


def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype = torch.float32) -> int:
    """Bytes one block id costs in the K/V caches of all layers."""
    return BlockTensors(kv_cache_specs(config, block_size, dtype)).bytes_per_block


def allocate_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> list[Any]:
    """Zeroed K/V caches (a recurrent model: states) for every layer (for code that runs the model
    without an engine)."""
    if num_blocks <= 0 or block_size <= 0:
        raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
    tensors = BlockTensors(kv_cache_specs(config, block_size, dtype))
    tensors.allocate(num_blocks, device)
    return tensors.layer_caches(config, block_size)
