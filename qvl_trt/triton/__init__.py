"""The model repository as an artifact (tensor contract, model configs, writer, validator),
what serving it needs and the server that loads it; `runtime/` is the code that runs inside
tritonserver."""
