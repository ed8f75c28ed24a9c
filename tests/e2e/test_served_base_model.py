"""Which base model is served, as `GET /health` and `GET /v1/models` tell it (issue 24: an
operator could not tell whether the folder they named was loaded).

vLLM's `/v1/models` names its base in each card's `root` (what `--model` named) and a LoRA's
base in `parent`; rlproxy's entries do the same: `root` is the base model (RLPROXY_BASE_MODEL as
given, or the embedded model), a version's `parent` is `NAME@base`. `/health` has `base_model`.
The session server runs the embedded model.
"""

from __future__ import annotations

import httpx

from tests.e2e.conftest import Server

EMBEDDED = "SmolLM2-135M-Instruct (embedded)"


def test_health_and_every_policy_entry_name_the_base_model(server: Server) -> None:
    health = httpx.get(f"{server.url}/health", timeout=30).json()
    assert health["base_model"] == EMBEDDED
    entries = httpx.get(f"{server.base_url}/models", timeout=30).json()["data"]
    mine = [m for m in entries if m["owned_by"] == "rlproxy"]
    assert {m["id"] for m in mine} >= {"rlproxy", "rlproxy@base"}
    for m in mine:
        assert m["root"] == EMBEDDED
        assert m["parent"] == ("rlproxy@base" if m["id"][len("rlproxy@") :].isdigit() else None)
    one = httpx.get(f"{server.base_url}/models/rlproxy", timeout=30).json()
    assert (one["root"], one["parent"]) == (EMBEDDED, None)
