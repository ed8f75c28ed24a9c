"""The test models of tests/tiny_models.py do what the tests that serve them rely on: the context
they are built with, and (with `words`) answers that are a few of those words and then end."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny_models import build_tiny_model

WORDS = " a tiny random test model answers with these words"


@pytest.fixture(scope="module")
def wordy(tmp_path_factory: pytest.TempPathFactory, model_data_dir: Path) -> Path:
    from proxy.engines.loader import ensure_fp32_cache

    folder = tmp_path_factory.mktemp("tiny-words") / "model"
    embedded = ensure_fp32_cache(model_data_dir)
    return build_tiny_model(folder, embedded, "qwen2", context=65536, words=WORDS)


@pytest.mark.parametrize("system", ["Be brief.", "You are a coding agent. " * 400])
def test_answers_are_a_few_of_its_words_and_end(wordy: Path, tmp_path: Path, system: str) -> None:
    import torch

    from proxy.engines.loader import load_model

    loaded = load_model(tmp_path, base_model=str(wordy))
    assert loaded.model.config.max_position_embeddings == 65536
    tokenizer = loaded.tokenizer
    prompt = tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": "Say hello."}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    words = set(WORDS.split())
    torch.manual_seed(0)
    lengths = []
    for _ in range(8):
        out = loaded.model.generate(**prompt, do_sample=True, max_new_tokens=300)
        new = out[0, prompt["input_ids"].shape[1] :].tolist()
        assert new[-1] in loaded.stop_token_ids, "the answer ran to the budget"
        text = tokenizer.decode(new[:-1])
        assert text.split() and set(text.split()) <= words, text
        lengths.append(len(new))
    assert sum(lengths) / len(lengths) < 40  # about 10 tokens each
