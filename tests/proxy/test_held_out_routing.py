"""A held-out task's base arm in the served-model registry: the base for the policy name, before
any canary's draw; pins as asked; the policy arm routed as any call."""

from __future__ import annotations

import random

from proxy.adapters.registry import ServedModels


def _registry(canary_share: float | None = None) -> ServedModels:
    reg = ServedModels("rlproxy", aliases=("gpt-4o-mini",), rng=random.Random(3))
    reg.add_version(1)
    reg.add_version(2)
    reg.activate(1)
    if canary_share is not None:
        reg.start_canary(2, canary_share)
    return reg


def test_the_base_arm_gets_the_base_for_the_policy_name_and_its_aliases() -> None:
    reg = _registry()
    for name in ("rlproxy", "gpt-4o-mini"):
        routed = reg.route(reg.resolve(name), "m:key", held_out="base")
        assert routed.version is None and routed.follows_policy and routed.requested == name


def test_the_base_arm_comes_before_a_canary_draw() -> None:
    reg = _registry(canary_share=0.99)
    draws = {reg.route(reg.resolve("rlproxy"), None, held_out="base").version for _ in range(200)}
    assert draws == {None}


def test_pins_are_served_as_asked_in_either_arm() -> None:
    reg = _registry(canary_share=0.5)
    for arm in ("base", "policy", None):
        assert reg.route(reg.resolve("rlproxy@2"), None, held_out=arm).version == 2  # type: ignore[arg-type]


def test_the_policy_arm_is_routed_as_any_call() -> None:
    assert _registry().route(_registry().resolve("rlproxy"), None, held_out="policy").version == 1
    reg = _registry(canary_share=0.5)
    draws = {reg.route(reg.resolve("rlproxy"), None, held_out="policy").version for _ in range(400)}
    assert draws == {1, 2}
