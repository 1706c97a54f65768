"""The model repository as an artifact: the tensor contract, the stock backend's parameters,
its layout, model configs, the writer and the validator; `runtime/` is the code that runs
inside tritonserver."""
