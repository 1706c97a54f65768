"""qvl-trt: Hugging Face Qwen3-VL -> TensorRT engines -> Triton model repository."""

__version__ = "0.1.0"
