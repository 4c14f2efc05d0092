"""`flexsgl serve`: an OpenAI-compatible HTTP server over one LLM.

app.py (routes, errors), protocol.py (request bodies -> SamplingParams), engine_thread.py (the
thread that owns the step loop), responses.py (response bodies and stream chunks), chat.py (chat
templates), metrics.py (Prometheus text). FastAPI and uvicorn come with the `serve` extra.
"""

from __future__ import annotations


def serve(engine_config, host: str = "127.0.0.1", port: int = 8000, served_model_name: str | None = None,
          log_level: str = "warning") -> None:
    """Serve `engine_config`'s model until interrupted. The model loads on the engine thread once
    the server listens; /health answers 503 until it is ready."""
    import uvicorn

    from flexsgl.engine import LLM
    from flexsgl.model.presets import DEFAULT_MODEL
    from flexsgl.serve.app import build_app
    from flexsgl.serve.engine_thread import EngineThread
    from flexsgl.serve.metrics import Metrics

    name = served_model_name or engine_config.model or DEFAULT_MODEL
    metrics = Metrics(name)

    def make_llm():
        llm = LLM(engine_config)
        metrics.total_pages = llm.pool.num_pages - 1
        return llm

    app = build_app(EngineThread(make_llm, metrics), name)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
