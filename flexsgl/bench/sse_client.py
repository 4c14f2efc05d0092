"""A minimal asyncio HTTP/1.1 client for one streamed OpenAI completion (server-sent events), with
nothing but the standard library, so that `flexsgl bench --workload serve` adds no dependency and
the client's own cost per token stays small (one JSON parse per event)."""

from __future__ import annotations

import asyncio
import json
import time
from urllib.parse import urlsplit


class HTTPError(RuntimeError):
    pass


async def stream_post(base_url: str, path: str, body: dict, timeout: float) -> list[tuple[float, dict]]:
    """POST `body` and collect each event of the stream with the time it arrived, until `data: [DONE]`."""
    url = urlsplit(base_url)
    host, port = url.hostname, url.port or 80
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    try:
        data = json.dumps(body).encode()
        head = (f"POST {url.path.rstrip('/')}{path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
                f"Content-Type: application/json\r\nAccept: text/event-stream\r\nContent-Length: {len(data)}\r\n"
                "Connection: close\r\n\r\n")
        writer.write(head.encode() + data)
        await writer.drain()
        return await asyncio.wait_for(_read_events(reader), timeout)
    finally:
        writer.close()


async def _read_events(reader: asyncio.StreamReader) -> list[tuple[float, dict]]:
    status = (await reader.readline()).decode().split()
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip().lower()
    chunked = headers.get("transfer-encoding") == "chunked"
    if len(status) < 2 or status[1] != "200":
        raise HTTPError(f"HTTP {' '.join(status[1:])}: {(await reader.read()).decode(errors='replace')[:500]}")
    events, buf = [], b""
    while True:
        if chunked:
            size = int((await reader.readline()).strip() or b"0", 16)
            if size == 0:
                break
            piece = (await reader.readexactly(size + 2))[:size]  # the chunk and its CRLF
        else:
            piece = await reader.read(65536)
            if not piece:
                break
        now = time.perf_counter()
        buf += piece
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            for line in event.splitlines():
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:]
                if payload == b"[DONE]":
                    return events
                events.append((now, json.loads(payload)))
    raise HTTPError("the stream ended without data: [DONE]")
