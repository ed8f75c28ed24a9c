"""TrainerConfig: defaults, JSON round trip, and invariants that say how to fix a bad value."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import pytest

from trainer.config import TrainerConfig


def test_defaults_are_valid_and_documented() -> None:
    config = TrainerConfig()
    assert config.lora_rank == 8 and config.lora_alpha == 16
    assert config.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj")
    assert config.epsilon == 0.2 and config.kl_beta == 0.0
    assert config.scale_advantages_by_std is True
    assert config.backend == "peft" and config.dtype == "auto"
    assert config.share_prompt_prefix is True and config.gradient_checkpointing is True
    # Whole prompts in bounded memory: the model's context, a token budget per pass.
    assert config.max_seq_len is None and config.micro_batch_tokens == 4096
    assert config.logprob_chunk == 1024 and config.release_memory == "mmap"
    assert config.mmap_threshold == 1024 * 1024  # short rows' tensors reuse the heap
    assert config.checkpoint_min_tokens == 1024  # short passes keep their activations
    assert config.off_policy_correction == "ppo" and config.tis_cap == 2.0
    assert config.max_staleness == 4 and config.stale_policy == "drop"
    for f in fields(TrainerConfig):
        assert f.metadata.get("help"), f"{f.name} has no help text"


def test_round_trip_through_a_dict() -> None:
    config = TrainerConfig(learning_rate=5e-5, target_modules=("q_proj", "v_proj"), kl_beta=0.04)
    data = config.to_dict()
    assert data["target_modules"] == ["q_proj", "v_proj"]
    assert TrainerConfig.from_dict(data) == config
    unbounded = TrainerConfig.from_dict({"max_staleness": None, "off_policy_correction": "tis"})
    assert unbounded.max_staleness is None and unbounded.off_policy_correction == "tis"


def test_memory_options_are_checked() -> None:
    with pytest.raises(ValueError, match="release_memory"):
        TrainerConfig(release_memory="jemalloc")
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        TrainerConfig(micro_batch_tokens=0)
    with pytest.raises(ValueError, match="logprob_chunk"):
        TrainerConfig(logprob_chunk=0)
    with pytest.raises(ValueError, match="max_seq_len"):
        TrainerConfig(max_seq_len=1)
    with pytest.raises(ValueError, match="checkpoint_min_tokens"):
        TrainerConfig(checkpoint_min_tokens=-1)
    with pytest.raises(ValueError, match="mmap_threshold"):
        TrainerConfig(mmap_threshold=0)
    with pytest.raises(ValueError, match="mmap_threshold"):
        TrainerConfig(mmap_threshold=64 * 1024 * 1024)  # mallopt's ceiling is 32 MiB
    assert TrainerConfig(micro_batch_tokens=None).micro_batch_tokens is None


def test_unknown_field_in_a_dict_is_refused() -> None:
    with pytest.raises(ValueError, match="learning_rat"):
        TrainerConfig.from_dict({"learning_rat": 1e-4})


@pytest.mark.parametrize(
    ("changes", "hint"),
    [
        ({"learning_rate": 0.0}, "learning_rate must be a positive"),
        ({"learning_rate": float("nan")}, "learning_rate"),
        ({"lora_rank": 0}, "lora_rank must be >= 1"),
        ({"lora_alpha": 0}, "lora_alpha"),
        ({"lora_dropout": 1.0}, "lora_dropout"),
        ({"target_modules": ()}, "target_modules must name at least one"),
        ({"target_modules": "q_proj"}, "not the string"),
        ({"epsilon": 0.0}, "epsilon must be in"),
        ({"epsilon": 1.0}, "epsilon must be in"),
        ({"kl_beta": -0.1}, "kl_beta must be >= 0"),
        ({"groups_per_step": 0}, "groups_per_step"),
        ({"micro_batch_size": 0}, "micro_batch_size must be >= 1"),
        ({"max_seq_len": 1}, "max_seq_len"),
        ({"max_grad_norm": 0.0}, "max_grad_norm"),
        ({"weight_decay": -1.0}, "weight_decay"),
        ({"backend": "trl"}, "backend must be one of"),
        ({"dtype": "float16"}, "dtype must be one of"),
        ({"backend": "unsloth", "dtype": "float32"}, "unsloth backend trains in 16-bit"),
        ({"off_policy_correction": "vtrace"}, "off_policy_correction must be one of"),
        ({"tis_cap": 0.5}, "tis_cap must be a number >= 1"),
        ({"max_staleness": -1}, "max_staleness must be an integer >= 0 or None"),
        ({"max_staleness": 2.5}, "max_staleness must be an integer"),
        ({"stale_policy": "hold"}, "stale_policy must be one of"),
        ({"stale_weight": 0.0}, "stale_weight must be in"),
    ],
)
def test_invariants(changes: dict[str, Any], hint: str) -> None:
    with pytest.raises(ValueError, match=hint):
        TrainerConfig(**changes)
