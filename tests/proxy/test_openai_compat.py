"""`OpenAICompatClient` against raw HTTP/1.1 servers on loopback: SSE framing and odd answers.

Each server here is an asyncio socket server that writes a fixed HTTP response byte for byte,
so the client meets framing a well-behaved provider may legally send (the SSE rules of
https://html.spec.whatwg.org/multipage/server-sent-events.html: CRLF or LF line ends, comment
lines, `event:` fields, a `data:` value split over several lines, an event without its final
empty line, bytes arriving in arbitrary pieces) and answers a careless one sends.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest

from proxy.engines.openai_compat import OpenAICompatClient
from proxy.engines.upstream_errors import UpstreamError


def _chunk(content: str) -> dict:
    return {
        "id": "c",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}],
    }


async def _read_request(reader: asyncio.StreamReader) -> None:
    """Read one request (head and its content-length body) off the connection."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    )
    await reader.readexactly(length)


@asynccontextmanager
async def _server(
    status: str, headers: str, body: bytes, piece: int = 0, delay: float = 0.0
) -> AsyncIterator[str]:
    """Answer every request with this response; `piece` > 0 writes the body in pieces of that
    many bytes, draining after each."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        await asyncio.sleep(delay)
        writer.write(f"HTTP/1.1 {status}\r\n{headers}connection: close\r\n\r\n".encode())
        step = piece or len(body) or 1
        for i in range(0, len(body), step):
            writer.write(body[i : i + step])
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield f"http://127.0.0.1:{port}/v1/chat/completions"


def _client(timeout_s: float = 10.0) -> OpenAICompatClient:
    return OpenAICompatClient(timeout_s=timeout_s, redact=lambda s: s.replace("sk-secret", "[R]"))


async def _collect(url: str, client: OpenAICompatClient) -> list[dict]:
    events = await client.stream(url, "sk-secret", {"model": "m", "messages": [], "stream": True})
    return [e async for e in events]


@pytest.mark.parametrize("piece", [0, 1, 7])
async def test_stream_framing_is_read_event_by_event(piece: int) -> None:
    one, two = json.dumps(_chunk("Hel")), json.dumps(_chunk("lo"))
    split = two[:20] + "\ndata: " + two[20:]  # one value over two data: lines
    body = (
        ": keep-alive comment\r\n\r\n"
        f"event: message\r\ndata: {one}\r\n\r\n"
        f"data: {split}\n\n"
        f"data:{json.dumps(_chunk('!'))}\n"  # no space after the colon, no blank line yet
        "\n"
        "data: [DONE]\n\n"
        f"data: {json.dumps(_chunk('after done'))}\n\n"
    ).encode()
    client = _client()
    headers = "content-type: text/event-stream\r\n"
    async with _server("200 OK", headers, body, piece=piece) as url:
        events = await _collect(url, client)
    await client.aclose()
    texts = [e["choices"][0]["delta"]["content"] for e in events]
    # The multi-line value is joined with a newline, as SSE says; JSON reads that as whitespace.
    assert texts == ["Hel", "lo", "!"]


async def test_last_event_without_blank_line_is_delivered() -> None:
    body = f"data: {json.dumps(_chunk('end'))}".encode()
    client = _client()
    async with _server("200 OK", "content-type: text/event-stream\r\n", body) as url:
        events = await _collect(url, client)
    await client.aclose()
    assert [e["choices"][0]["delta"]["content"] for e in events] == ["end"]


async def test_error_event_mid_stream_raises_after_earlier_chunks() -> None:
    error = {"error": {"message": "broke with sk-secret", "type": "server_error"}}
    body = f"data: {json.dumps(_chunk('a'))}\n\ndata: {json.dumps(error)}\n\n".encode()
    client = _client()
    async with _server("200 OK", "content-type: text/event-stream\r\n", body) as url:
        events = await client.stream(url, None, {"stream": True})
        first = await anext(events)
        with pytest.raises(UpstreamError) as info:
            await anext(events)
    await client.aclose()
    assert first["choices"][0]["delta"]["content"] == "a"
    assert info.value.status_code == 502 and "broke with [R]" in info.value.message


Case = tuple[str, bytes, int, str, Callable[[UpstreamError], bool]]
CASES: list[Case] = [
    (
        "429 Too Many Requests",
        b'{"error": {"message": "slow down", "type": "requests", "code": "rate_limit"}}',
        429,
        "requests",
        lambda e: e.message == "slow down" and e.code == "rate_limit",
    ),
    (
        "400 Bad Request",
        b'{"error": "a plain string error with sk-secret"}',
        400,
        "invalid_request_error",
        lambda e: e.message == "a plain string error with [R]",
    ),
    (
        "502 Bad Gateway",
        b"<html>nginx says no</html>",
        502,
        "server_error",
        lambda e: "nginx says no" in e.message and e.code == "upstream_error",
    ),
    (
        "200 OK",
        b"not json at all",
        502,
        "server_error",
        lambda e: "not JSON" in e.message,
    ),
    (
        "200 OK",
        b'{"object": "chat.completion"}',
        502,
        "server_error",
        lambda e: "without `choices`" in e.message,
    ),
]


@pytest.mark.parametrize("status, body, want_status, want_type, check", CASES)
async def test_bad_answers_become_openai_errors(
    status: str, body: bytes, want_status: int, want_type: str, check: Callable
) -> None:
    client = _client()
    headers = f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
    async with _server(status, headers, body) as url:
        with pytest.raises(UpstreamError) as info:
            await client.complete(url, "sk-secret", {"model": "m", "messages": []})
        if status != "200 OK":  # a refused stream is raised before any event
            with pytest.raises(UpstreamError) as streamed:
                await _collect(url, client)
            assert streamed.value.status_code == want_status
    await client.aclose()
    err = info.value
    assert (err.status_code, err.type) == (want_status, want_type)
    assert check(err), err.message


async def test_unreachable_and_timeout() -> None:
    client = _client(timeout_s=0.5)
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    with pytest.raises(UpstreamError) as down:
        await client.complete(f"http://127.0.0.1:{port}/v1/chat/completions", None, {})
    assert (down.value.status_code, down.value.code) == (502, "upstream_unreachable")
    body = b'{"choices": []}'
    headers = f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
    async with _server("200 OK", headers, body, delay=3) as url:
        with pytest.raises(UpstreamError) as slow:
            await client.complete(url, None, {})
    await client.aclose()
    assert (slow.value.status_code, slow.value.code) == (504, "timeout")


@asynccontextmanager
async def _keep_alive_server(
    stream_body: bytes, end_body: bool = True
) -> AsyncIterator[tuple[str, list[int]]]:
    """HTTP/1.1 with keep-alive: every request on a connection gets `stream_body` as one
    chunk of a chunked SSE answer, then the chunked terminator (`end_body`) or nothing more.
    Yields the URL and a list that counts the connections opened."""
    opened: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        opened.append(1)
        try:
            while True:
                await _read_request(reader)
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    b"transfer-encoding: chunked\r\n\r\n"
                    + b"%x\r\n%s\r\n"
                    % (len(stream_body), stream_body)
                )
                if not end_body:
                    await writer.drain()
                    await asyncio.sleep(30)
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield f"http://127.0.0.1:{port}/v1/chat/completions", opened


async def test_streams_end_with_the_connection_back_in_the_pool() -> None:
    # The body's end follows `[DONE]`: it is read, so the next call reuses the connection
    # instead of opening one per stream.
    body = f"data: {json.dumps(_chunk('hi'))}\n\ndata: [DONE]\n\n".encode()
    client = _client()
    async with _keep_alive_server(body) as (url, opened):
        for _ in range(3):
            events = await _collect(url, client)
            assert [e["choices"][0]["delta"]["content"] for e in events] == ["hi"]
    await client.aclose()
    assert len(opened) == 1


async def test_a_body_that_does_not_end_after_done_still_ends_the_stream() -> None:
    body = f"data: {json.dumps(_chunk('hi'))}\n\ndata: [DONE]\n\n".encode()
    client = _client(timeout_s=5.0)
    async with _keep_alive_server(body, end_body=False) as (url, _):
        events = await _collect(url, client)  # not the read timeout's 504
    await client.aclose()
    assert [e["choices"][0]["delta"]["content"] for e in events] == ["hi"]


async def test_lone_cr_line_ends_and_crlf_split_across_pieces() -> None:
    # SSE allows CR alone as a line end; a CRLF may arrive as CR in one piece, LF in the next.
    one, two = json.dumps(_chunk("a")), json.dumps(_chunk("b"))
    body = f"data: {one}\r\rdata: {two}\r\n\r\ndata: [DONE]\r\r".encode()
    client = _client()
    async with _server("200 OK", "content-type: text/event-stream\r\n", body, piece=1) as url:
        events = await _collect(url, client)
    await client.aclose()
    assert [e["choices"][0]["delta"]["content"] for e in events] == ["a", "b"]


async def test_an_event_larger_than_a_read_buffer_is_one_event() -> None:
    big = "x" * 300_000  # one line well past any client's default line limit
    body = f"data: {json.dumps(_chunk(big))}\n\ndata: [DONE]\n\n".encode()
    client = _client()
    async with _server("200 OK", "content-type: text/event-stream\r\n", body, piece=65536) as url:
        events = await _collect(url, client)
    await client.aclose()
    assert [e["choices"][0]["delta"]["content"] for e in events] == [big]
