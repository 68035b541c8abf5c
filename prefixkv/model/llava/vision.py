"""The vision side of a LLaVA 1.5 model: a CLIP vision tower and the MLP projector that maps its
features into the language model's embedding space. `VisionEncoder.encode(pixel_values)` is the
whole path, image pixels -> one embedding per placeholder token. Tensors in, tensors out: what
the outputs are cached under is the model runner's business (encoder_cache.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ..empty_weights import materialize
from .config import LlavaConfig, VisionConfig


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": _quick_gelu,
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in _ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; supported: {', '.join(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


class CLIPAttention(nn.Module):
    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.heads = c.num_attention_heads
        self.head_dim = c.hidden_size // c.num_attention_heads
        self.q_proj = nn.Linear(c.hidden_size, c.hidden_size)
        self.k_proj = nn.Linear(c.hidden_size, c.hidden_size)
        self.v_proj = nn.Linear(c.hidden_size, c.hidden_size)
        self.out_proj = nn.Linear(c.hidden_size, c.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape

        def split(y: torch.Tensor) -> torch.Tensor:
            return y.view(n, t, self.heads, self.head_dim).transpose(1, 2)

        o = F.scaled_dot_product_attention(
            split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x)), scale=self.head_dim**-0.5
        )
        return self.out_proj(o.transpose(1, 2).reshape(n, t, d))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.self_attn = CLIPAttention(c)
        self.layer_norm2 = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.fc1 = nn.Linear(c.hidden_size, c.intermediate_size)
        self.fc2 = nn.Linear(c.intermediate_size, c.hidden_size)
        self.act = activation(c.hidden_act)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(self.layer_norm1(h))
        return h + self.fc2(self.act(self.fc1(self.layer_norm2(h))))


class CLIPVisionTower(nn.Module):
    """Patch embedding + class token + positions, pre-norm, encoder layers. Runs only as many layers
    as the deepest feature layer needs (LLaVA 1.5 reads the second to last)."""

    def __init__(self, c: VisionConfig, num_layers: int) -> None:
        super().__init__()
        self.config = c
        self.patch_embedding = nn.Conv2d(c.num_channels, c.hidden_size, c.patch_size, c.patch_size, bias=False)
        self.class_embedding = nn.Parameter(torch.empty(c.hidden_size))
        self.position_embedding = nn.Embedding(c.num_patches + 1, c.hidden_size)
        self.pre_layrnorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.layers = nn.ModuleList(CLIPEncoderLayer(c) for _ in range(num_layers))

    def forward(self, pixel_values: torch.Tensor, keep: Iterable[int]) -> list[torch.Tensor]:
        """Hidden states number `keep` (0: the embeddings after the pre-norm, i: after layer i)."""
        n = pixel_values.shape[0]
        patches = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(n, 1, -1)
        h = torch.cat([cls, patches], dim=1) + self.position_embedding.weight
        h = self.pre_layrnorm(h)
        wanted = sorted(set(keep))
        out = {0: h} if 0 in wanted else {}
        for i, layer in enumerate(self.layers, start=1):
            h = layer(h)
            if i in wanted:
                out[i] = h
        return [out[i] for i in keep]


class LlavaProjector(nn.Module):
    def __init__(self, in_features: int, out_features: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_features, out_features, bias=bias)
        self.linear_2 = nn.Linear(out_features, out_features, bias=bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class VisionEncoder(nn.Module):
    """pixel values (N, 3, H, W) -> image embeddings (N, tokens_per_image, text hidden size)."""

    def __init__(self, config: LlavaConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.config = config
        n = config.vision.num_hidden_layers
        # hidden_states[i] in transformers' numbering: 0 = embeddings, n = the last layer
        self.keep = [layer % (n + 1) for layer in config.feature_layers]
        with torch.device("meta"):
            self.tower = CLIPVisionTower(config.vision, max(self.keep))
            self.projector = LlavaProjector(
                config.vision.hidden_size * len(self.keep),
                config.text.hidden_size,
                config.projector_hidden_act,
                config.projector_bias,
            )
        materialize(self, device, dtype)
        self.to(dtype)
        self.dtype = dtype

    @property
    def device(self) -> torch.device:
        return self.tower.class_embedding.device

    @property
    def tokens_per_image(self) -> int:
        return self.config.tokens_per_image

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        feats = self.tower(pixel_values.to(self.device, self.dtype), self.keep)
        if self.config.vision_feature_select_strategy == "default":
            feats = [f[:, 1:] for f in feats]  # drop the CLS row
        return self.projector(torch.cat(feats, dim=-1))

    def load_hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Tensors named as in a LLaVA checkpoint, with the "vision_tower." / "multi_modal_projector."
        prefixes already removed by the caller and CLIP's "vision_model." dropped: embeddings.*,
        pre_layrnorm.*, encoder.layers.N.*, multi_modal_projector's linear_1 / linear_2 as
        "projector.*". Layers past the deepest feature layer, and the post-norm, are skipped."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        depth = len(self.tower.layers)
        for name, t in weights:
            target: str | None
            if name.startswith("projector."):
                target = name
            elif name.startswith("embeddings."):
                target = "tower." + name.split(".", 1)[1]
            elif name.startswith("pre_layrnorm."):
                target = "tower." + name
            elif name.startswith("post_layernorm."):
                continue  # only the pooled output uses it, LLaVA does not
            elif name.startswith("encoder.layers."):
                idx, rest = name[len("encoder.layers.") :].split(".", 1)
                if int(idx) >= depth:
                    continue
                rest = rest.replace("mlp.", "")
                target = f"tower.layers.{idx}.{rest}"
            else:
                raise ValueError(f"unexpected vision checkpoint tensor {name!r}")
            if target not in params:
                raise ValueError(f"vision checkpoint tensor {name!r} has no place in the vision tower")
            p = params[target]
            if tuple(p.shape) != tuple(t.shape):
                raise ValueError(f"shape mismatch for {name!r}: checkpoint {tuple(t.shape)}, expected {tuple(p.shape)}")
            with torch.no_grad():
                p.copy_(t.to(p.dtype))
            loaded.add(target)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"vision checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")


def bytes_per_image(config: LlavaConfig, dtype: torch.dtype) -> int:
    """Size of one image's embeddings (what the encoder cache holds per image)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return config.tokens_per_image * config.text.hidden_size * itemsize


__all__ = ["VisionEncoder", "bytes_per_image"]
