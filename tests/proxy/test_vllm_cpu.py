"""`serve --vllm-cpu`'s rules that need no vLLM: the LoRA rank it asks vLLM for, its flags, and
the refusal when vLLM servers are already named. The server itself: tests/vllm_real/."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest

from proxy.cli.vllm_cpu import VLLMServer, lora_rank_limit, server_args


@pytest.mark.parametrize(("rank", "limit"), [(1, 8), (8, 8), (9, 16), (16, 16), (200, 256)])
def test_the_lora_rank_asked_of_vllm_holds_the_trainers(rank: int, limit: int) -> None:
    assert lora_rank_limit(rank) == limit


def test_a_rank_vllm_cannot_hold_is_refused() -> None:
    with pytest.raises(ValueError, match="above vLLM's largest"):
        lora_rank_limit(513)


def test_the_flags_rlproxy_needs() -> None:
    args = server_args(Path("/m"), 8711, 32)
    flag = dict(itertools.pairwise(args))
    assert flag["--model"] == "/m" and flag["--port"] == "8711" and flag["--host"] == "127.0.0.1"
    assert flag["--max-lora-rank"] == "32" and "--enable-lora" in args
    assert flag["--logprobs-mode"] == "raw_logprobs"
    assert flag["--structured-outputs-config.backend"] == "guidance"


def test_a_server_for_long_sessions_gets_its_context_kv_cache_and_threads() -> None:
    server = VLLMServer(
        Path("/m"),
        8711,
        Path("vllm.log"),
        threads=2,
        lora_rank=8,
        max_model_len=32768,
        kv_cache_gib=4,
    )
    flag = dict(itertools.pairwise(server.command(Path("/venv/bin/python"))))
    assert flag["--max-model-len"] == "32768" and flag["--max-lora-rank"] == "8"
    env = server.env()
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "4" and env["OMP_NUM_THREADS"] == "2"
    plain = VLLMServer(Path("/m"), 8711, Path("vllm.log"), threads=1, lora_rank=16)
    assert dict(itertools.pairwise(plain.command(Path("python"))))["--max-model-len"] == "2048"
    assert plain.env()["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_vllm_urls_and_vllm_cpu_together_are_refused(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "RLPROXY_DATA_DIR": str(tmp_path),
        "RLPROXY_ENGINE": "vllm",
        "RLPROXY_VLLM_URLS": '["http://127.0.0.1:9"]',
    }
    done = subprocess.run(
        [sys.executable, "-m", "proxy.cli", "serve", "--vllm-cpu"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "unset RLPROXY_VLLM_URLS" in done.stderr
