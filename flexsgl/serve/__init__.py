"""`flexsgl serve`: an OpenAI-compatible HTTP server over one LLM.

app.py (routes, ServerOptions), errors.py (OpenAI error bodies, the API key and body limit),
protocol.py (request bodies -> SamplingParams), intake.py (the work before the engine, off the
event loop), engine_process.py (the process that owns the LLM and its step loop), engine_client.py
(the HTTP process's side of it), messages.py (what the two say to each other), responses.py
(response bodies and stream chunks), message.py (a chat choice's reasoning, content and tool
calls), reasoning.py and tools.py (their parsers), chat.py (chat templates), metrics.py
(Prometheus). FastAPI, uvicorn and prometheus_client come with the `serve` extra, xgrammar (for
structured outputs and required tool calls) too.
"""

from __future__ import annotations

import errno
import logging
import signal
import socket

from flexsgl.log import logger


class PortInUseError(OSError):
    """The address the server was to listen on is taken."""


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port) and listening; PortInUseError (one sentence) if it is taken,
    OSError for another reason it cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise PortInUseError(f"Port {port} on {host} is already in use; stop what listens there or pick "
                                 "another with --port.") from None
        raise OSError(f"Cannot listen on {host}:{port} ({e.strerror or e}).") from None
    sock.listen(2048)
    return sock


def serve(engine_config, host: str = "127.0.0.1", port: int = 8000, served_model_name: str | list[str] | None = None,
          log_level: str = "warning", options=None, sock: socket.socket | None = None) -> None:
    """Serve `engine_config`'s model until interrupted. The model loads in the engine process once
    the server listens; /health answers 503 until it is ready. `sock`: a socket listen() bound
    already (else one is bound here)."""
    import uvicorn

    from flexsgl.model.presets import DEFAULT_MODEL
    from flexsgl.serve.app import build_app
    from flexsgl.serve.engine_client import EngineClient
    from flexsgl.serve.metrics import Metrics

    sock = sock or listen(host, port)
    names = ([served_model_name] if isinstance(served_model_name, str) else served_model_name) or \
        [engine_config.model or DEFAULT_MODEL]
    engine = EngineClient(engine_config, Metrics(names[0]))
    app = build_app(engine, names, options)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if not self.should_exit:  # the first Ctrl-C or SIGTERM: the requests in flight end now
                engine.drain()
            elif sig == signal.SIGINT:  # a second Ctrl-C: uvicorn exits at once, and would log each
                logging.getLogger("uvicorn.error").setLevel(logging.CRITICAL)  # task it leaves as a traceback
            super().handle_exit(sig, frame)

    server = Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5))
    where = sock.getsockname()
    engine.on_ready = lambda: logger.info(f"serving {names[0]} on http://{where[0]}:{where[1]}")
    # Not a signal, which uvicorn would end the process with (status 143): the requests in flight end
    # with the engine's error, then the server exits 1, as vLLM's does, for a supervisor to restart.
    engine.on_start_failed = engine.on_engine_died = lambda: setattr(server, "should_exit", True)
    try:
        server.run(sockets=[sock])
    finally:
        engine.stop()  # also where a second Ctrl-C made uvicorn skip the app's shutdown
    if engine.failure is not None and not engine.draining:  # (not after a Ctrl-C or SIGTERM's stop)
        raise SystemExit(1)  # the engine said why
