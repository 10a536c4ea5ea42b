"""Connection limits for `lily serve`: what a slow or hostile client may hold, and for how long.

uvicorn (the ASGI server under `lily serve`) bounds the size of a request's headers (h11: 16 KiB)
and closes idle keep-alive connections, but has no deadline for reading a request: a client
that sends its headers a byte at a time, or a body slower than its Content-Length promised
(slowloris), holds its connection, and a file descriptor, for as long as it likes. Enough of
them and the process runs out of descriptors (EMFILE) and refuses everyone.

``limited_protocol(limits)`` is uvicorn's own HTTP/1.1 protocol (``H11Protocol``) with three
additions, chosen by a test that held 32 slow connections against each candidate stack
(``benchmarks/slowloris.py``; results in docs/server.md):

- a deadline for the headers of every request (from its first byte, or from the connection's
  opening for the first request) and one for its body (from the end of the headers); a
  request that misses either gets ``408 Request Timeout`` (when no response has started) and
  its connection is closed;
- a cap on open connections: one over the cap is answered ``503`` and closed at once, so a
  flood costs a descriptor only for the moment it takes to refuse it; and a short listen
  backlog, which is also how many connections asyncio accepts in one go. A batch accepted in
  one event-loop turn gets its transports the next turn and ``connection_made`` (the refusal)
  the turn after; a refused connection's descriptor closes one turn later still. Meanwhile the
  next batches are accepted, so a burst can hold the cap plus three batches: ``accept_batch``
  sizes the backlog so that three fit the open-file limit;
- a small kernel send buffer per connection (``SO_SNDBUF``), so a client that stops reading a
  stream blocks the server's writes after a few hundred KiB instead of after the several MiB
  Linux's autotuning grants; that is what lets the server notice a stalled reader
  (``stream_timeout_s``) and stop generating for it (lily.server, lily.scheduler).

The deadlines are checked by timers on the event loop (no polling), and the state they follow
is h11's own (``their_state``): IDLE (a request not yet fully headed), SEND_BODY, DONE.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["ServerLimits", "accept_batch", "default_max_connections", "limited_protocol"]

log = logging.getLogger("lily.server")


@dataclass(frozen=True)
class ServerLimits:
    """What one client may hold. Defaults suit a local server with a few clients."""

    header_timeout_s: float = 10.0  # a request's headers, from its first byte
    body_timeout_s: float = 30.0  # its body, from the end of the headers
    max_connections: int = 256  # open connections; keep it below the open-file limit
    backlog: int = 64  # listen backlog, and the most connections accepted in one batch
    send_buffer_bytes: int = 128 << 10  # SO_SNDBUF per connection (0: the OS default)
    stream_timeout_s: float = 30.0  # a streaming client that has not read for this long is dropped
    stream_buffer_chunks: int = 64  # generated chunks waiting to be sent, per request

    def __post_init__(self):
        for name in ("header_timeout_s", "body_timeout_s", "stream_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        for name in ("max_connections", "backlog", "stream_buffer_chunks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)!r}")
        if self.send_buffer_bytes < 0:
            raise ValueError(f"send_buffer_bytes must be >= 0, got {self.send_buffer_bytes!r}")


def default_max_connections() -> int:
    """256, or half the process's open-file limit when that is lower (the model's files, the
    listening socket, a batch of connections being refused and the logs need descriptors too)."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return 256
    return 256 if soft == resource.RLIM_INFINITY else max(8, min(256, soft // 2))


def accept_batch(limits: ServerLimits) -> int:
    """The listen backlog (asyncio's accept batch) to use: ``limits.backlog``, smaller where the
    open-file limit cannot hold the connection cap plus three batches (as many as can be in
    flight, see the module's docstring) plus 32 descriptors for the process's own files. At a
    limit of 160 with the cap at 56, batches of 64 met EMFILE, and so, now and then, did batches
    of 36 (sized for two in flight). Smaller batches are a shorter listen queue too: at 18 a
    burst of 48 connections lost some before the server took them."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return limits.backlog
    if soft == resource.RLIM_INFINITY:
        return limits.backlog
    return max(1, min(limits.backlog, (soft - limits.max_connections - 32) // 3))


def _raw_response(status: int, reason: str, code: str, message: str) -> bytes:
    """A complete HTTP/1.1 response with an OpenAI-style error body, closing the connection
    (written straight to the socket: h11 has no request to answer when the headers never came)."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n")
    return head.encode() + body


class _LimitedH11Protocol(H11Protocol):
    limits: ServerLimits = ServerLimits()
    _open: set | None = None  # uvicorn's set of open connections, once one was made

    @classmethod
    def open_connections(cls) -> int | None:
        """Connections open now (None before the first one)."""
        return None if cls._open is None else len(cls._open)

    # -- connection ------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        type(self)._open = self.connections
        self._deadline: asyncio.TimerHandle | None = None
        self._phase: str | None = None  # "headers" | "body" while a deadline runs
        if len(self.connections) > self.limits.max_connections:
            self.connections.discard(self)  # counted no more: it is closing
            log.warning("refusing a connection: %d open, the cap is %d", len(self.connections),
                        self.limits.max_connections)
            transport.write(_raw_response(503, "Service Unavailable", "too_many_connections",
                                          f"The server has {self.limits.max_connections} connections open; retry later"))
            transport.close()
            return
        sock = transport.get_extra_info("socket")
        if sock is not None and self.limits.send_buffer_bytes:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.limits.send_buffer_bytes)
            except OSError:  # not a TCP socket (a Unix socket): keep the default
                pass
        self._arm("headers")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start the next pipelined request
        self._follow()

    # -- deadlines -------------------------------------------------------------------------------

    def _follow(self) -> None:
        """Arms, moves or drops the deadline to match where h11 is in the current request."""
        if self.transport.is_closing():
            return self._disarm()
        state = self.conn.their_state
        if state is h11.IDLE:
            # Bytes of a request whose headers are not complete yet (uvicorn has just cancelled
            # its keep-alive timer because data came); nothing buffered: keep-alive covers it.
            if self.conn.trailing_data[0] or self._phase == "headers":
                self._arm("headers")
            else:
                self._disarm()
        elif state is h11.SEND_BODY:
            self._arm("body")
        else:  # DONE, MUST_CLOSE, CLOSED, ERROR: nothing more to read for this request
            self._disarm()

    def _arm(self, phase: str) -> None:
        if self._phase == phase:
            return  # the deadline runs from the phase's start, not from the latest byte
        self._disarm()
        self._phase = phase
        timeout = self.limits.header_timeout_s if phase == "headers" else self.limits.body_timeout_s
        self._deadline = self.loop.call_later(timeout, self._expired, phase)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline, self._phase = None, None

    def _expired(self, phase: str) -> None:
        self._deadline, self._phase = None, None
        if self.transport.is_closing():
            return
        timeout = self.limits.header_timeout_s if phase == "headers" else self.limits.body_timeout_s
        log.warning("closing a connection whose request %s did not arrive within %g s", phase, timeout)
        if self.cycle is None or not self.cycle.response_started:  # else the response has begun: just close
            self.transport.write(_raw_response(408, "Request Timeout", "request_timeout",
                                               f"the request {phase} did not arrive within {timeout:g} s"))
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.keep_alive = False
        self.transport.close()


def limited_protocol(limits: ServerLimits) -> type[H11Protocol]:
    """uvicorn's HTTP/1.1 protocol with ``limits`` enforced (pass as ``uvicorn.run(http=...)``)."""
    return type("LimitedH11Protocol", (_LimitedH11Protocol,), {"limits": limits})
