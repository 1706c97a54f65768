"""Serving a written repository: what serving it needs (`needs`), the tritonserver process
(`server`), its supervision and readiness (`supervisor`), the OpenAI gateway as a child
process (`gateway_process`), the load check behind `qvl-trt doctor --repo` and `serve()`
(`run`), the one entry `qvl-trt serve` calls."""
