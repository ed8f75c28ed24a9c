"""A vLLM-protocol server for tests and benchmarks, generating with rlproxy's real local engine.

    python -m tests.fakes.vllm_server --port 8101 --model-dir rlproxy-data [--record calls.jsonl]

vLLM needs a GPU; this machine has none. This server implements the part of vLLM's OpenAI server
that rlproxy's `vllm` engine (`proxy/engines/vllm.py`) uses, field for field as vLLM's source
defines it (vllm-project/vllm), and generates with `proxy.engines.local.LocalEngine` on the
embedded model, so token ids and logprobs are real ones:

- `POST /v1/completions` (`vllm/entrypoints/openai/completion/protocol.py`, `serving.py`):
  `prompt` as token ids (or one string), `max_tokens` (default 16), `n`, `temperature`, `top_p`,
  `seed`, `stop`, `stop_token_ids`, `presence_penalty`, `frequency_penalty`, `logprobs`,
  `return_token_ids`, `return_tokens_as_token_ids`, `structured_outputs` (`grammar`, `json`),
  `stream`, `stream_options.include_usage`; other fields are accepted and ignored, as vLLM's
  `OpenAIBaseModel` does. Answers: `CompletionResponse` with `choices[i]` = `index`, `text`,
  `logprobs` (`text_offset`, `token_logprobs`, `tokens`, `top_logprobs` as dicts holding the
  sampled token and the top k), `finish_reason`, `stop_reason`, `prompt_logprobs`,
  `prompt_token_ids`, `token_ids`; streams one chunk per choice per token
  (`CompletionStreamResponse`, dumped with `exclude_unset`, so `usage` is absent), the choice's
  `prompt_token_ids` only in its first chunk, then a usage chunk when asked, then `[DONE]`.
- `POST /v1/load_lora_adapter`, `POST /v1/unload_lora_adapter`
  (`vllm/entrypoints/serve/lora/api_router.py`, `vllm/entrypoints/openai/models/serving.py`):
  a 200 whose body is vLLM's sentence; both names and path required (400); a name already loaded
  without `load_inplace` is a 400; a folder with no `adapter_config.json` a 404
  (`LoRAAdapterNotFoundError`'s message); an adapter vLLM's loader refuses
  (`vllm/lora/peft_helper.py`: `modules_to_save`, DoRA, a bias, a rank over `--max-lora-rank`) a
  500 `InternalServerError`, as `load_lora_adapter` wraps the engine's error; an unknown name to
  unload a 404.
- `GET /v1/models` (`ModelCard`: the base with `max_model_len`, each LoRA with `parent`),
  `GET /health` (200 empty, 503 when the engine thread is dead:
  `vllm/entrypoints/serve/instrumentator/health.py`).
- Errors: `{"error": {"message", "type", "param", "code"}}` with the status as an integer code
  (`vllm/entrypoints/serve/utils/error_response.py`); an unknown model is a 404 `NotFoundError`
  with param "model"; a failure mid-stream is `data: {"error": ...}` then `data: [DONE]`.
- vLLM's admin routes (`/sleep`, `/wake_up`, `/collective_rpc`, `/reset_prefix_cache`) exist
  here only to count calls (`GET /fake/admin_calls`, not vLLM's): tests check rlproxy never
  reaches them.

Faults for the tests of rlproxy's start-up checks (`tests/e2e/test_vllm_config.py`), each a
replica set up wrong: `--root NAME` puts another model's name in the base card's `root` (vLLM
started on another model: the stand-in still generates with the embedded one);
`--no-runtime-lora` leaves the LoRA routes out (vLLM without
`VLLM_ALLOW_RUNTIME_LORA_UPDATING`: FastAPI's bare 404); `--loras-serve-base` loads and lists
adapters but answers requests for them with the base model, named as the base (no vLLM 0.32
does this, it 404s a name it cannot resolve; it stands for a server where the adapter name did
not resolve and the base answered).

Where it differs from vLLM, knowingly: the local engine stops on its own stop ids (EOS and
`<|im_start|>`) whatever `stop_token_ids` says; `stop_reason` is the stop string that ended a
choice (as vLLM's), else null, never a stop token id; logprobs are the
local engine's, taken before a grammar's mask (vLLM's `raw_logprobs` are taken after it); one
prompt per request. With `--record PATH` every finished completion is appended to PATH as a JSON
line (`id`, `model`, `prompt_token_ids`, per choice `token_ids` and `token_logprobs`), so tests can
compare what rlproxy stored with what this replica generated; `received_at` and `first_token_at`
(Unix seconds) let `bench/bench_vllm.py` split a request's time to first token.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

logger = logging.getLogger("fake_vllm")


# ----------------------------------------------------------------------------- protocol


class _Base(BaseModel):
    model_config = ConfigDict(extra="allow")  # vLLM's OpenAIBaseModel: unknown fields ignored


class StreamOptions(_Base):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class StructuredOutputs(_Base):
    json_: str | dict[str, Any] | None = Field(None, alias="json")
    grammar: str | None = None


class CompletionRequest(_Base):
    model: str | None = None
    prompt: list[int] | str
    max_tokens: int | None = 16
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = []
    stop_token_ids: list[int] | None = []
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    structured_outputs: StructuredOutputs | None = None


class LoadLoRA(_Base):
    lora_name: str = ""
    lora_path: str = ""
    load_inplace: bool = False


class UnloadLoRA(_Base):
    lora_name: str = ""


def error(message: str, type_: str, status: int, param: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


# ----------------------------------------------------------------------------- server


class FakeVLLM:
    def __init__(
        self,
        engine: Any,
        served_name: str,
        root: str,
        *,
        max_lora_rank: int,
        max_model_len: int,
        record: Path | None,
        runtime_lora: bool = True,
        loras_serve_base: bool = False,
    ) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.served_name = served_name
        self.root = root
        self.max_lora_rank = max_lora_rank
        self.max_model_len = max_model_len
        self.record = record
        self.runtime_lora = runtime_lora
        self.loras_serve_base = loras_serve_base
        self.loras: dict[str, str] = {}  # name -> path
        self.local: dict[str, str] = {}  # name -> the local engine's adapter name
        self.counter = 0
        self.admin_calls: list[str] = []
        self._token_text: dict[int, str] = {}

    def app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(_: FastAPI) -> AsyncIterator[None]:
            await self.engine.start()
            yield
            await self.engine.stop()

        app = FastAPI(lifespan=lifespan)
        app.get("/health")(self.health)
        app.get("/v1/models")(self.models)
        app.post("/v1/completions")(self.completions)
        if self.runtime_lora:
            app.post("/v1/load_lora_adapter")(self.load_lora)
            app.post("/v1/unload_lora_adapter")(self.unload_lora)
        for path in ("/sleep", "/wake_up", "/collective_rpc", "/reset_prefix_cache"):
            app.post(path)(self._admin(path))
        app.get("/fake/admin_calls")(lambda: {"calls": self.admin_calls})
        return app

    def _admin(self, path: str) -> Any:
        async def handler() -> Response:
            self.admin_calls.append(path)
            return Response(status_code=200)

        return handler

    async def health(self) -> Response:
        return Response(status_code=200 if self.engine.health().ok else 503)

    async def models(self) -> dict[str, Any]:
        created = int(time.time())
        permission = [{"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission"}]
        base = {
            "id": self.served_name,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": self.root,
            "parent": None,
            "max_model_len": self.max_model_len,
            "permission": permission,
        }
        cards = [
            {**base, "id": name, "root": path, "parent": self.served_name, "max_model_len": None}
            for name, path in self.loras.items()
        ]
        return {"object": "list", "data": [base, *cards]}

    # ------------------------------------------------------------------------- LoRA

    async def load_lora(self, raw: Request) -> Response:
        req = LoadLoRA.model_validate(await raw.json())
        if not req.lora_name or not req.lora_path:
            return error(
                "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput", 400
            )
        if not req.load_inplace and req.lora_name in self.loras:
            return error(
                f"The lora adapter '{req.lora_name}' has already been loaded. If you want to "
                "load the adapter in place, set 'load_inplace' to True.",
                "InvalidUserInput",
                400,
            )
        config_path = Path(req.lora_path) / "adapter_config.json"
        if not config_path.is_file():
            return error(
                f"Loading lora {req.lora_name} failed: No adapter found for {req.lora_path}",
                "NotFoundError",
                404,
            )
        refusal = self._peft_refusal(json.loads(config_path.read_text()))
        if refusal:
            return error(refusal, "InternalServerError", 500)
        self.counter += 1
        local = f"lora{self.counter}"
        try:
            await self.engine.load_adapter(local, req.lora_path)
        except Exception as exc:
            return error(str(exc), "InternalServerError", 500)
        old = self.local.get(req.lora_name)
        self.loras[req.lora_name] = req.lora_path
        self.local[req.lora_name] = local
        if old is not None:  # load_inplace: the name now means the new weights
            await self.engine.unload_adapter(old)
        return Response(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    def _peft_refusal(self, config: dict[str, Any]) -> str | None:
        """vLLM's PEFTHelper checks (`_validate_features`, `validate_legal`)."""
        errors = []
        if config.get("modules_to_save"):
            errors.append("vLLM only supports modules_to_save being None.")
        if config.get("use_dora"):
            errors.append("vLLM does not yet support DoRA.")
        ranks = [int(config.get("r", 0)), *map(int, (config.get("rank_pattern") or {}).values())]
        if max(ranks) > self.max_lora_rank:
            errors.append(
                f"LoRA rank {max(ranks)} is greater than max_lora_rank {self.max_lora_rank}."
            )
        if config.get("bias", "none") != "none":
            errors.append("Adapter bias is not supported.")
        return " ".join(errors) or None

    async def unload_lora(self, raw: Request) -> Response:
        req = UnloadLoRA.model_validate(await raw.json())
        if not req.lora_name:
            return error(
                "'lora_name' needs to be provided to unload a LoRA adapter.",
                "InvalidUserInput",
                400,
            )
        if req.lora_name not in self.loras:
            return error(
                f"The lora adapter '{req.lora_name}' cannot be found.", "NotFoundError", 404
            )
        del self.loras[req.lora_name]
        await self.engine.unload_adapter(self.local.pop(req.lora_name))
        return Response(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    # ------------------------------------------------------------------------- completions

    async def completions(self, raw: Request) -> Response:
        from proxy.engines.base import GenerationRequest, SamplingParams

        try:
            req = CompletionRequest.model_validate(await raw.json())
        except (ValidationError, ValueError) as exc:
            return error(str(exc), "BadRequestError", 400)
        model = req.model or self.served_name
        if model != self.served_name and model not in self.loras:
            return error(f"The model `{model}` does not exist.", "NotFoundError", 404, "model")
        prompt = (
            list(req.prompt)
            if isinstance(req.prompt, list)
            else self.tokenizer.encode(req.prompt, add_special_tokens=True)
        )
        max_tokens = req.max_tokens or 16
        if len(prompt) + max_tokens > self.max_model_len:
            return error(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {len(prompt) + max_tokens} tokens ({len(prompt)} in the messages, "
                f"{max_tokens} in the completion). Please reduce the length of the messages or "
                "completion.",
                "BadRequestError",
                400,
                "prompt",
            )
        try:
            grammar = self._grammar(req.structured_outputs)
        except ValueError as exc:
            return error(f"Grammar error: {exc}", "BadRequestError", 400)
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            seed=req.seed,
            stop=tuple(stop),
            logprobs=True,
            top_logprobs=max(0, req.logprobs or 0),
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
        )
        adapter = self.local[model] if model in self.loras else None
        if self.loras_serve_base:  # the fault: the name did not resolve, the base answers
            adapter, model = None, self.served_name
        gen = GenerationRequest(prompt, params, n=req.n, adapter=adapter, grammar=grammar)
        answer = _Answer(self, req, model, prompt)
        if req.stream:
            return StreamingResponse(answer.stream(gen), media_type="text/event-stream")
        try:
            async for event in self.engine.generate(gen):
                answer.take(event)
        except Exception as exc:
            return error(str(exc), "InternalServerError", 500)
        answer.write_record()
        return JSONResponse(answer.body())

    def _grammar(self, so: StructuredOutputs | None) -> Any:
        if so is None:
            return None
        import llguidance

        from proxy.chat.grammar import Grammar

        if so.grammar is not None:
            source = llguidance.grammar_from("grammar", so.grammar)
        elif so.json_ is not None:
            schema = so.json_ if isinstance(so.json_, str) else json.dumps(so.json_)
            source = llguidance.grammar_from("json", schema)
        else:
            raise ValueError("only `grammar` and `json` structured outputs are served here")
        problem = llguidance.LLMatcher.validate_grammar(source)
        if problem:
            raise ValueError(problem)
        return Grammar(source, "structured_outputs")

    def token(self, token_id: int, as_id: bool) -> str:
        if as_id:
            return f"token_id:{token_id}"
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text


class _Answer:
    """One completion being built (non-streamed) or streamed, choice by choice."""

    def __init__(self, server: FakeVLLM, req: CompletionRequest, model: str, prompt: list[int]):
        self.server = server
        self.req = req
        self.model = model
        self.prompt = prompt
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.received_at = time.time()
        self.first_token_at: float | None = None
        self.ids: dict[int, list[int]] = {i: [] for i in range(req.n)}
        self.lps: dict[int, list[float]] = {i: [] for i in range(req.n)}
        self.text: dict[int, str] = {i: "" for i in range(req.n)}
        self.tops: dict[int, list[dict[str, float] | None]] = {i: [] for i in range(req.n)}
        self.finish: dict[int, str] = {}
        self.stop_reason: dict[int, str | None] = {}

    def _top(self, event: Any) -> dict[str, float]:
        as_id = bool(self.req.return_tokens_as_token_ids)
        top = {self.server.token(event.token_id, as_id): max(event.logprob, -9999.0)}
        for token_id, logprob in event.top_logprobs:
            top.setdefault(self.server.token(token_id, as_id), max(logprob, -9999.0))
        return top

    def take(self, event: Any) -> None:
        from proxy.engines.base import TokenEvent

        i = event.index
        if isinstance(event, TokenEvent):
            if self.first_token_at is None:
                self.first_token_at = time.time()
            self.ids[i].append(event.token_id)
            self.lps[i].append(event.logprob)
            self.text[i] += event.text
            self.tops[i].append(self._top(event))
        else:
            self.finish[i] = "abort" if event.finish_reason == "cancelled" else event.finish_reason
            self.stop_reason[i] = event.stop

    def _logprobs(self, ids: list[int], lps: list[float], tops: list[Any], offset: int) -> Any:
        if self.req.logprobs is None:
            return None
        as_id = bool(self.req.return_tokens_as_token_ids)
        tokens = [self.server.token(t, as_id) for t in ids]
        offsets, at = [], offset
        for token in tokens:
            offsets.append(at)
            at += len(token)
        return {
            "text_offset": offsets,
            "token_logprobs": [max(lp, -9999.0) for lp in lps],
            "tokens": tokens,
            "top_logprobs": tops,
        }

    def body(self) -> dict[str, Any]:
        with_ids = bool(self.req.return_token_ids)
        choices = [
            {
                "index": i,
                "text": self.text[i],
                "logprobs": self._logprobs(self.ids[i], self.lps[i], self.tops[i], 0),
                "finish_reason": self.finish.get(i),
                "stop_reason": self.stop_reason.get(i),
                "token_ids": self.ids[i] if with_ids else None,
                "prompt_logprobs": None,
                "prompt_token_ids": self.prompt if with_ids else None,
            }
            for i in range(self.req.n)
        ]
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": None,
            "usage": self._usage(),
            "kv_transfer_params": None,
        }

    def _usage(self) -> dict[str, Any]:
        completion = sum(len(v) for v in self.ids.values())
        return {
            "prompt_tokens": len(self.prompt),
            "total_tokens": len(self.prompt) + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": None,
        }

    def _chunk(self, i: int, k: int, finish: str | None, first: bool) -> str:
        """The chunk of choice i's token k (k = -1: no token), with its finish reason."""
        with_ids = bool(self.req.return_token_ids)
        ids = self.ids[i][k : k + 1] if k >= 0 else []
        offset = len("".join(self.text_parts[i][:k])) if k >= 0 else 0
        choice = {
            "index": i,
            "text": self.text_parts[i][k] if k >= 0 else "",
            "logprobs": self._logprobs(ids, self.lps[i][k : k + 1], self.tops[i][k : k + 1], offset)
            if k >= 0
            else None,
            "finish_reason": finish,
            "stop_reason": self.stop_reason.get(i) if finish else None,
            "prompt_token_ids": self.prompt if (with_ids and first) else None,
            "token_ids": ids if with_ids else None,
        }
        chunk = {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }
        return f"data: {json.dumps(chunk)}\n\n"

    async def stream(self, gen: Any) -> AsyncIterator[str]:
        from proxy.engines.base import TokenEvent

        self.text_parts: dict[int, list[str]] = {i: [] for i in range(self.req.n)}
        held: dict[int, int] = {}  # choice -> index of a token not sent yet (waits for finish)
        sent_first: set[int] = set()

        def flush(i: int, finish: str | None) -> str:
            k = held.pop(i, -1)
            first = i not in sent_first
            sent_first.add(i)
            return self._chunk(i, k, finish, first)

        try:
            async for event in self.server.engine.generate(gen):
                i = event.index
                if isinstance(event, TokenEvent):
                    if i in held:
                        yield flush(i, None)
                    self.take(event)
                    self.text_parts[i].append(event.text)
                    held[i] = len(self.ids[i]) - 1
                else:
                    self.take(event)
                    yield flush(i, self.finish[i])
            if self.req.stream_options and self.req.stream_options.include_usage:
                usage = {k: v for k, v in self._usage().items() if v is not None}
                chunk = {
                    "id": self.id,
                    "object": "text_completion",
                    "created": self.created,
                    "model": self.model,
                    "choices": [],
                    "usage": usage,
                }
                yield f"data: {json.dumps(chunk)}\n\n"
            self.write_record()
        except Exception as exc:
            logger.exception("generation failed")
            info = {"message": str(exc), "type": "InternalServerError", "param": None, "code": 500}
            yield f"data: {json.dumps({'error': info})}\n\n"
        yield "data: [DONE]\n\n"

    def write_record(self) -> None:
        if self.server.record is None:
            return
        line = {
            "id": self.id,
            "model": self.model,
            "prompt_token_ids": self.prompt,
            "received_at": self.received_at,
            "first_token_at": self.first_token_at,
            "choices": [
                {"token_ids": self.ids[i], "token_logprobs": self.lps[i]} for i in range(self.req.n)
            ],
        }
        with self.server.record.open("a") as f:
            f.write(json.dumps(line) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model-dir", type=Path, required=True, help="holds the fp32 model cache")
    parser.add_argument("--served-model-name", default="smollm2-135m")
    parser.add_argument("--max-lora-rank", type=int, default=16)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--record", type=Path, default=None)
    parser.add_argument("--root", default=None, help="fault: the base card's root (--model)")
    parser.add_argument("--no-runtime-lora", action="store_true", help="fault: no LoRA routes")
    parser.add_argument("--loras-serve-base", action="store_true", help="fault: see docstring")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    from proxy.engines.loader import load_model
    from proxy.engines.local import LocalEngine

    loaded = load_model(args.model_dir)
    engine = LocalEngine(loaded, max_batch_size=args.max_batch_size)
    fake = FakeVLLM(
        engine,
        args.served_model_name,
        args.root or str(loaded.source),
        max_lora_rank=args.max_lora_rank,
        max_model_len=engine.max_context,
        record=args.record,
        runtime_lora=not args.no_runtime_lora,
        loras_serve_base=args.loras_serve_base,
    )
    uvicorn.run(fake.app(), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
