"""POST a body to an ASGI app in process (no sockets, no HTTP client): the server fuzz target
and the server regression tests drive lily.server's real Starlette app this way."""

from __future__ import annotations


async def post(app, path: str, body: bytes) -> tuple[int, bytes]:
    """Returns (status, response body); status 0 if the app sent no response."""
    sent = False
    out = {"status": 0, "body": b""}

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return {"type": "http.disconnect"}

    async def send(msg):
        if msg["type"] == "http.response.start":
            out["status"] = msg["status"]
        elif msg["type"] == "http.response.body":
            out["body"] += msg.get("body", b"")

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 8000)}
    try:
        await app(scope, receive, send)
    except Exception:
        # Starlette's ServerErrorMiddleware re-raises after its handler for `Exception` has
        # answered (lily.server maps LilyError to 400 there); what the client got is the status.
        pass
    return out["status"], out["body"]
