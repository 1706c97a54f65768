"""Code that runs inside tritonserver's python backend, one module per model folder of the
repository (preprocessing, vision_encoder, postprocessing, the reference tensorrt_llm,
tensorrt_llm_bls) plus `backend`, the python-backend helpers they share."""
