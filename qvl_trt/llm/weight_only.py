"""Weight-only INT8/INT4 linear weights: TensorRT-LLM 1.2's quantization, and its reference.

Who quantizes and lays out (engine path, QuantAlgo W8A16 / W4A16, no calibration): TensorRT-LLM
itself, at engine build. `convert` stores the decoder's linears in the model dtype and sets
`quant_algo` in config.json; `PretrainedModel.from_checkpoint` (tensorrt_llm/models/
modeling_utils.py) passes the rank file to `preprocess_weights`, which for W8A16 / W4A16 calls
`weight_only_quantize_dict` (tensorrt_llm/models/convert_utils.py): every weight named
qkv/dense/fc/proj/gate `.weight` that is not int8 already is transposed to [in, out] and
quantized by the C++ op torch.ops.trtllm.symmetric_quantize_last_axis_of_batched_matrix,
which also permutes and interleaves the integers for the mixed GEMM of the GPU it runs on
(cpp/tensorrt_llm/kernels/cutlass_kernels/cutlass_preprocessors.cpp `symmetric_quantize` ->
`preprocess_weights_for_mixed_gemm`, by `getSMVersion()`). Its scales become
`<linear>.per_channel_scale`, as WeightOnlyQuantLinear / WeightOnlyQuantRowLinear declare
(tensorrt_llm/quantization/layers.py). No arithmetic of ours, and no Python port of the
layout, stands between the checkpoint and the kernel.

`quantize` below is that op's arithmetic in torch, for the reference decoder: for the
[in, out] weight, per column (= output channel) the float32 max |w| times 1 / 2^(bits-1) is
the scale (so max/128 for INT8, max/8 for INT4, not /127 or /7), each value becomes
round(w / scale) (C `round`: halves away from zero) clipped to [-128, 127] or [-8, 7], 0 where
the scale is 0; the scales are stored in the weight's dtype. INT4 values are packed two per
byte along the output axis, the even column in the low nibble, two's complement: the
op's unprocessed integers. tests/test_llm_engine_trtllm.py checks, where TensorRT-LLM and a
GPU are, that the op's laid-out integers are torch.ops.trtllm.preprocess_weights_for_mixed_gemm
of these and its scales are these, to the bit.

`dequantize` is the GEMM's view of a weight: q x scale, multiplied in the model dtype (the
plugin's kernels convert the integer to the activation type and scale it there), which the
reference decoder runs on `quantize`'s integers of the checkpoint's weights.
"""

from __future__ import annotations

import contextlib

from ..deps import require
from ..dtypes import Dtype, WeightOnly

# The quantized linears: the weights TensorRT-LLM quantizes at engine build (tensorrt_llm/
# models/convert_utils.py weight_only_quantize_dict: names containing qkv.weight, dense.weight,
# fc.weight, proj.weight or gate.weight); lm_head and the embedding stay in the model dtype
# (its quantize_layers excludes *lm_head and *vocab_embedding by default).
QUANTIZED_SUFFIXES = ("attention.qkv.weight", "attention.dense.weight", "mlp.fc.weight",
                      "mlp.gate.weight", "mlp.proj.weight")
# The scales' name suffix: the loader adds them; a converted checkpoint holds none.
SCALE_SUFFIX = "per_channel_scale"
# WeightOnlyQuantLinear pads in/out features that are not multiples of 64 x TP size
# (tensorrt_llm/quantization/layers.py); the checkpoint holds unpadded weights.
FEATURE_MULTIPLE = 64
# Elements quantized at a time: the block's two float32 buffers (512 KiB) stay in a core's L2
# cache through the quantizer's passes over them, and torch's per-call cost stays small.
_BLOCK_ELEMENTS = 1 << 16
# The largest float32 below one half (0.5 - 2^-25): trunc(x + copysign(it, x)) is C `round`.
_BELOW_HALF = 0.49999997


def is_quantized(name: str) -> bool:
    return name.endswith(QUANTIZED_SUFFIXES)


def quantize(weight, mode: WeightOnly, dtype: Dtype) -> tuple:
    """(integers [in, out * bits/8] int8, scales [out] in `dtype`) of an [out, in] weight.

    Row blocks of the weight go through two reused float32 buffers on one thread: on a
    loaded machine every multi-threaded call waits for its slowest thread, and the blocks are
    too small for threads to gain anything. The integers are built [out, in] (contiguous
    writes), packed along out, and transposed once at the end."""
    torch = _torch()
    bits = mode.bits
    out_features, in_features = weight.shape
    low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    ints = torch.empty((out_features, in_features), dtype=torch.int8)
    scales = torch.empty(out_features, dtype=dtype.torch())
    rows = max(1, _BLOCK_ELEMENTS // max(in_features, 1))
    values = torch.empty(rows * in_features, dtype=torch.float32)
    scratch = torch.empty(rows * in_features, dtype=torch.float32)
    below_half = torch.tensor(_BELOW_HALF, dtype=torch.float32)
    with _one_thread(torch):
        for start in range(0, out_features, rows):
            stop = min(start + rows, out_features)
            part = values[:(stop - start) * in_features].view(stop - start, in_features)
            aux = scratch[:part.numel()].view_as(part)
            part.copy_(weight[start:stop])
            scale = torch.abs(part, out=aux).amax(dim=1).mul_(1.0 / (1 << (bits - 1)))
            scales[start:stop] = scale
            # A zero scale means a zero row: divided by 1 it stays 0, as the op writes.
            part.div_(scale.masked_fill_(scale == 0, 1.0)[:, None])
            # C round: for |x| <= 128 (and far beyond), x + copysign(0.5 - 2^-25, x) rounds in
            # float32 up to the next whole number exactly when |x|'s fraction is at least 0.5
            # (every float32 in [-256, 256] checked; the tests put each half and its float32
            # neighbours through it), so truncating it gives round(x). The conversion to int8
            # truncates, and clamping to whole bounds first changes nothing.
            part.add_(torch.copysign(below_half, part, out=aux)).clamp_(low, high)
            ints[start:stop] = part
        if bits == 4:
            ints = (ints[0::2] & 0x0F).bitwise_or_(ints[1::2] << 4)
        return ints.T.contiguous(), scales


def dequantize(ints, scales, mode: WeightOnly, dtype: Dtype):
    """The [out, in] weight the mixed GEMM multiplies by: q x scale in `dtype`."""
    torch = _torch()
    if mode.bits == 4:
        low = torch.bitwise_right_shift(ints << 4, 4)  # arithmetic shift: sign-extends
        high = torch.bitwise_right_shift(ints, 4)
        ints = torch.stack([low, high], dim=-1).reshape(ints.shape[0], -1)
    torch_dtype = dtype.torch()
    return (ints.to(torch_dtype) * scales.to(torch_dtype)[None, :]).T.contiguous()


@contextlib.contextmanager
def _one_thread(torch):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _torch():
    return require("torch", extra="export", why="quantize weights")
