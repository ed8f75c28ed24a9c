"""The HTTP/1.1 protocol `rlproxy serve` runs: uvicorn's h11 protocol plus a request-head timeout.

    uvicorn.run(app, ..., http=http_protocol(settings.header_timeout_s))

Why it exists: uvicorn bounds only the idle time between two requests of a keep-alive connection
(`timeout_keep_alive`, armed after a response and cancelled by the next byte). A connection that
opens and then sends its request line and headers slowly (slowloris), or sends nothing, is kept
forever; each holds a socket and a file descriptor, and enough of them starve the server.
uvicorn 0.54 has no setting for it (neither `h11_impl.py` nor `httptools_impl.py` times the
head), so this subclass arms a timer when a connection opens and at the first byte of each later
request, cancels it once h11 has the whole head, and closes the connection if it fires first.

Only the head is timed: a slow body is bounded by the body size limit and belongs to the route,
and a long response (a stream) is the server's time, not the client's.

It is h11's protocol whatever is installed (uvicorn's "auto" would take httptools when present),
because the timer reads h11's connection state.
"""

from __future__ import annotations

import asyncio
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request head is late."""

    header_timeout_s: float = 10.0

    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._waiting_for_head():
            self._arm_head_timer()  # a timer already running keeps its deadline
        else:
            self._cancel_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _waiting_for_head(self) -> bool:
        """True while the client owes a request line and headers (h11: the client is IDLE)."""
        return self.conn.their_state is h11.IDLE

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._waiting_for_head() and not self.transport.is_closing():
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
