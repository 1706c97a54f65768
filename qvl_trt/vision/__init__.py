"""The vision encoder: export-friendly tower (tower), its I/O contract (spec), ONNX export
(export) and validation against Hugging Face (validate), the engine build with either
TensorRT edition (engine), the runner (runner), and the step that turns a request's vision
items into its prompt table (step) through the row cache (cache)."""
