"""The HTTP/1.1 protocol `rlproxy serve` runs: uvicorn's httptools protocol plus a request-head
timeout.

    uvicorn.run(app, ..., http=http_protocol(settings.limits.header_timeout_s))

Why it exists: uvicorn bounds only the idle time between two requests of a keep-alive connection
(`timeout_keep_alive`, armed after a response and cancelled by the next byte). A connection that
opens and then sends its request line and headers slowly (slowloris), or sends nothing, is kept
forever; each holds a socket and a file descriptor, and enough of them starve the server.
uvicorn 0.54 has no setting for it (neither `h11_impl.py` nor `httptools_impl.py` times the
head), so this subclass arms a timer when a connection opens and when the parser meets the first
byte of each later request (`on_message_begin`), cancels it once the whole head is parsed
(`on_headers_complete`), and closes the connection if it fires first.

Only the head is timed: a slow body is bounded by the body size limit and belongs to the route,
and a long response (a stream) is the server's time, not the client's.

It is httptools' protocol (the C parser, `llhttp`), named explicitly: h11's pure-Python parser
and its event objects cost a noticeable share of each proxied call (`bench/bench_overhead.py
--profile`), and the timer hooks into httptools' parser callbacks.
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

logger = logging.getLogger(__name__)


class HeaderTimeoutProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, closing a connection whose request head is late."""

    header_timeout_s: float = 10.0

    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()  # the client owes its first request head

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm_head_timer()  # the first byte of a request: its head is owed now

    def on_headers_complete(self) -> None:
        self._cancel_head_timer()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:  # a timer already running keeps its deadline
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            logger.debug(
                "closing the connection from %s: no complete request head after %s s",
                self.client,
                self.header_timeout_s,
            )
            self.transport.close()


def http_protocol(header_timeout_s: float) -> type[HeaderTimeoutProtocol]:
    """The protocol class to hand uvicorn as `http=`, with this head timeout."""
    return type(
        "HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout_s": header_timeout_s}
    )
