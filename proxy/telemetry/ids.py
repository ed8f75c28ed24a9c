"""Trace and span ids from rlproxy's own ids, so telemetry needs no table of its own.

A trajectory is one trace: its trace id is the trajectory id's 32 hex digits (rlproxy makes them
as uuid4 hex), or for an id a client chose, the first 128 bits of its SHA-256. A call is one
span: its span id is the first 64 bits of the call's uuid4 hex id. The same ids name the trace
and the observation a Langfuse score is about.
"""

from __future__ import annotations

import hashlib


def trace_id_of(trajectory_id: str) -> int:
    return _id_of(trajectory_id, 128)


def span_id_of(call_id: str) -> int:
    return _id_of(call_id[:16], 64)


def trace_hex(trajectory_id: str) -> str:
    return format(trace_id_of(trajectory_id), "032x")


def span_hex(call_id: str) -> str:
    return format(span_id_of(call_id), "016x")


def _id_of(key: str, bits: int) -> int:
    if len(key) == bits // 4:
        try:
            value = int(key, 16)
        except ValueError:
            value = 0
        if value:
            return value
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[: bits // 8], "big") or 1
