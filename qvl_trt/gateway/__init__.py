"""The OpenAI-compatible gateway in front of a Triton deployment: `POST /v1/chat/completions`,
`GET /v1/models`, readiness, Prometheus metrics and a chat page, on aiohttp, talking to
Triton's gRPC endpoint with tritonclient's asyncio client (`qvl-trt gateway`, or
`qvl-trt serve --openai-port`)."""
