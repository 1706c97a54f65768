"""The Qwen3-VL vision tower re-written for export: one image per call, no attention mask,
no data-dependent splits, position/rotary indices from the host (qvl_trt.mm.vision_index).

Numerically it is the Hugging Face tower (`Qwen3VLVisionModel`) for one image, fed the uint8
pixels that HF's processor rescales and normalises: the graph does that itself, by looking
each value up in the processor's fp32 table (qvl_trt.mm.pixels.PixelConfig.lut), which gives
HF's float pixels to the last bit, before the patch embedding casts them to the graph's
dtype (as a float input would be). The table index goes through float32 (exact for 0..255)
because full TensorRT casts a uint8 input to nothing else (spec.UINT8_INPUT_CAST); a lookup,
not arithmetic, keeps the values exact whatever a backend's float math fuses. Precision
policy of a reduced-precision graph (the graph must carry it: TensorRT-RTX and strongly typed
TensorRT take precision from the graph, not from builder flags): LayerNorms run in fp32
between explicit casts; the position-table weighting and the rotary rotation of q/k run in
fp32, as HF does them; everything else runs in the graph's dtype.

Import this module only after `require("torch", ...)`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint import VISION_PREFIX, Checkpoint, VisionDims
from ..dtypes import Dtype
from ..errors import CheckpointError
from ..mm.pixels import PixelConfig
from ..mm.vision_index import vision_index_tensors
from .spec import UINT8_INPUT_CAST

LAYER_NORM_EPS = 1e-6
DEFAULT_ROPE_THETA = 10_000.0
# transformers' names of the block activation -> the tanh approximation flag of F.gelu
_BLOCK_ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}

class Fp32LayerNorm(nn.Module):
    """LayerNorm evaluated in fp32 whatever its input's dtype; parameters stay fp32."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.bias = nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.layer_norm(x.float(), self.weight.shape, self.weight, self.bias, LAYER_NORM_EPS)
        return y.to(x.dtype)


def rotary_inv_freq(dims: VisionDims, theta: float) -> torch.Tensor:
    """head_dim/4 inverse frequencies, shared by the row and the column axis (fp32)."""
    half = dims.head_dim // 2
    return 1.0 / theta ** (torch.arange(0, half, 2, dtype=torch.float32) / half)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of q or k ([N, heads, head_dim]) in fp32, back in x's dtype."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)


class VisionBlock(nn.Module):
    def __init__(self, dims: VisionDims) -> None:
        super().__init__()
        h = dims.hidden_size
        self.num_heads, self.head_dim = dims.num_heads, dims.head_dim
        self.approximate = _BLOCK_ACTIVATIONS[dims.hidden_act]
        self.norm1, self.norm2 = Fp32LayerNorm(h), Fp32LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1 = nn.Linear(h, dims.intermediate_size)
        self.fc2 = nn.Linear(dims.intermediate_size, h)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv(self.norm1(x)).view(n, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.unbind(1)  # [N, heads, head_dim] each
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        # [1, heads, N, head_dim]: one image, every patch attends to every patch.
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim ** -0.5)
        x = x + self.proj(attn[0].transpose(0, 1).reshape(n, -1))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x)), approximate=self.approximate))


class PatchMerger(nn.Module):
    """2x2 patch grouping + MLP. The main merger normalises each patch before grouping; the
    DeepStack mergers normalise the grouped vector."""

    def __init__(self, dims: VisionDims, *, norm_after_grouping: bool) -> None:
        super().__init__()
        grouped = dims.hidden_size * dims.spatial_merge_size ** 2
        self.grouped = grouped
        self.norm_after_grouping = norm_after_grouping
        self.norm = Fp32LayerNorm(grouped if norm_after_grouping else dims.hidden_size)
        self.fc1 = nn.Linear(grouped, grouped)
        self.fc2 = nn.Linear(grouped, dims.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[0] // (self.grouped // x.shape[1])
        if self.norm_after_grouping:
            x = self.norm(x.reshape(tokens, self.grouped))
        else:
            x = self.norm(x).reshape(tokens, self.grouped)
        return self.fc2(F.gelu(self.fc1(x)))


class VisionTower(nn.Module):
    """forward(pixel_values [N, patch_dim] u8, pos_interp_indices [N, 4] i32,
    pos_interp_weights [N, 4] f32, rope_position_ids [N, 2] i32) ->
    (image_embeds, deepstack_0, ..., deepstack_{K-1}), each [N/4, out_hidden]."""

    def __init__(self, dims: VisionDims, pixels: PixelConfig, *,
                 rope_theta: float = DEFAULT_ROPE_THETA) -> None:
        super().__init__()
        if dims.hidden_act not in _BLOCK_ACTIVATIONS:
            raise CheckpointError(
                f"vision_config.hidden_act {dims.hidden_act!r} is not one of "
                f"{', '.join(_BLOCK_ACTIVATIONS)}; this is not a Qwen3-VL vision tower")
        self.dims = dims
        if pixels.patch_dim != dims.patch_dim:
            raise CheckpointError(f"preprocessor_config.json makes patches of {pixels.patch_dim} "
                                  f"values, the vision tower takes {dims.patch_dim}; re-download "
                                  "the checkpoint's preprocessor_config.json")
        self.register_buffer("pixel_lut", torch.from_numpy(pixels.lut), persistent=False)
        self.register_buffer("lut_offsets", torch.from_numpy(pixels.lut_offsets),
                             persistent=False)
        # The Conv3d patch embedding (kernel = stride = one patch) as a MatMul.
        self.patch_embed = nn.Linear(dims.patch_dim, dims.hidden_size)
        self.pos_embed = nn.Parameter(torch.zeros(dims.num_position_embeddings, dims.hidden_size))
        self.register_buffer("inv_freq", rotary_inv_freq(dims, rope_theta), persistent=False)
        self.blocks = nn.ModuleList(VisionBlock(dims) for _ in range(dims.depth))
        self.merger = PatchMerger(dims, norm_after_grouping=False)
        self.deepstack_mergers = nn.ModuleList(
            PatchMerger(dims, norm_after_grouping=True) for _ in dims.deepstack_visual_indexes)

    def forward(self, pixel_values: torch.Tensor, pos_interp_indices: torch.Tensor,
                pos_interp_weights: torch.Tensor, rope_position_ids: torch.Tensor) \
            -> tuple[torch.Tensor, ...]:
        dtype = self.patch_embed.weight.dtype
        n = pixel_values.shape[0]
        pixels = pixel_values.to(UINT8_INPUT_CAST.torch()).to(torch.int32)
        index = (pixels + self.lut_offsets).reshape(-1)
        x = self.patch_embed(self.pixel_lut.index_select(0, index).reshape(n, -1).to(dtype))
        # Bilinear resampling of the learned position table: 4 weighted rows per patch.
        rows = self.pos_embed.index_select(0, pos_interp_indices.reshape(-1))
        rows = rows.reshape(n, 4, -1).float()  # [N, 4, hidden]
        x = x + (rows * pos_interp_weights.unsqueeze(-1)).sum(dim=1).to(dtype)
        # 2D rotary: head_dim/4 frequencies for the patch row, as many for the column.
        freqs = (rope_position_ids.float().unsqueeze(-1) * self.inv_freq).reshape(n, -1)
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)  # [N, 1, head_dim]
        cos, sin = emb.cos(), emb.sin()
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin)
            if i in self.dims.deepstack_visual_indexes:
                k = self.dims.deepstack_visual_indexes.index(i)
                deepstack.append(self.deepstack_mergers[k](x))
        return (self.merger(x), *deepstack)


def hf_state_dict_map(dims: VisionDims) -> dict[str, str]:
    """Our parameter name -> the checkpoint tensor name it is loaded from."""
    m = {"patch_embed.weight": "patch_embed.proj.weight",
         "patch_embed.bias": "patch_embed.proj.bias", "pos_embed": "pos_embed.weight"}
    for i in range(dims.depth):
        for ours, theirs in (("norm1", "norm1"), ("norm2", "norm2"), ("qkv", "attn.qkv"),
                             ("proj", "attn.proj"), ("fc1", "mlp.linear_fc1"),
                             ("fc2", "mlp.linear_fc2")):
            for leaf in ("weight", "bias"):
                m[f"blocks.{i}.{ours}.{leaf}"] = f"blocks.{i}.{theirs}.{leaf}"
    mergers = [("merger", "merger")] + [
        (f"deepstack_mergers.{k}", f"deepstack_merger_list.{k}")
        for k in range(dims.deepstack_count)]
    for ours, theirs in mergers:
        for layer, hf_layer in (("norm", "norm"), ("fc1", "linear_fc1"), ("fc2", "linear_fc2")):
            for leaf in ("weight", "bias"):
                m[f"{ours}.{layer}.{leaf}"] = f"{theirs}.{hf_layer}.{leaf}"
    return {ours: VISION_PREFIX + theirs for ours, theirs in m.items()}


def vision_rope_theta(config: dict[str, Any]) -> float:
    vc = config.get("vision_config", {})
    theta = (vc.get("rope_parameters") or {}).get("rope_theta", vc.get("rope_theta"))
    return float(theta) if theta is not None else DEFAULT_ROPE_THETA


def load_vision_tower(ckpt: Checkpoint, dtype: Dtype | str = Dtype.FLOAT32) -> VisionTower:
    """The checkpoint's vision tower in `dtype` (float32, float16 or bfloat16), eval mode;
    LayerNorm parameters stay fp32. Tensors are read one at a time and cast as they come,
    so peak memory is about one copy of the tower."""
    dims, weights = ckpt.vision, Dtype(dtype).torch()
    pixels = PixelConfig.of_checkpoint(ckpt)
    with torch.device("meta"):
        tower = VisionTower(dims, pixels, rope_theta=vision_rope_theta(ckpt.config))
    norms = {f"{name}.{leaf}" for name, m in tower.named_modules()
             if isinstance(m, Fp32LayerNorm) for leaf in ("weight", "bias")}
    state = {}
    for ours, theirs in hf_state_dict_map(dims).items():
        tensor = ckpt.load(theirs).to(torch.float32 if ours in norms else weights)
        if ours == "patch_embed.weight":
            tensor = tensor.reshape(dims.hidden_size, dims.patch_dim)
        state[ours] = tensor
    tower.load_state_dict(state, strict=True, assign=True)
    # The buffers are computed, not loaded: build them for real (meta tensors hold no values).
    tower.inv_freq = rotary_inv_freq(dims, vision_rope_theta(ckpt.config))
    tower.pixel_lut = torch.from_numpy(pixels.lut)
    tower.lut_offsets = torch.from_numpy(pixels.lut_offsets)
    return tower.eval().requires_grad_(False)


def example_inputs(ckpt: Checkpoint, grid: tuple[int, int, int], *, seed: int = 0) -> tuple:
    """Torch inputs for one image of patch grid `grid`: random uint8 pixels (every temporal
    frame its own, as a video's would be) and the host index tensors."""
    index = vision_index_tensors(grid, ckpt.vision)
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (index.num_patches, ckpt.vision.patch_dim), np.uint8)
    return (torch.from_numpy(pixels),
            *(torch.from_numpy(a) for a in index.as_dict().values()))
