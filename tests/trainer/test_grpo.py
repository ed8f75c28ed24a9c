"""The GRPO advantage and loss on hand-made tensors; expected values are worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.grpo import (
    group_advantages,
    grpo_loss,
    leave_one_out_advantages,
    sample_row_weights,
    token_logprobs,
    truncated_importance_weights,
)

# ----------------------------------------------------------------- advantages


def test_advantage_is_reward_minus_mean_over_population_std() -> None:
    # mean 0.5; population std sqrt(((-.5)^2 + .5^2) / 2) = 0.5 (the sample std would be 0.707)
    assert group_advantages([0.0, 1.0], eps=0.0) == pytest.approx([-1.0, 1.0])
    # mean 2; deviations -1, 0, 0, 1; population std sqrt(2 / 4)
    std = math.sqrt(0.5)
    assert group_advantages([1.0, 2.0, 2.0, 3.0]) == pytest.approx(
        [-1 / (std + 1e-6), 0.0, 0.0, 1 / (std + 1e-6)]
    )


def test_advantage_without_std_scaling_is_centred_reward() -> None:
    assert group_advantages([0.2, 0.4, 0.9], scale_by_std=False) == pytest.approx([-0.3, -0.1, 0.4])


@pytest.mark.parametrize("rewards", [[0.5, 0.5, 0.5], [1.0], []])
def test_group_without_variance_is_skipped(rewards: list[float]) -> None:
    assert group_advantages(rewards) is None


def test_non_finite_reward_is_refused() -> None:
    with pytest.raises(ValueError, match="finite"):
        group_advantages([0.0, float("nan")])


# ----------------------------------------------------------------- token logprobs


def test_token_logprobs_is_log_softmax_gathered() -> None:
    logits = torch.tensor([[[0.0, 0.0], [math.log(3.0), 0.0]]])  # (1, 2, 2)
    targets = torch.tensor([[1, 0]])
    expected = torch.tensor([[math.log(0.5), math.log(0.75)]])
    assert torch.allclose(token_logprobs(logits, targets), expected)


# ----------------------------------------------------------------- the loss


def test_loss_value_on_hand_made_tensors() -> None:
    # Two samples, one row each. Row 0: ratios e^0.1 and 1, advantage +1 (within the clip).
    # Row 1: ratio e^-0.5 = 0.607 < 0.8 with advantage -2: min(0.607 * -2, 0.8 * -2) = -1.6.
    new = torch.tensor([[-1.0, -2.0], [-1.5, 0.0]])
    old = torch.tensor([[-1.1, -2.0], [-1.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, metrics = grpo_loss(new, old, torch.tensor([1.0, -2.0]), mask, epsilon=0.2)
    sample0 = -(math.exp(0.1) * 1 + 1.0 * 1) / 2
    sample1 = -(0.8 * -2.0)
    assert loss.item() == pytest.approx((sample0 + sample1) / 2, rel=1e-6)
    assert metrics["tokens"] == 3
    assert metrics["clip_fraction"] == pytest.approx(1 / 3)
    assert metrics["ratio_mean"] == pytest.approx((math.exp(0.1) + 1 + math.exp(-0.5)) / 3)
    assert metrics["kl"] == 0.0


def test_masked_garbage_changes_neither_loss_nor_gradients() -> None:
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    clean = torch.tensor([[-1.0, -0.5, 0.0, 0.0], [-2.0, 0.0, 0.0, 0.0]], requires_grad=True)
    dirty_values = clean.detach().clone()
    dirty_values[~mask] = torch.tensor([float("nan"), float("inf"), 1e9, -float("inf"), 7.0])
    dirty = dirty_values.requires_grad_()
    old = torch.tensor([[-1.1, -0.4, float("nan"), 3.0], [-2.2, float("inf"), 1.0, 2.0]])
    adv = torch.tensor([0.7, -1.3])
    ref = torch.tensor([[-0.9, -0.6, float("nan"), 5.0], [-1.9, -float("inf"), 0.0, 1.0]])
    kwargs = {"kl_beta": 0.1, "ref_logprobs": ref}
    loss_clean, _ = grpo_loss(clean, old, adv, mask, **kwargs)  # type: ignore[arg-type]
    loss_dirty, _ = grpo_loss(dirty, old, adv, mask, **kwargs)  # type: ignore[arg-type]
    loss_clean.backward()
    loss_dirty.backward()
    assert torch.isfinite(loss_dirty)
    assert loss_dirty.item() == pytest.approx(loss_clean.item())
    assert clean.grad is not None and dirty.grad is not None
    assert torch.equal(clean.grad, dirty.grad)
    assert torch.all(dirty.grad[~mask] == 0)


def _grad_of_one_token(new_lp: float, old_lp: float, advantage: float) -> float:
    new = torch.tensor([[new_lp]], requires_grad=True)
    loss, _ = grpo_loss(new, torch.tensor([[old_lp]]), torch.tensor([advantage]), torch.ones(1, 1))
    loss.backward()
    assert new.grad is not None
    return float(new.grad)


def test_clipping_zeroes_the_gradient_only_where_ppo_says() -> None:
    up, down = math.log(1.5), math.log(0.5)  # ratios 1.5 and 0.5, outside [0.8, 1.2]
    assert _grad_of_one_token(up, 0.0, +1.0) == 0.0  # moved up enough for a good token
    assert _grad_of_one_token(down, 0.0, -1.0) == 0.0  # moved down enough for a bad token
    # the other side is not clipped: d(-r A)/d logp = -r A
    assert _grad_of_one_token(up, 0.0, -1.0) == pytest.approx(1.5)
    assert _grad_of_one_token(down, 0.0, +1.0) == pytest.approx(-0.5)
    assert _grad_of_one_token(0.0, 0.0, +2.0) == pytest.approx(-2.0)  # ratio 1: gradient -A


def test_long_sample_does_not_dominate() -> None:
    # Sample 0 has 1 token with loss -1 (A=1, ratio 1); sample 1 has 9 tokens with loss +1.
    # Per-sample mean: (-1 + 1) / 2 = 0; a flat token mean would give (−1 + 9) / 10 = 0.8.
    mask = torch.zeros(2, 9)
    mask[0, 0] = 1
    mask[1, :] = 1
    zeros = torch.zeros(2, 9)
    loss, _ = grpo_loss(zeros, zeros, torch.tensor([1.0, -1.0]), mask)
    assert loss.item() == pytest.approx(0.0, abs=1e-7)


def test_turns_of_one_sample_average_together_and_count_once() -> None:
    # Rows 0 and 1 are two turns of sample "a" (1 + 3 tokens, A=1, ratio 1: token loss -1);
    # row 2 is sample "b" (2 tokens, A=-1: token loss +1). Samples average to (-1 + 1) / 2 = 0;
    # treating rows as samples would give (-1 - 1 + 1) / 3.
    mask = torch.tensor([[1, 0, 0], [1, 1, 1], [1, 1, 0]])
    zeros = torch.zeros(3, 3)
    adv = torch.tensor([1.0, 1.0, -1.0])
    loss, _ = grpo_loss(zeros, zeros, adv, mask, sample_ids=torch.tensor([0, 0, 1]))
    assert loss.item() == pytest.approx(0.0, abs=1e-7)
    as_rows, _ = grpo_loss(zeros, zeros, adv, mask)
    assert as_rows.item() == pytest.approx(-1 / 3)
    weights = sample_row_weights(mask.sum(1), torch.tensor([0, 0, 1]))
    assert weights.tolist() == pytest.approx([1 / 8, 1 / 8, 1 / 4])


def test_micro_batches_with_full_batch_weights_add_up_to_the_full_loss() -> None:
    gen = torch.Generator().manual_seed(0)
    new = torch.randn(5, 6, generator=gen) - 2
    old = new + 0.3 * torch.randn(5, 6, generator=gen)
    adv = torch.randn(5, generator=gen)
    mask = torch.rand(5, 6, generator=gen) > 0.3
    ids = torch.tensor([0, 1, 1, 2, 0])
    full, _ = grpo_loss(new, old, adv, mask, sample_ids=ids)
    weights = sample_row_weights(mask.sum(1), ids)
    parts = [
        grpo_loss(new[s], old[s], adv[s], mask[s], row_weights=weights[s])[0]
        for s in (slice(0, 2), slice(2, 5))
    ]
    assert (parts[0] + parts[1]).item() == pytest.approx(full.item(), rel=1e-6)


def test_kl_term_is_k3_to_the_reference() -> None:
    # ref - new = 0.5: k3 = e^0.5 - 0.5 - 1; with zero advantage the loss is beta * k3.
    new = torch.tensor([[-1.5]])
    ref = torch.tensor([[-1.0]])
    k3 = math.exp(0.5) - 0.5 - 1
    loss, metrics = grpo_loss(
        new, new, torch.tensor([0.0]), torch.ones(1, 1), kl_beta=0.1, ref_logprobs=ref
    )
    assert loss.item() == pytest.approx(0.1 * k3)
    assert metrics["kl"] == pytest.approx(k3)
    off, _ = grpo_loss(new, new, torch.tensor([0.0]), torch.ones(1, 1), ref_logprobs=ref)
    assert off.item() == 0.0


def test_kl_without_reference_is_refused() -> None:
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(
            torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1), kl_beta=0.1
        )


def test_advantages_of_huge_rewards_are_finite_or_refused() -> None:
    """Normalising never overflows into inf or NaN advantages: it is exact, or a ValueError."""
    for rewards in ([1e308, 1e308, 0.0], [1e6, -1e6, 0.0]):
        advantages = group_advantages(rewards)
        assert advantages is not None and all(math.isfinite(a) for a in advantages)
        unit = [r / max(abs(x) for x in rewards) for r in rewards]
        assert advantages == pytest.approx(group_advantages(unit), rel=1e-5)  # eps / std
    with pytest.raises(ValueError, match="too large"):
        group_advantages([1.7e308, -1.7e308, 1.7e308])  # reward - mean itself overflows


# ----------------------------------------------------------------- off-policy correction (TIS)


def test_truncated_importance_weight_is_the_ratio_capped() -> None:
    # pi_old / mu = 0.5, 1.5, 3 (capped at 2); the masked position holds garbage.
    prox = torch.tensor([[math.log(0.5), math.log(1.5), math.log(3.0), float("nan")]]) - 1.0
    behaviour = torch.full((1, 4), -1.0)
    behaviour[0, 3] = float("inf")
    mask = torch.tensor([[1, 1, 1, 0]])
    weights = truncated_importance_weights(prox, behaviour, mask, cap=2.0)
    assert weights[0].tolist() == pytest.approx([0.5, 1.5, 2.0, 0.0])
    assert not weights.requires_grad
    # a gap too large for exp() is capped, not inf
    huge = truncated_importance_weights(
        torch.tensor([[0.0]]), torch.tensor([[-1e4]]), mask[:, :1], cap=2.0
    )
    assert huge.item() == 2.0


def test_tis_with_equal_logprobs_weighs_one_and_is_todays_loss_and_gradient() -> None:
    gen = torch.Generator().manual_seed(1)
    values = torch.randn(3, 5, generator=gen) - 2
    adv = torch.tensor([1.5, -0.5, -1.0])
    mask = torch.rand(3, 5, generator=gen) > 0.2
    stored = values.clone()  # what the engine stored is what the trainer computes
    ppo_new = values.clone().requires_grad_(True)
    ppo_loss, ppo_metrics = grpo_loss(ppo_new, stored, adv, mask)
    ppo_loss.backward()
    tis_new = values.clone().requires_grad_(True)
    tis_loss, tis_metrics = grpo_loss(
        tis_new, tis_new.detach(), adv, mask, behaviour_logprobs=stored, tis_cap=2.0
    )
    tis_loss.backward()
    assert tis_loss.item() == pytest.approx(ppo_loss.item(), rel=1e-6)
    assert ppo_new.grad is not None and tis_new.grad is not None
    assert torch.allclose(tis_new.grad, ppo_new.grad)
    assert tis_metrics["is_weight_mean"] == pytest.approx(1.0)
    assert tis_metrics["is_capped_fraction"] == 0.0
    assert ppo_metrics["is_weight_mean"] == 1.0


def _tis_grad(behaviour_lp: float, advantage: float, cap: float = 2.0) -> float:
    """d loss / d logp of one token at logp 0 (so pi_old / mu = exp(-behaviour_lp)), TIS on."""
    new = torch.tensor([[0.0]], requires_grad=True)
    loss, _ = grpo_loss(
        new,
        new.detach(),
        torch.tensor([advantage]),
        torch.ones(1, 1),
        behaviour_logprobs=torch.tensor([[behaviour_lp]]),
        tis_cap=cap,
    )
    loss.backward()
    assert new.grad is not None
    return float(new.grad)


def test_tis_keeps_the_gradient_the_stored_ratio_clips_and_caps_its_weight() -> None:
    # The policy made a token 3 times likelier than the version that sampled it (mu = 1/3).
    moved = math.log(1 / 3)
    # Against the stored logprob, PPO's ratio is 3: a good token gets no gradient at all...
    assert _grad_of_one_token(0.0, moved, +1.0) == 0.0
    # ...and a bad one is pushed down 3 times as hard (unbounded: 50x for a ratio of 50).
    assert _grad_of_one_token(0.0, moved, -1.0) == pytest.approx(3.0)
    assert _grad_of_one_token(0.0, math.log(1 / 50), -1.0) == pytest.approx(50.0)
    # TIS: the clip is around pi_old (ratio 1), the weight min(3, cap) = 2 for both signs.
    assert _tis_grad(moved, +1.0) == pytest.approx(-2.0)
    assert _tis_grad(moved, -1.0) == pytest.approx(2.0)
    assert _tis_grad(math.log(1 / 50), -1.0) == pytest.approx(2.0)
    assert _tis_grad(moved, +1.0, cap=1.0) == pytest.approx(-1.0)
    # A token the policy moved away from (pi_old / mu = 0.5) counts half, never more than 1.
    assert _tis_grad(math.log(2.0), +1.0) == pytest.approx(-0.5)


def test_tis_metrics_report_the_mean_weight_and_the_capped_share() -> None:
    new = torch.zeros(1, 4)
    behaviour = torch.log(torch.tensor([[1.0, 2.0, 0.25, 0.1]]))  # weights 1, 0.5, 2 (cap), 2
    _, metrics = grpo_loss(
        new, new, torch.tensor([1.0]), torch.ones(1, 4), behaviour_logprobs=behaviour
    )
    assert metrics["is_weight_mean"] == pytest.approx((1 + 0.5 + 2 + 2) / 4)
    assert metrics["is_capped_fraction"] == pytest.approx(0.5)


def test_a_cohort_of_different_tasks_gets_leave_one_out_advantages() -> None:
    """A_i = r_i - mean of the others, unscaled (docs/concepts/groups.md)."""
    rewards = [1.0, 0.0, 0.1, 0.0]
    assert leave_one_out_advantages(rewards) == pytest.approx(
        [1.0 - 0.1 / 3, 0.0 - 1.1 / 3, 0.1 - 1.0 / 3, 0.0 - 1.1 / 3]
    )
    # n/(n-1) times the centred reward: no std, so the scale stays the reward's
    mean = sum(rewards) / 4
    assert leave_one_out_advantages(rewards) == pytest.approx([4 / 3 * (r - mean) for r in rewards])
    assert leave_one_out_advantages([0.5, 0.5, 0.5]) is None
    assert leave_one_out_advantages([1.0]) is None
    with pytest.raises(ValueError):
        leave_one_out_advantages([1.0, float("nan")])


def test_a_members_own_reward_never_enters_its_baseline() -> None:
    """The property that keeps the gradient unbiased over a mix of tasks: changing member i's
    reward moves only A_i by that much, and every other advantage by 1/(n-1) of it the other
    way (its baseline), never A_i's baseline."""
    before = leave_one_out_advantages([0.0, 1.0, 0.2, 0.4])
    after = leave_one_out_advantages([0.0, 1.0, 0.2, 0.7])
    assert before is not None and after is not None
    assert after[3] - before[3] == pytest.approx(0.3)
    assert [a - b for a, b in zip(after[:3], before[:3], strict=True)] == pytest.approx(
        [-0.1, -0.1, -0.1]
    )
