"""What every result file records about the run that wrote it: the commit (and whether the tree
had uncommitted changes), the command, the settings that differ from `rlproxy serve`'s
defaults, the machine's load at the start and at the end, and the times.

    record = provenance.start(settings={"RLPROXY_ROLLOUT": "false"})
    # or, from the whole environment a proof gives its server:
    record = provenance.start(settings=provenance.settings_differing(server_env))
    ...
    json.dump({**provenance.finish(record), "results": ...}, out)
"""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else ""


def start(settings: dict[str, str] | None = None, **extra: Any) -> dict[str, Any]:
    """The run's record so far. `settings`: every RLPROXY_* value this run sets that differs
    from `rlproxy serve`'s defaults ({} when it runs on the defaults)."""
    return {
        "commit": _git("rev-parse", "HEAD"),
        "uncommitted_changes": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "settings_differing_from_defaults": dict(sorted((settings or {}).items())),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "_t0": time.monotonic(),
        **extra,
    }


def finish(record: dict[str, Any], *, stopped_early: str | None = None) -> dict[str, Any]:
    """The record with the end's figures; `stopped_early`: why the run ended before its plan."""
    out = {k: v for k, v in record.items() if k != "_t0"}
    out["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    out["wall_s"] = round(time.monotonic() - record["_t0"], 1)
    out["stopped_early"] = stopped_early
    return out


WHERE = ("host", "port", "data_dir", "model_dir", "database_url", "replica_id")
"""Settings that say where things are, not how rlproxy behaves: never reported as differing."""


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out |= _flatten(v, f"{prefix}{k}.")
        return out
    return {prefix.rstrip("."): value}


def settings_differing(env: dict[str, str]) -> dict[str, Any]:
    """The settings `env` (a server's RLPROXY_* variables) gives `rlproxy serve` that differ from
    its defaults, by the settings' own field paths (`trainer.config.learning_rate`,
    `rollout.enabled`), each with the value it takes: read by the settings class itself, so a
    variable set to its default is not reported and a JSON object (RLPROXY_TRAINER) is compared
    key by key. Where things live (`WHERE`) is left out."""
    import warnings

    sys.path.insert(0, str(REPO))
    from proxy.settings import Settings

    saved = {k: v for k, v in os.environ.items() if k.startswith("RLPROXY_")}

    def dump() -> dict[str, Any]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # pydantic's serializer warning on TrainerConfig
            return _flatten(Settings().model_dump(mode="json"))

    try:
        for k in saved:
            del os.environ[k]
        defaults = dump()
        os.environ.update({k: v for k, v in env.items() if k.startswith("RLPROXY_")})
        chosen = dump()
    finally:
        for k in [k for k in os.environ if k.startswith("RLPROXY_")]:
            del os.environ[k]
        os.environ.update(saved)
    return {
        path: value
        for path, value in sorted(chosen.items())
        if defaults.get(path) != value and path.split(".")[0] not in WHERE
    }
