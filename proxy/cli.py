"""The `rlproxy` command line: `rlproxy serve` starts the OpenAI-compatible server."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from proxy.settings import Settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlproxy", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the policy over the OpenAI API")
    serve.add_argument("--host", help="bind address (RLPROXY_HOST, default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (RLPROXY_PORT, default 8000)")
    serve.add_argument("--data-dir", type=Path, help="data directory (RLPROXY_DATA_DIR)")
    serve.add_argument("--model-name", help="served policy name (RLPROXY_MODEL_NAME)")
    args = parser.parse_args(argv)

    overrides = {
        k: v
        for k, v in {
            "host": args.host,
            "port": args.port,
            "data_dir": args.data_dir,
            "model_name": args.model_name,
        }.items()
        if v is not None
    }
    settings = Settings(**overrides)
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.command == "serve":
        import uvicorn

        from proxy.app import create_app

        uvicorn.run(
            create_app(settings),
            host=settings.host,
            port=settings.port,
            log_level=settings.log_level.lower(),
            timeout_graceful_shutdown=5,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
