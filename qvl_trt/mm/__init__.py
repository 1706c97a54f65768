"""Host-side multimodal logic shared by the Triton models, the reference runtime and tests."""
