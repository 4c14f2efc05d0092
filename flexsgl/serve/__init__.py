"""`flexsgl serve`: an OpenAI-compatible HTTP server over one LLM.

app.py (routes, errors), protocol.py (request bodies -> SamplingParams), engine_process.py (the
process that owns the LLM and its step loop), engine_client.py (the HTTP process's side of it),
messages.py (what the two say to each other), responses.py (response bodies and stream chunks),
chat.py (chat templates), metrics.py (Prometheus text). FastAPI and uvicorn come with the `serve` extra.
"""

from __future__ import annotations


def serve(engine_config, host: str = "127.0.0.1", port: int = 8000, served_model_name: str | None = None,
          log_level: str = "warning") -> None:
    """Serve `engine_config`'s model until interrupted. The model loads in the engine process once
    the server listens; /health answers 503 until it is ready."""
    import uvicorn

    from flexsgl.model.presets import DEFAULT_MODEL
    from flexsgl.serve.app import build_app
    from flexsgl.serve.engine_client import EngineClient
    from flexsgl.serve.metrics import Metrics

    name = served_model_name or engine_config.model or DEFAULT_MODEL
    app = build_app(EngineClient(engine_config, Metrics(name)), name)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
