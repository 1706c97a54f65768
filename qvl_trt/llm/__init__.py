"""The language model: HF -> TensorRT-LLM checkpoint conversion, the PyTorch reference
decoder that runs the converted checkpoint, and the in-process reference pipeline."""
