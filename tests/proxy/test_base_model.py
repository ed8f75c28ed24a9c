"""RLPROXY_BASE_MODEL: which folder the engine and the trainer load, stop tokens, clear errors,
and no hub access unless a hub id is named (and then none when the hub is off)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from proxy.engines.loader import (
    CACHE_NAME,
    ModelNotAvailableError,
    bundled_gguf_path,
    ensure_fp32_cache,
    load_model,
    resolve_model_dir,
)
from proxy.settings import Settings
from tests.tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory, model_data_dir: Path) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama") / "model"
    return build_tiny_model(folder, ensure_fp32_cache(model_data_dir), "llama3")


def test_unset_is_the_embedded_model(model_data_dir: Path) -> None:
    assert Settings().base_model is None
    assert resolve_model_dir(None, model_data_dir) == model_data_dir / "models" / CACHE_NAME
    assert resolve_model_dir("", model_data_dir) == model_data_dir / "models" / CACHE_NAME


def test_a_folder_is_loaded_as_it_is_with_its_stop_tokens(tiny_llama: Path, tmp_path) -> None:
    assert resolve_model_dir(str(tiny_llama), tmp_path) == tiny_llama
    assert not (tmp_path / "models").exists()  # nothing converted or copied
    loaded = load_model(tmp_path, base_model=str(tiny_llama))
    assert loaded.source == tiny_llama and loaded.model.config.model_type == "llama"
    tok = loaded.tokenizer
    ends = {tok.convert_tokens_to_ids(t) for t in ("<|eot_id|>", "<|eom_id|>")}
    assert ends <= loaded.stop_token_ids  # the generation config's list, not only EOS


def test_the_trainer_gets_the_same_folder(tiny_llama: Path, tmp_path) -> None:
    """`rlproxy train` hands the backend `resolve_model_dir(base_model, cache)`: the same
    weights the engine serves."""
    from trainer.config import TrainerConfig
    from trainer.peft_backend import PeftTrainer

    settings = Settings(base_model=str(tiny_llama), data_dir=tmp_path)
    model_dir = resolve_model_dir(settings.base_model, settings.model_dir or settings.data_dir)
    trainer = PeftTrainer(model_dir, TrainerConfig())
    assert trainer.model.base_model.config.model_type == "llama"


@pytest.mark.parametrize(
    ("kind", "message"),
    [("folder", "no config.json"), ("file", "must be a .gguf"), ("none", "no such folder")],
)
def test_bad_local_paths_say_what_is_wrong(tmp_path, kind: str, message: str) -> None:
    path = tmp_path / "thing"
    if kind == "folder":
        path.mkdir()
    elif kind == "file":
        path.write_text("x")
    with pytest.raises(ModelNotAvailableError, match=message):
        resolve_model_dir(str(path), tmp_path)
    with pytest.raises(ModelNotAvailableError, match="no such folder"):
        resolve_model_dir("./relative/missing", tmp_path)


def test_a_hub_id_is_fetched_only_when_the_hub_is_allowed(monkeypatch, tmp_path) -> None:
    """With the hub switched off (HF_HUB_OFFLINE, checked by huggingface_hub before every
    request), a hub id fails with a message that says what to do; no request leaves."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelNotAvailableError, match=r"could not be fetched.*Name a local folder"):
        resolve_model_dir("rlproxy-tests/no-such-model", tmp_path)


@pytest.mark.slow
def test_a_gguf_file_is_converted_once(tmp_path) -> None:
    gguf = bundled_gguf_path()
    first = resolve_model_dir(str(gguf), tmp_path)
    assert first.parent == tmp_path / "models" and first.name.endswith("-fp32")
    assert first.name.startswith(gguf.stem.lower())
    stamp = os.stat(first / "model.safetensors").st_mtime_ns
    assert resolve_model_dir(str(gguf), tmp_path) == first
    assert os.stat(first / "model.safetensors").st_mtime_ns == stamp  # not converted again
    loaded = load_model(tmp_path, base_model=str(gguf))
    assert loaded.tokenizer.eos_token == "<|im_end|>"
