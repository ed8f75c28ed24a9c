"""Trainer backends on tiny causal LMs built here from configs (random weights, no download):
any model folder trains; a shared prompt prefix, gradient checkpointing and micro-batches change
neither the loss nor the gradients; backend selection; the Unsloth backend says why it cannot
run on this machine."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from peft.utils import set_peft_model_state_dict
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_layers import GradientCheckpointingLayer

from trainer.backends import open_trainer
from trainer.checkpoints import read_adapter_config, validate_adapter
from trainer.config import TrainerConfig
from trainer.grpo import TrainingExample
from trainer.logprobs import final_logits
from trainer.peft_backend import PeftTrainer, resolve_dtype
from trainer.unsloth_backend import UnslothUnavailable

VOCAB = 97


def _tiny(path: Path, model_type: str, **extra: Any) -> Path:
    config = AutoConfig.for_model(
        model_type,
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=0,
        **extra,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(path))
    return path


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny models: one torch thread. Two threads on a loaded 2-core machine wait on each other
    at every small op (measured here: a tiny step took 12-21 s with two, 0.2 s with one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny(tmp_path_factory.mktemp(request.param), request.param)


def _examples() -> list[TrainingExample]:
    """Two groups whose members share a prompt (and both groups a 12-token 'system' head), with
    completions of different lengths; sample "a1" has a second, longer turn."""
    g = torch.Generator().manual_seed(1)

    def ids(n: int) -> list[int]:
        return torch.randint(1, VOCAB, (n,), generator=g).tolist()

    system = ids(12)
    out = []
    for group, prompt in (("a", system + ids(9)), ("b", system + ids(14))):
        for i, (length, adv) in enumerate(((5, 1.0), (9, -1.0), (2, 0.5), (7, -0.5))):
            completion = ids(length)
            old = (-torch.rand(length, generator=g) * 3).tolist()
            out.append(TrainingExample(f"{group}{i}", prompt, completion, old, adv))
    turn2 = out[1].prompt_ids + out[1].completion_ids + ids(4)
    out.append(TrainingExample("a1", turn2, ids(6), [-1.5] * 6, -1.0))
    return out


def _step_gradients(trainer: PeftTrainer, examples: list[TrainingExample]) -> Any:
    """One step's metrics and the gradients it applied; weights and optimizer put back after."""
    grads: list[dict[str, torch.Tensor]] = []
    hook = trainer.optimizer.register_step_pre_hook(
        lambda *_: grads.append({n: p.grad.clone() for n, p in trainer._params.items()})  # type: ignore[union-attr]
    )
    weights, optimizer = trainer.adapter_state(), copy.deepcopy(trainer.optimizer.state_dict())
    metrics = trainer.train_step(examples)
    hook.remove()
    set_peft_model_state_dict(trainer.model, weights)
    trainer.optimizer.load_state_dict(optimizer)
    trainer.step -= 1
    return metrics, grads[0]


def _assert_same(a: Any, b: Any, *, rel: float = 1e-4) -> None:
    (ma, ga), (mb, gb) = a, b
    assert ma.loss == pytest.approx(mb.loss, rel=rel, abs=1e-7)
    assert ma.tokens == mb.tokens and ma.forward_tokens == mb.forward_tokens
    for name, grad in ga.items():
        assert (gb[name] - grad).norm() <= rel * grad.norm() + 1e-8, name


def test_a_tiny_model_of_another_family_trains_and_checkpoints(
    tiny_dir: Path, tmp_path: Path
) -> None:
    trainer = PeftTrainer(tiny_dir, TrainerConfig(learning_rate=1e-2), device="cpu")
    assert trainer.dtype == torch.float32  # 'auto' on the CPU
    before = {k: v.clone() for k, v in trainer.adapter_state().items()}
    metrics = trainer.train_step(_examples())
    after = trainer.adapter_state()
    # Every B moved (A gets no gradient while B is still zero, on the first step).
    lora_b = [k for k in before if "lora_B" in k]
    assert lora_b and all(not torch.equal(before[k], after[k]) for k in lora_b)
    assert metrics.turns == 9 and metrics.samples == 8
    path = trainer.save(tmp_path / "policy")
    validate_adapter(path)
    adapter = read_adapter_config(path)  # what vLLM's LoRA loader accepts
    assert adapter["bias"] == "none" and not adapter.get("modules_to_save")
    assert not adapter.get("use_dora")


def test_sharing_the_prompt_prefix_changes_neither_loss_nor_gradients(tiny_dir: Path) -> None:
    trainer = PeftTrainer(tiny_dir, TrainerConfig(micro_batch_size=4), device="cpu")
    assert trainer._share_prefix
    examples = _examples()
    shared = _step_gradients(trainer, examples)
    trainer._share_prefix = False
    full = _step_gradients(trainer, examples)
    _assert_same(shared, full)
    # Rows ordered by prompt: each micro-batch of 4 is one group sharing its whole prompt.
    assert shared[0].computed_tokens < full[0].computed_tokens == full[0].forward_tokens


def test_chunked_logprobs_equal_the_full_logits(tiny_dir: Path) -> None:
    """A long row's logprobs, loss and LoRA gradients with the LM head run a few positions at a
    time (recomputed in the backward) equal those from the model's own full (T, V) logits."""
    trainer = PeftTrainer(
        tiny_dir, TrainerConfig(learning_rate=1e-2, logprob_chunk=7), device="cpu"
    )
    g = torch.Generator().manual_seed(3)
    prompt, completion = torch.randint(1, VOCAB, (2, 120), generator=g).tolist()
    long_row = TrainingExample("long", prompt, completion, [-4.0] * 120, 1.0)
    trainer.train_step([long_row])  # LoRA B off zero: every LoRA matrix gets a gradient
    ids = torch.tensor([prompt + completion])
    keep = torch.arange(239)[None] >= 119  # the positions that predict a completion token
    with torch.no_grad():
        full = trainer.model(input_ids=ids).logits[0, 119:-1].float().log_softmax(-1)
        chunked = trainer._logprobs(ids[:, :-1], torch.ones_like(keep), None, keep, ids[:, 1:])
    torch.testing.assert_close(chunked, full[torch.arange(120), completion], rtol=1e-5, atol=1e-5)

    chunked_step = _step_gradients(trainer, [long_row])
    unchunked = PeftTrainer(
        tiny_dir, TrainerConfig(learning_rate=1e-2, logprob_chunk=10**6), device="cpu"
    )
    set_peft_model_state_dict(unchunked.model, trainer.adapter_state())

    def full_logits(input_ids, attention, positions, keep, targets):  # type: ignore[no-untyped-def]
        logits = unchunked.model(
            input_ids=input_ids, attention_mask=attention, position_ids=positions
        ).logits
        return logits.float().log_softmax(-1).gather(-1, targets[..., None])[..., 0][keep]

    unchunked._logprobs = full_logits  # type: ignore[method-assign]
    full_step = _step_gradients(unchunked, [long_row])
    assert all(g.abs().sum() > 0 for g in chunked_step[1].values())
    _assert_same(chunked_step, full_step)


def test_token_budget_micro_batches_give_the_same_step(tiny_dir: Path) -> None:
    one_batch = PeftTrainer(
        tiny_dir, TrainerConfig(micro_batch_size=16, micro_batch_tokens=None), device="cpu"
    )
    budget = PeftTrainer(
        tiny_dir, TrainerConfig(micro_batch_size=16, micro_batch_tokens=60), device="cpu"
    )
    examples = _examples()
    rows = [budget._prepare(e) for e in examples]
    order = sorted(range(len(rows)), key=lambda i: (rows[i].input_ids[: rows[i].first], i))
    batches = [[rows[i] for i in b] for b in budget._micro_batches(order, rows)]
    # Several passes, each within the budget (a group's shared prompt counted once).
    assert len(batches) > 2 and sum(map(len, batches)) == len(rows)
    assert all(budget._pass_tokens(b) <= 60 for b in batches)
    assert any(len(b) > 1 for b in batches)
    _assert_same(_step_gradients(one_batch, examples), _step_gradients(budget, examples))


def test_shared_prefix_with_kl_to_the_base(tiny_dir: Path) -> None:
    trainer = PeftTrainer(
        tiny_dir, TrainerConfig(kl_beta=0.5, learning_rate=1e-2, micro_batch_size=8), device="cpu"
    )
    examples = _examples()
    trainer.train_step(examples)  # move the LoRA off zero so the KL term has a gradient
    shared = _step_gradients(trainer, examples)
    assert shared[0].kl > 0
    trainer._share_prefix = False
    _assert_same(shared, _step_gradients(trainer, examples))


def test_gradient_checkpointing_and_micro_batches_give_the_same_step(tiny_dir: Path) -> None:
    plain = PeftTrainer(tiny_dir, TrainerConfig(micro_batch_size=8), device="cpu")
    every_pass = TrainerConfig(micro_batch_size=3, checkpoint_min_tokens=0)
    checkpointed = PeftTrainer(tiny_dir, every_pass, device="cpu")
    assert checkpointed.model.get_base_model().is_activation_checkpointing
    assert checkpointed._share_prefix  # a packed sequence, no cache: recomputation is exact
    examples = _examples()
    _assert_same(_step_gradients(plain, examples), _step_gradients(checkpointed, examples))


def test_checkpoint_min_tokens_checkpoints_only_the_long_passes(tiny_dir: Path) -> None:
    plain = PeftTrainer(
        tiny_dir, TrainerConfig(micro_batch_size=3, gradient_checkpointing=False), device="cpu"
    )
    sizes: list[int] = []
    record = plain._checkpoint_pass
    plain._checkpoint_pass = lambda tokens: (sizes.append(tokens), record(tokens))[1]  # type: ignore[method-assign]
    examples = _examples()
    reference = _step_gradients(plain, examples)
    threshold = sorted(set(sizes))[len(set(sizes)) // 2]  # some passes below it, some not
    long_passes = sum(n >= threshold for n in sizes)
    assert 0 < long_passes < len(sizes)

    config = TrainerConfig(micro_batch_size=3, checkpoint_min_tokens=threshold)
    split = PeftTrainer(tiny_dir, config, device="cpu")
    layer = next(m for m in split.model.modules() if isinstance(m, GradientCheckpointingLayer))
    checkpoint = layer._gradient_checkpointing_func
    calls: list[int] = []
    layer._gradient_checkpointing_func = lambda *a, **k: (calls.append(1), checkpoint(*a, **k))[1]
    _assert_same(reference, _step_gradients(split, examples))
    assert len(calls) == long_passes  # the first layer checkpointed each long pass, no other


def test_backend_selection(tiny_dir: Path) -> None:
    assert type(open_trainer(tiny_dir, TrainerConfig(), device="cpu")) is PeftTrainer
    unsloth = TrainerConfig(backend="unsloth")
    # No GPU (and no Unsloth) here: a clear reason, not an ImportError from deep inside.
    with pytest.raises(UnslothUnavailable, match=r"CUDA GPU|not installed"):
        open_trainer(tiny_dir, unsloth)
    with pytest.raises(ValueError, match="open_trainer"):
        PeftTrainer(tiny_dir, unsloth, device="cpu")


def test_dtype_auto_is_bfloat16_on_cuda_only() -> None:
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16


def test_bfloat16_weights_keep_a_float32_lora(tiny_dir: Path) -> None:
    trainer = PeftTrainer(tiny_dir, TrainerConfig(dtype="bfloat16"), device="cpu")
    base = trainer.model.get_base_model()
    assert base.get_input_embeddings().weight.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in trainer._params.values())
    before = {k: v.clone() for k, v in trainer.adapter_state().items()}
    trainer.train_step(_examples()[:4])
    assert any(not torch.equal(v, trainer.adapter_state()[k]) for k, v in before.items())


def test_final_logit_transforms_follow_the_model_family() -> None:
    logits = torch.tensor([[-60.0, 0.0, 3.0, 60.0]])

    def config(model_type: str, **values: float) -> Any:
        return dataclasses.make_dataclass("C", ["model_type", *values])(
            model_type, *values.values()
        )

    torch.testing.assert_close(final_logits(logits, config("llama")), logits)
    torch.testing.assert_close(
        final_logits(logits, config("gemma2", final_logit_softcapping=30.0)),
        torch.tanh(logits / 30.0) * 30.0,
    )
    torch.testing.assert_close(
        final_logits(logits, config("cohere", logit_scale=0.125)), logits * 0.125
    )
    torch.testing.assert_close(
        final_logits(logits, config("granite", logits_scaling=16.0)), logits / 16.0
    )
