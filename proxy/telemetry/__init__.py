"""Telemetry: what serving tells the outside about itself, never on the serving path.

Prometheus metrics (`metrics`: one registry per app, scraped at `GET /metrics`), OpenTelemetry
spans for every stored chat call (`genai` names the attributes after the GenAI semantic
conventions, `tracing` exports them over OTLP/HTTP), and Langfuse (`langfuse`: the same spans
through its OTLP endpoint, and RULER scores and rewards through its public API). `telemetry`
is the one object the runtime wires in and calls.

Nothing here is built at import time, nothing exports unless the standard environment variables
say where to, and nothing here imports the HTTP app, routes, runtime or CLI (`make lint`).
"""
