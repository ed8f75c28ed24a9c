"""The `rlproxy` command line.

rlproxy serve                       start the OpenAI-compatible server
rlproxy export --format jsonl       write stored trajectories in OpenAI's chat fine-tuning
                                    format (one {"messages", "tools"} object per line)
rlproxy score [--group ID] [--pending]
                                    form groups and score them with RULER now; print a table
rlproxy train [--steps N]           the GRPO training loop alone (serve runs it by default)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path
from typing import TextIO

from proxy.settings import Settings


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
    args = parser.parse_args(argv)

    overrides = {
        k: v
        for k, v in {
            "host": getattr(args, "host", None),
            "port": getattr(args, "port", None),
            "data_dir": args.data_dir,
            "model_name": getattr(args, "model_name", None),
            "database_url": getattr(args, "database_url", None),
            "train": getattr(args, "train", None),
        }.items()
        if v is not None
    }
    settings = Settings(**overrides)
    logging.basicConfig(
        level=settings.log_level.upper() if args.command in ("serve", "train") else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if args.command == "serve":
        import uvicorn

        from proxy.api.app import create_app  # the only command that imports the HTTP app

        uvicorn.run(
            create_app(settings),
            host=settings.host,
            port=settings.port,
            log_level=settings.log_level.lower(),
            timeout_graceful_shutdown=5,
        )
        return 0
    if args.command == "train":
        from proxy.cli.train import train_command

        return asyncio.run(train_command(settings, args.steps))
    if settings.database_url is None and not settings.sqlite_path.exists():
        print(f"rlproxy {args.command}: no database at {settings.sqlite_path}", file=sys.stderr)
        return 1
    if args.command == "score":
        from proxy.cli.score import score_command

        return asyncio.run(score_command(settings, args.group))
    status = None if args.status == "all" else args.status
    if args.out is None:
        count = asyncio.run(export_jsonl(settings, sys.stdout, status, args.model, args.group_key))
    else:
        with args.out.open("w", encoding="utf-8") as out:
            count = asyncio.run(export_jsonl(settings, out, status, args.model, args.group_key))
    print(f"rlproxy export: wrote {count} trajectories", file=sys.stderr)
    return 0


async def export_jsonl(
    settings: Settings,
    out: TextIO,
    status: str | None,
    model: str | None = None,
    group_key: str | None = None,
) -> int:
    """Write one fine-tuning line per trajectory with a completed answer; return the count."""
    from proxy.runtime import open_runtime
    from storage.export import to_finetune_line

    count = 0
    async with open_runtime(settings) as rt:
        async for detail in rt.store.iter_trajectories_for_export(
            status=status, model=model, group_key=group_key
        ):
            line = to_finetune_line(detail)
            if line is not None:
                out.write(json.dumps(line, ensure_ascii=False) + "\n")
                count += 1
    return count


if __name__ == "__main__":
    sys.exit(main())
