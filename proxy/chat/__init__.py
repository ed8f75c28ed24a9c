"""A chat-completions request in, an OpenAI response or chunk stream out, for every engine.

Request validation (`request`), prompt rendering (`prompt`), grammars (`grammar`), tool-call
parsing (`tool_parser`), the local service (`service`), the upstream service (`upstream`), the
one SSE path (`streaming`) and the one call record (`record`). No routes here.
"""
