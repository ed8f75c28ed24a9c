"""The PEFT trainer backend on the real SmolLM2-135M: training changes the LoRA in the rewarded
direction, micro-batching equals one full batch, checkpoints serve and resume."""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from peft.utils import set_peft_model_state_dict
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from trainer.checkpoints import (
    latest_checkpoint,
    read_adapter_config,
    read_adapter_state,
    read_optimizer_state,
)
from trainer.config import TrainerConfig
from trainer.grpo import TrainingExample
from trainer.packing import pack_turns, turns_in
from trainer.peft_backend import PeftTrainer

MakeTrainer = Callable[..., PeftTrainer]


@pytest.fixture(scope="module")
def model_dir(model_data_dir: Path) -> Path:
    from proxy.engines.loader import ensure_fp32_cache

    return ensure_fp32_cache(model_data_dir)


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture
def make_trainer(model_dir: Path) -> MakeTrainer:
    def make(**changes: Any) -> PeftTrainer:
        return PeftTrainer(model_dir, TrainerConfig(**changes), device="cpu")

    return make


def _prompt(tok: PreTrainedTokenizerBase, question: str) -> list[int]:
    text = tok.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    return list(tok(str(text), add_special_tokens=False)["input_ids"])


def _completion(tok: PreTrainedTokenizerBase, text: str) -> list[int]:
    return list(tok(text + "<|im_end|>", add_special_tokens=False)["input_ids"])


def _logprobs(trainer: PeftTrainer, prompt: list[int], completion: list[int]) -> list[float]:
    """The current policy's logprobs of `completion`, unpadded: what the engine would store."""
    with torch.no_grad():
        logits = trainer.model(input_ids=torch.tensor([prompt + completion])).logits[0]
    picked = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)
    return picked.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1).tolist()


def _example(
    trainer: PeftTrainer,
    sample_id: str,
    prompt: list[int],
    completion: list[int],
    advantage: float,
) -> TrainingExample:
    old = _logprobs(trainer, prompt, completion)
    return TrainingExample(sample_id, prompt, completion, old, advantage)


def _lora(trainer: PeftTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.named_parameters() if "lora_" in k}


def _record_gradients(trainer: PeftTrainer) -> list[dict[str, torch.Tensor]]:
    """The gradients of every later step, as the optimizer is about to apply them."""
    grads: list[dict[str, torch.Tensor]] = []

    def keep(*_: object) -> None:
        grads.append({n: torch.clone(p.grad) for n, p in trainer._params.items()})  # type: ignore[arg-type]

    trainer.optimizer.register_step_pre_hook(keep)
    return grads


def test_train_steps_move_the_lora_towards_the_rewarded_completion(
    make_trainer: MakeTrainer, tok: PreTrainedTokenizerBase
) -> None:
    # The rate the three steps are sized for: the stored logprobs stay step 0's, so by the third
    # step a larger one (the default 1.2e-3) has pushed "good"'s ratio past the clip, and what is
    # left of the step (pushing "bad" down) may move "good" back by a hair.
    trainer = make_trainer(micro_batch_size=2, learning_rate=6e-4)
    prompt = _prompt(tok, "What is the capital of France?")
    good, bad = _completion(tok, "Paris."), _completion(tok, "I do not know, sorry.")
    # Stored logprobs from the current policy: the first step must see a ratio of exactly one,
    # even though the rows are right-padded to different lengths.
    examples = [
        _example(trainer, "good", prompt, good, 1.0),
        _example(trainer, "bad", prompt, bad, -1.0),
        _example(trainer, "other", _prompt(tok, "Name a colour."), _completion(tok, "Blue"), 0.0),
    ]
    before = _lora(trainer)
    good_lp = [sum(_logprobs(trainer, prompt, good))]
    bad_lp = sum(_logprobs(trainer, prompt, bad))
    losses = []
    for step in range(3):
        metrics = trainer.train_step(examples)  # the stored logprobs stay those of step 0
        if step == 0:
            assert metrics.ratio_mean == pytest.approx(1.0, abs=1e-4)
            assert metrics.clip_fraction == 0.0
        losses.append(metrics.loss)
        good_lp.append(sum(_logprobs(trainer, prompt, good)))
    assert trainer.step == 3 and metrics.step == 3
    assert metrics.samples == 3 and metrics.turns == 3
    assert metrics.tokens == len(good) + len(bad) + len(examples[2].completion_ids)
    assert metrics.grad_norm > 0 and metrics.tokens_per_s > 0

    after = _lora(trainer)
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) == len(before)  # every LoRA matrix moved (B starts at zero)
    frozen = {k: v for k, v in trainer.model.named_parameters() if "lora_" not in k}
    assert not any(p.requires_grad for p in frozen.values())
    assert losses[0] > losses[1] > losses[2]
    assert good_lp[0] < good_lp[1] < good_lp[2] < good_lp[3]
    assert sum(_logprobs(trainer, prompt, bad)) < bad_lp


def test_micro_batches_give_the_same_gradient_as_one_batch(
    make_trainer: MakeTrainer, tok: PreTrainedTokenizerBase
) -> None:
    trainer = make_trainer(micro_batch_size=4)
    prompt = _prompt(tok, "Say something.")
    texts = ["Hello there, how are you today?", "Hi", "Good morning to you", "Hey!"]
    # Sample "a" has a long and a short turn that sorting by length puts in different
    # micro-batches; the turns must still average together.
    examples = [
        TrainingExample(sid, prompt, ids, [-2.0] * len(ids), adv)
        for sid, ids, adv in zip(
            "abca", (_completion(tok, t) for t in texts), (1.0, -0.5, -0.5, 1.0), strict=True
        )
    ]
    grads = _record_gradients(trainer)
    weights, optimizer = trainer.adapter_state(), copy.deepcopy(trainer.optimizer.state_dict())
    full = trainer.train_step(examples)

    set_peft_model_state_dict(trainer.model, weights)
    trainer.optimizer.load_state_dict(optimizer)
    trainer.config = dataclasses.replace(trainer.config, micro_batch_size=1)
    split = trainer.train_step(examples)

    assert split.loss == pytest.approx(full.loss, abs=1e-6)
    assert split.grad_norm == pytest.approx(full.grad_norm, rel=1e-3)
    for name, grad in grads[0].items():
        # fp32 noise from the padded batch shape only; a wrong weighting is off by far more.
        assert (grads[1][name] - grad).norm() <= 1e-3 * grad.norm() + 1e-8, name


def test_tis_on_fresh_samples_is_the_ppo_step_and_a_weight_scales_the_loss(
    make_trainer: MakeTrainer, tok: PreTrainedTokenizerBase
) -> None:
    trainer = make_trainer(micro_batch_size=2)
    prompt = _prompt(tok, "Name a colour.")
    examples = [
        _example(trainer, s, prompt, _completion(tok, t), adv)
        for s, t, adv in (("a", "Blue", 1.0), ("b", "I like green a lot", -1.0), ("c", "Red", 0.5))
    ]
    weights, optimizer = trainer.adapter_state(), copy.deepcopy(trainer.optimizer.state_dict())

    def step(examples: list[TrainingExample], **config: Any) -> tuple[Any, dict[str, Any]]:
        set_peft_model_state_dict(trainer.model, weights)
        trainer.optimizer.load_state_dict(optimizer)
        trainer.config = dataclasses.replace(trainer.config, **config)
        metrics = trainer.train_step(examples)
        return metrics, _lora(trainer)

    ppo, ppo_after = step(examples, off_policy_correction="ppo")
    tis, tis_after = step(examples, off_policy_correction="tis")
    assert tis.loss == pytest.approx(ppo.loss, abs=1e-6)
    assert tis.grad_norm == pytest.approx(ppo.grad_norm, rel=1e-4)
    assert tis.is_weight_mean == pytest.approx(1.0, abs=1e-4) and tis.is_capped_fraction == 0.0
    for name, value in ppo_after.items():
        assert torch.allclose(tis_after[name], value, atol=1e-6), name
    # a stale group down-weighted to 0.5 contributes half the loss and half the gradient
    halved, _ = step([dataclasses.replace(e, weight=0.5) for e in examples])
    assert halved.loss == pytest.approx(ppo.loss / 2, abs=1e-6)
    assert halved.grad_norm == pytest.approx(ppo.grad_norm / 2, rel=1e-4)


def test_kl_to_the_base_is_zero_first_then_grows(
    make_trainer: MakeTrainer, tok: PreTrainedTokenizerBase
) -> None:
    trainer = make_trainer(kl_beta=0.1, learning_rate=1e-3)
    prompt = _prompt(tok, "What is two plus two?")
    examples = [
        _example(trainer, "a", prompt, _completion(tok, "Four."), 1.0),
        _example(trainer, "b", prompt, _completion(tok, "Five."), -1.0),
    ]
    assert trainer.train_step(examples).kl == pytest.approx(0.0, abs=1e-6)  # LoRA B is zero
    assert trainer.train_step(examples).kl > 1e-6


def test_bad_examples_are_refused_and_too_long_ones_skipped(
    make_trainer: MakeTrainer, tok: PreTrainedTokenizerBase
) -> None:
    trainer = make_trainer(max_seq_len=16)
    with pytest.raises(ValueError, match="at least one example"):
        trainer.train_step([])
    with pytest.raises(ValueError, match="2 old logprobs for 3"):
        trainer.train_step([TrainingExample("s", [1, 2], [3, 4, 5], [-1.0, -1.0], 1.0)])
    with pytest.raises(ValueError, match="without completion"):
        trainer.train_step([TrainingExample("s", [1, 2], [], [], 1.0)])
    with pytest.raises(ValueError, match="finite"):
        trainer.train_step([TrainingExample("s", [1], [2], [float("nan")], 1.0)])
    with pytest.raises(ValueError, match="weight must be >= 0"):
        trainer.train_step([TrainingExample("s", [1], [2], [-1.0], 1.0, weight=-0.5)])
    for mask in ((True,), (False, True)):  # a flag per token; a packed row starts sampled
        with pytest.raises(ValueError, match="completion_mask"):
            trainer.train_step(
                [TrainingExample("s", [1], [2, 3], [-1.0, -1.0], 1.0, completion_mask=mask)]
            )
    assert trainer.step == 0
    # A stored logprob far below the current one with a negative advantage: the unclipped
    # ratio side overflows. The step is refused and the adapter is left as it was.
    before = _lora(trainer)
    with pytest.raises(FloatingPointError, match="step skipped"):
        trainer.train_step([TrainingExample("s", [1, 2], [3], [-1e4], -1.0)])
    assert trainer.step == 0
    assert all(torch.equal(v, _lora(trainer)[k]) for k, v in before.items())
    # With truncated importance sampling the same sample weighs tis_cap, and the step is made.
    trainer.config = dataclasses.replace(trainer.config, off_policy_correction="tis")
    capped = trainer.train_step([TrainingExample("s", [1, 2], [3], [-1e4], -1.0)])
    assert capped.is_capped_fraction == 1.0 and capped.is_weight_mean == 2.0
    assert trainer.step == 1
    trainer.config = dataclasses.replace(trainer.config, off_policy_correction="ppo")

    # A turn longer than max_seq_len is left out whole (never cut from the left) and counted;
    # the rest of the step trains.
    prompt = _prompt(tok, "Tell me a long story about a cat and a dog.")  # more than 16 tokens
    short = list(range(100, 108))
    fits = TrainingExample("a", prompt[-8:], short, [-3.0] * 8, 1.0)  # 16 tokens
    too_long = TrainingExample("b", prompt, short, [-3.0] * 8, -1.0)
    before = _lora(trainer)
    metrics = trainer.train_step([fits, too_long])
    assert metrics.too_long == 1 and metrics.turns == 1 and metrics.samples == 1
    assert metrics.tokens == 8 and metrics.forward_tokens == 16
    assert any(not torch.equal(v, _lora(trainer)[k]) for k, v in before.items())
    with pytest.raises(ValueError, match="longer than max_seq_len"):
        trainer.train_step([too_long])
    assert trainer.step == 2


def test_max_seq_len_follows_the_model_context(make_trainer: MakeTrainer) -> None:
    assert make_trainer().max_seq_len == 8192  # SmolLM2-135M's max_position_embeddings
    assert make_trainer(max_seq_len=3000).max_seq_len == 3000


def test_checkpoint_is_served_by_peft_and_differs_from_the_base(
    make_trainer: MakeTrainer, tok: PreTrainedTokenizerBase, model_dir: Path, tmp_path: Path
) -> None:
    from peft import PeftModel

    from trainer.checkpoints import validate_adapter

    trainer = make_trainer(learning_rate=1e-3)
    prompt = _prompt(tok, "Name a fruit.")
    trainer.train_step(
        [
            _example(trainer, "a", prompt, _completion(tok, "Apple"), 1.0),
            _example(trainer, "b", prompt, _completion(tok, "Car"), -1.0),
        ]
    )
    path = trainer.save(tmp_path / "policy", {"group_ids": ["g1"]})
    assert path == tmp_path / "policy" / "0001"
    validate_adapter(path)
    # The same files PEFT's own save_pretrained writes (target_modules is a set: order aside).
    trainer.model.save_pretrained(str(tmp_path / "peft"), safe_serialization=True)
    ours, peft_own = read_adapter_state(path), read_adapter_state(tmp_path / "peft")
    assert ours.keys() == peft_own.keys()
    assert all(torch.equal(ours[k], peft_own[k]) for k in ours)
    config, peft_config = read_adapter_config(path), read_adapter_config(tmp_path / "peft")
    assert sorted(peft_config.pop("target_modules")) == config.pop("target_modules")
    assert config == peft_config

    # Load it the way proxy/engines/local.py does, into a fresh base model.
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    served = PeftModel.from_pretrained(base, str(path), adapter_name="v1", is_trainable=False)
    served.eval()
    ids = torch.tensor([prompt + _completion(tok, "Apple")])
    with torch.no_grad():
        served_logits = served(input_ids=ids).logits
        trained_logits = trainer.model(input_ids=ids).logits
        with served.disable_adapter():
            base_logits = served(input_ids=ids).logits
    torch.testing.assert_close(served_logits, trained_logits, rtol=1e-4, atol=1e-4)
    assert (served_logits - base_logits).abs().max() > 1e-3


def test_resume_restores_weights_optimizer_state_and_step(
    make_trainer: MakeTrainer, tok: PreTrainedTokenizerBase, tmp_path: Path
) -> None:
    first = make_trainer()
    prompt = _prompt(tok, "Pick a number.")
    examples = [
        _example(first, "a", prompt, _completion(tok, "Seven"), 1.0),
        _example(first, "b", prompt, _completion(tok, "Banana"), -1.0),
    ]
    first.train_step(examples)
    first.save(tmp_path, {"group_ids": ["g1", "g2"]})

    second = make_trainer()
    path = latest_checkpoint(tmp_path)
    assert path is not None
    state = second.load(path)
    assert second.step == 1 and state["step"] == 1
    assert state["group_ids"] == ["g1", "g2"]
    assert state["config"] == first.config.to_dict()
    assert state["metrics"]["step"] == 1

    name = next(n for n in first._params if "lora_B" in n)
    exp_avg = second.optimizer.state[second._params[name]]["exp_avg"]
    assert exp_avg.abs().sum() > 0
    torch.testing.assert_close(exp_avg, first.optimizer.state[first._params[name]]["exp_avg"])
    torch.testing.assert_close(exp_avg, read_optimizer_state(path)[f"{name}.exp_avg"])
    for key, value in _lora(first).items():
        torch.testing.assert_close(_lora(second)[key], value)

    # The next step from the resumed trainer is the step the first one would have made.
    first.train_step(examples)
    second.train_step(examples)
    for key, value in _lora(first).items():
        torch.testing.assert_close(_lora(second)[key], value)

    with pytest.raises(ValueError, match="same LoRA shape"):
        make_trainer(lora_rank=4).load(path)


def test_logprobs_stored_after_a_grammar_mask_are_not_the_ratio_reference(
    make_trainer: MakeTrainer, tok: PreTrainedTokenizerBase
) -> None:
    """vLLM takes logprobs after a grammar's mask, renormalised over the allowed tokens: higher
    than the policy's own (by 1.02 nats per token on average, measured against a real vLLM under
    `tool_choice: required`). Such turns are flagged; by default the trainer's own logprobs at
    the step's start stand in for them, so the first step's ratio is 1, as for exact ones."""
    trainer = make_trainer(micro_batch_size=2)
    prompt = _prompt(tok, "Call the tool.")
    exact = [
        _example(trainer, s, prompt, _completion(tok, t), adv)
        for s, t, adv in (("a", '{"city": "Paris"}', 1.0), ("b", '{"city": "Oslo"}', -1.0))
    ]
    masked = [
        dataclasses.replace(e, old_logprobs=[x + 1.0 for x in e.old_logprobs], logprobs_masked=True)
        for e in exact
    ]
    weights, optimizer = trainer.adapter_state(), copy.deepcopy(trainer.optimizer.state_dict())

    def step(examples: list[TrainingExample], **config: Any) -> tuple[Any, dict[str, Any]]:
        set_peft_model_state_dict(trainer.model, weights)
        trainer.optimizer.load_state_dict(optimizer)
        trainer.config = dataclasses.replace(trainer.config, **config)
        return trainer.train_step(examples), _lora(trainer)

    reference, _ = step(exact, masked_logprobs="trainer")
    for correction in ("ppo", "tis"):
        fixed, _ = step(masked, masked_logprobs="trainer", off_policy_correction=correction)
        assert fixed.ratio_mean == pytest.approx(1.0, abs=1e-4) and fixed.clip_fraction == 0.0
        # The same step up to fp32 noise (the reference's old logprobs come from another
        # forward; Adam's first step is the gradient's sign, so weights are not compared).
        assert fixed.loss == pytest.approx(reference.loss, abs=1e-5)
        assert fixed.grad_norm == pytest.approx(reference.grad_norm, rel=1e-3)
    # As stored: every token's ratio starts at e^-1, below PPO's clip.
    stored, _ = step(masked, masked_logprobs="stored", off_policy_correction="ppo")
    assert stored.ratio_mean == pytest.approx(math.exp(-1.0), abs=1e-3)
    assert stored.clip_fraction > 0.0
    # Unflagged turns keep their stored logprobs whatever the setting.
    shifted = [dataclasses.replace(e, logprobs_masked=False) for e in masked]
    unflagged, _ = step(shifted, masked_logprobs="trainer")
    assert unflagged.ratio_mean == pytest.approx(math.exp(-1.0), abs=1e-3)


def test_a_packed_trajectory_trains_exactly_like_its_turns_with_its_prompt_run_once(
    make_trainer: MakeTrainer, tok: PreTrainedTokenizerBase
) -> None:
    """Two-turn tool episodes (call, tool result, answer): one packed row per episode gives the
    loss and gradient of one row per turn, and the prompt runs once instead of per turn."""
    trainer = make_trainer(micro_batch_size=4)
    prompt = _prompt(tok, "What is the number of lime?")
    between = list(
        tok("<|im_start|>tool\n14<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)[
            "input_ids"
        ]
    )
    turns = []
    for sid, call, answer, adv in (
        ("a", '{"name": "lookup", "arguments": {"word": "lime"}}', "14", 1.0),
        ("b", '{"name": "lookup", "arguments": {"word": "pink"}}', "9", -1.0),
    ):
        first = _completion(tok, call) + list(tok("\n", add_special_tokens=False)["input_ids"])
        second_prompt = prompt + first + between
        turns += [
            _example(trainer, sid, prompt, first, adv),
            _example(trainer, sid, second_prompt, _completion(tok, answer), adv),
        ]
    packed = pack_turns(turns, max_len=1024)
    assert len(packed) == 2 and [turns_in(r) for r in packed] == [2, 2]

    grads = _record_gradients(trainer)
    weights, optimizer = trainer.adapter_state(), copy.deepcopy(trainer.optimizer.state_dict())
    per_turn = trainer.train_step(turns)
    set_peft_model_state_dict(trainer.model, weights)
    trainer.optimizer.load_state_dict(optimizer)
    one_row = trainer.train_step(packed)

    assert one_row.turns == 2 and per_turn.turns == 4
    assert one_row.tokens == per_turn.tokens  # the same sampled tokens trained on
    assert one_row.ratio_mean == pytest.approx(1.0, abs=1e-4)  # the stored logprobs line up
    assert one_row.loss == pytest.approx(per_turn.loss, abs=1e-6)
    assert one_row.grad_norm == pytest.approx(per_turn.grad_norm, rel=1e-3)
    for name, grad in grads[0].items():
        assert (grads[1][name] - grad).norm() <= 1e-3 * grad.norm() + 1e-8, name
    assert one_row.forward_tokens < per_turn.forward_tokens
    assert one_row.computed_tokens < per_turn.computed_tokens
