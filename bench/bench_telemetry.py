"""What telemetry costs a chat call: telemetry off (metrics only) against on (OTLP spans).

    .venv/bin/python bench/bench_telemetry.py [--calls 3000] [--rounds 10]

Telemetry runs once per call, in the record sink, after the call's row is committed
(`proxy.telemetry.telemetry.Telemetry.recorder`). This runs that sink the way serving does, one
call at a time on a real SQLite store, in four set-ups interleaved round by round: the store
alone (no telemetry object), telemetry off (no OTLP or Langfuse variables: Prometheus counters
only, no tracer built), on (every call a span, exported over OTLP/HTTP to a collector in another
process), and on with message capture. Per set-up it prints the p50 of the telemetry step the
call waits for (between the commit and the sink's return), the p50 of the whole sink, and the
CPU time per call of this process, every thread included (the exporter's encoding and sending,
flushed at the end of each round), with its ratio to the store alone. A benchmark, not a test:
read the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from proxy.telemetry.metrics import Metrics  # noqa: E402
from proxy.telemetry.telemetry import Telemetry  # noqa: E402
from storage import CallRecord, ChoiceRecord, Store  # noqa: E402


def _call(i: int) -> CallRecord:
    now = time.time()
    messages = [
        {"role": "system", "content": "You are a careful assistant."},
        {"role": "user", "content": f"What is {i} times 23? Answer with the number only."},
    ]
    return CallRecord(
        id=uuid.uuid4().hex,
        created_at=now - 0.2,
        finished_at=now,
        model_requested="rlproxy",
        engine="local",
        request_messages=messages,
        completion_id=f"chatcmpl-{uuid.uuid4().hex}",
        params={"temperature": 0.7, "max_tokens": 32},
        choices=[ChoiceRecord(0, {"role": "assistant", "content": "391"}, "stop", [1, 2], [0.0])],
        prompt_token_ids=list(range(40)),
        latency_s=0.2,
        time_to_first_token_s=0.05,
    )


class _Collector(BaseHTTPRequestHandler):
    """An OTLP/HTTP collector that accepts and forgets."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _collect(port: Any) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    port.put(server.server_address[1])
    server.serve_forever()


@dataclass
class _Setup:
    label: str
    telemetry: Telemetry | None
    sink: list[float] = field(default_factory=list)
    step: list[float] = field(default_factory=list)
    cpu: float = 0.0
    calls: int = 0

    async def run(self, store: Store, calls: int) -> None:
        cpu = time.process_time()
        for i in range(calls):
            record = _call(i)
            t0 = time.perf_counter()
            tid = await store.record_call(record)
            t1 = time.perf_counter()
            if self.telemetry is not None:  # what Telemetry.recorder does after the commit
                self.telemetry.call_recorded(record, tid)
            t2 = time.perf_counter()
            self.sink.append(t2 - t0)
            self.step.append(t2 - t1)
        if self.telemetry is not None and self.telemetry.tracing is not None:
            self.telemetry.tracing.flush()  # this round's export lands on this set-up
        self.cpu += time.process_time() - cpu
        self.calls += calls


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000, help="calls per set-up")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument(
        "--db-dir",
        default="/dev/shm" if Path("/dev/shm").is_dir() else None,
        help="where the SQLite file lives (default: memory-backed /dev/shm, so the disk's "
        "fsync noise, ms per commit, does not hide microseconds)",
    )
    args = parser.parse_args()

    port: multiprocessing.Queue[int] = multiprocessing.Queue()
    collector = multiprocessing.Process(target=_collect, args=(port,), daemon=True)
    collector.start()
    endpoint = f"http://127.0.0.1:{port.get(timeout=30)}/v1/traces"

    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    from proxy.telemetry.tracing import Destination, Tracing

    setups = [_Setup("store alone", None)]
    for label, traced, capture in (
        ("telemetry off (metrics only)", False, False),
        ("telemetry on (OTLP spans)", True, False),
        ("on, with message capture", True, True),
    ):
        metrics = Metrics()
        tracing = None
        if traced:
            exporter = OTLPSpanExporter(endpoint=endpoint)
            tracing = Tracing([Destination("otlp", exporter)], count=metrics.count_spans)
        setups.append(
            _Setup(label, Telemetry(metrics, policy="rlproxy", tracing=tracing, capture=capture))
        )
    with tempfile.TemporaryDirectory(dir=args.db_dir) as tmp:
        store = await Store.open(f"sqlite+aiosqlite:///{Path(tmp) / 'bench.db'}")
        try:
            await _Setup("warm-up", None).run(store, 100)
            # Rounds interleave the set-ups, so the machine's drift falls on all of them alike.
            for _ in range(args.rounds):
                for setup in setups:
                    await setup.run(store, args.calls // args.rounds)
        finally:
            await store.close()
    for setup in setups:
        if setup.telemetry is not None and setup.telemetry.tracing is not None:
            setup.telemetry.tracing.close()
    collector.terminate()

    base = setups[0].cpu / setups[0].calls
    print(
        f"{args.calls} calls per set-up, one at a time, interleaved in {args.rounds} rounds, "
        f"SQLite store in {args.db_dir or 'a temporary folder'}\n"
    )
    print(
        "| set-up | telemetry step p50 (µs) | sink p50 (µs) | CPU per call (µs) "
        "| CPU / store alone |"
    )
    print("| --- | --- | --- | --- | --- |")
    for s in setups:
        cpu = s.cpu / s.calls
        step = statistics.median(s.step) * 1e6
        sink = statistics.median(s.sink) * 1e6
        print(f"| {s.label} | {step:.1f} | {sink:.0f} | {cpu * 1e6:.0f} | {cpu / base:.3f} |")
    off, on = setups[1], setups[2]
    print(
        f"\ntelemetry on / off: CPU per call {on.cpu / on.calls / (off.cpu / off.calls):.3f}, "
        f"step p50 {statistics.median(on.step) / statistics.median(off.step):.1f}x "
        f"(+{(statistics.median(on.step) - statistics.median(off.step)) * 1e6:.0f} µs)"
    )


if __name__ == "__main__":
    asyncio.run(main())
