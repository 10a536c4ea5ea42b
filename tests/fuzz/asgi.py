"""Drive an ASGI app in process (no sockets, no HTTP client): the server fuzz target and the
server regression tests call lily.server's real Starlette app this way."""

from __future__ import annotations

import asyncio


async def request(app, method: str, path: str, body: bytes = b"", *, headers=(),
                  client_stays: bool = False) -> tuple[int, bytes]:
    """Returns (status, response body); status 0 if the app sent no response.

    After the body the client either leaves at once (the next receive() is http.disconnect) or,
    with ``client_stays``, waits for the whole response as a real client does (receive()
    blocks until the response is complete)."""
    sent = False
    done = asyncio.Event()
    out = {"status": 0, "body": b""}

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        if client_stays:
            await done.wait()
        return {"type": "http.disconnect"}

    async def send(msg):
        if msg["type"] == "http.response.start":
            out["status"] = msg["status"]
        elif msg["type"] == "http.response.body":
            out["body"] += msg.get("body", b"")
            if not msg.get("more_body", False):
                done.set()

    hdrs = [(b"content-type", b"application/json")]
    hdrs += [(k.lower().encode(), v.encode()) for k, v in dict(headers).items()]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": hdrs, "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}
    try:
        await app(scope, receive, send)
    except Exception:
        # Starlette's ServerErrorMiddleware re-raises after its handler for `Exception` has
        # answered (lily.server maps LilyError to 400 there); what the client got is the status.
        pass
    return out["status"], out["body"]


async def post(app, path: str, body: bytes) -> tuple[int, bytes]:
    """POST ``body``; the client leaves right after sending it (validation-only callers)."""
    return await request(app, "POST", path, body)
