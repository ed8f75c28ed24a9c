"""Engines: what generates tokens behind the proxy.

`base` is the token-level contract; `local` implements it on the embedded model (transformers +
PEFT, dynamic batching; `loader`, `kv_batch`, `sampling` are its parts), `vllm` on vLLM servers
(token ids over HTTP; `vllm_replicas` routes and watches them). `upstream` is a
message-level client of other providers through litellm; its calls cannot be trained on.
"""
