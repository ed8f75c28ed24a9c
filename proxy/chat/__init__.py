"""A chat-completions request in, an OpenAI response or chunk stream out, for every engine.

Request validation (`request`), prompt rendering with the model's chat template (`prompt`),
tool-call format families (`tool_formats`), grammars (`grammar`), tool-call parsing
(`tool_parser`: Hermes, `tool_parser_llama3`: Llama 3.1 JSON), the local service (`service`),
the upstream service (`upstream`), the one SSE path (`streaming`) and the one call record
(`record`). No routes here.
"""
