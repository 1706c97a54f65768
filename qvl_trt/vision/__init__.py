"""The vision encoder: export-friendly tower (tower), its I/O contract (spec), ONNX export
(export) and validation against Hugging Face (validate), the engine build with either
TensorRT edition (engine) and the runner (runner); the build stage is
qvl_trt/build/vision_stage.py."""
