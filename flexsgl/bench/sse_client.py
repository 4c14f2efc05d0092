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
    events, raw, body = [], b"", b""  # raw: bytes read and not yet unframed; body: the stream's text so far
    while True:
        piece = await reader.read(1 << 16)  # every event that arrived, in one read: few awaits per step
        now = time.perf_counter()
        if piece:
            raw += piece
        if chunked:
            while True:  # unframe each whole chunk: SIZE CRLF DATA CRLF
                eol = raw.find(b"\r\n")
                if eol < 0:
                    break
                size = int(raw[:eol].split(b";", 1)[0] or b"0", 16)
                if size == 0:  # the last chunk: what came before it is read below
                    piece = b""
                    break
                if len(raw) < eol + 2 + size + 2:
                    break
                body += raw[eol + 2:eol + 2 + size]
                raw = raw[eol + 2 + size + 2:]
        else:
            body, raw = body + raw, b""
        end = body.rfind(b"\n\n")
        if end >= 0:
            whole, body = body[:end], body[end + 2:]
            for line in whole.split(b"\n"):
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:]
                if payload == b"[DONE]":
                    return events
                events.append((now, json.loads(payload)))
        if not piece:
            break
    raise HTTPError("the stream ended without data: [DONE]")
