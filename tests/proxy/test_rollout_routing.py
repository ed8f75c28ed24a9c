"""The canary's traffic split in the served-model registry, conversations kept on the version
they started with, and the lineage rule that keeps a rolled-back version's descendants out."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from proxy.adapters.registry import Resolved, ServedModels, canary_draw, conversation_key
from storage.linking import PrefixLinker
from storage.records import CallRecord, ChoiceRecord
from trainer import checkpoints


def _registry(share: float = 0.25, seed: int = 7) -> ServedModels:
    reg = ServedModels("rlproxy", aliases=("gpt-4o-mini",), rng=random.Random(seed))
    reg.add_version(1)
    reg.add_version(2)
    reg.activate(1)
    reg.start_canary(2, share)
    return reg


def test_the_policy_name_splits_by_share() -> None:
    reg = _registry(share=0.25)
    draws = [reg.route(reg.resolve("rlproxy")).version for _ in range(20_000)]
    assert set(draws) == {1, 2}
    # binomial(20000, 0.25): sd 0.003; 0.02 is more than six of them
    assert draws.count(2) / len(draws) == pytest.approx(0.25, abs=0.02)
    aliased = [reg.route(reg.resolve("gpt-4o-mini")).version for _ in range(2_000)]
    assert set(aliased) == {1, 2}


def test_pins_and_the_base_are_never_split() -> None:
    reg = _registry(share=0.9)
    assert {reg.route(reg.resolve("rlproxy@1")).version for _ in range(200)} == {1}
    assert {reg.route(reg.resolve("rlproxy@2")).version for _ in range(200)} == {2}
    assert {reg.route(reg.resolve("rlproxy@base")).version for _ in range(200)} == {None}


def test_without_a_canary_routing_changes_nothing() -> None:
    reg = ServedModels("rlproxy")
    reg.add_version(3)
    reg.activate(3)
    resolved = reg.resolve("rlproxy")
    assert reg.route(resolved, "m:any") is resolved


def test_a_conversation_stays_on_the_version_its_first_turn_drew() -> None:
    reg = _registry(share=0.5)
    system = {"role": "system", "content": "Be brief."}
    seen = set()
    for i in range(60):
        first = [system, {"role": "user", "content": f"question {i}"}]
        assert conversation_key(first) is None  # a first turn has nothing to key on yet
        version = reg.route(reg.resolve("rlproxy")).version
        seen.add(version)
        answer = {"role": "assistant", "content": f"answer {i}", "refusal": None}
        key = conversation_key([*first, answer])
        assert key is not None
        reg.remember(key, version)
        # the client sends the whole history back, in its own shape (no refusal field)
        later = [*first, {"role": "assistant", "content": f"answer {i}"}]
        for turn in range(3):
            later = [*later, {"role": "user", "content": f"more {turn}"}]
            assert reg.route(reg.resolve("rlproxy"), conversation_key(later)).version == version
            later = [*later, {"role": "assistant", "content": f"reply {turn}"}]
    assert seen == {1, 2}


def test_an_explicit_trajectory_id_keys_the_conversation() -> None:
    reg = _registry(share=0.5)
    key = conversation_key([{"role": "user", "content": "hi"}], "traj-1")
    assert key == "t:traj-1"
    first = reg.route(reg.resolve("rlproxy"), key).version
    assert {reg.route(reg.resolve("rlproxy"), key).version for _ in range(50)} == {first}


def test_a_keyed_conversation_draws_the_same_on_every_replica_and_after_a_restart() -> None:
    """Two registries with different random generators (two replicas, or one restarted) send
    every keyed conversation to the same version: the draw is a stable hash of its key, not
    the generator's; the split still follows the share; another canary draws anew."""
    a, b = _registry(share=0.25, seed=1), _registry(share=0.25, seed=2)
    keys = [conversation_key([{"role": "user", "content": "hi"}], f"traj-{i}") for i in range(4000)]
    on_a = [a.route(a.resolve("rlproxy"), k).version for k in keys]
    on_b = [b.route(b.resolve("rlproxy"), k).version for k in reversed(keys)][::-1]
    assert on_a == on_b
    # binomial(4000, 0.25): sd 0.0068; 0.04 is about six of them
    assert on_a.count(2) / len(on_a) == pytest.approx(0.25, abs=0.04)
    assert canary_draw("t:traj-1", "rlproxy", 2) == canary_draw("t:traj-1", "rlproxy", 2)
    draws_2 = [canary_draw(k, "rlproxy", 2) < 0.25 for k in keys if k]
    draws_3 = [canary_draw(k, "rlproxy", 3) < 0.25 for k in keys if k]
    assert draws_2 != draws_3  # a new canary does not always pick the same conversations


def test_tool_calls_key_the_same_as_the_client_sends_them_back() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    ours = {"role": "assistant", "content": None, "refusal": None, "tool_calls": [call]}
    theirs = {"role": "assistant", "tool_calls": [{**call, "id": "call_1"}]}
    user = {"role": "user", "content": [{"type": "text", "text": "go"}]}
    user_plain = {"role": "user", "content": "go"}
    assert conversation_key([user, ours]) == conversation_key([user_plain, theirs])


def test_the_conversation_key_is_the_opening_the_trajectory_linker_continues_from() -> None:
    """A conversation the store links as one trajectory draws as one: the key of a later turn
    is the linker's hash of the first turn's request and the answer it got."""
    first = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    record = CallRecord(
        id="c",
        created_at=1.0,
        finished_at=2.0,
        model_requested="rlproxy",
        engine="local",
        request_messages=first,
        choices=[ChoiceRecord(0, {"role": "assistant", "content": "a", "refusal": None})],
        status="completed",
    )
    answered = PrefixLinker().keys(record).next_prefix_hash
    later = [*first, {"role": "assistant", "content": "a"}, {"role": "user", "content": "more"}]
    assert conversation_key(later) == f"m:{answered}"


def test_activation_ends_the_canary_and_forgets_the_conversations() -> None:
    reg = _registry(share=0.5)
    reg.remember("m:x", 2)
    reg.activate(2)  # promoted
    assert reg.canary is None and len(reg.sticky) == 0
    assert {reg.route(reg.resolve("rlproxy"), "m:x").version for _ in range(50)} == {2}
    reg.start_canary(1, 0.5)
    reg.end_canary()  # rolled back
    assert reg.canary is None
    assert reg.resolve("rlproxy") == Resolved("rlproxy", 2, follows_policy=True)


def test_a_canary_must_be_loaded_and_not_active_and_cannot_be_removed() -> None:
    reg = ServedModels("rlproxy")
    reg.add_version(1)
    reg.activate(1)
    with pytest.raises(ValueError, match="not loaded"):
        reg.start_canary(5, 0.5)
    with pytest.raises(ValueError, match="already active"):
        reg.start_canary(1, 0.5)
    reg.add_version(2)
    with pytest.raises(ValueError, match="share"):
        reg.start_canary(2, 1.0)
    reg.start_canary(2, 0.5)
    with pytest.raises(ValueError, match="canary"):
        reg.remove_version(2)


def _version(root: Path, version: int, parent: int | None) -> None:
    folder = checkpoints.version_dir(root, version)
    folder.mkdir(parents=True)
    state = {"step": version} if parent is None else {"step": version, "parent": parent}
    (folder / checkpoints.TRAINER_STATE).write_text(json.dumps(state))


def test_lineage_finds_a_rolled_back_ancestor(tmp_path: Path) -> None:
    # 1 <- 2 <- 3 (no parent recorded: the version before) ; 2 was rolled back; 4 restarted
    # from 1; 5 from 4
    _version(tmp_path, 1, 0)
    _version(tmp_path, 2, 1)
    _version(tmp_path, 3, None)
    _version(tmp_path, 4, 1)
    _version(tmp_path, 5, 4)
    rolled = {2}
    assert checkpoints.rolled_back_ancestor(tmp_path, 2, rolled) == 2
    assert checkpoints.rolled_back_ancestor(tmp_path, 3, rolled) == 2
    assert checkpoints.rolled_back_ancestor(tmp_path, 4, rolled) is None
    assert checkpoints.rolled_back_ancestor(tmp_path, 5, rolled) is None
    assert checkpoints.rolled_back_ancestor(tmp_path, 1, rolled) is None
    # a version that served as active stops the walk: what lies below it was accepted
    assert checkpoints.rolled_back_ancestor(tmp_path, 3, rolled, trusted={3}) is None
    assert checkpoints.parent_version(tmp_path, 3) == 2
    assert checkpoints.parent_version(tmp_path, 9) == 8  # no folder: the version before


async def test_a_long_policy_name_still_draws_a_new_split_for_each_canary() -> None:
    """blake2b takes a key of at most 64 bytes: a long policy name is hashed down whole rather
    than cut (which dropped the version, so every canary got the same split)."""
    policy = "p" * 70
    keys = [f"t:traj-{i}" for i in range(64)]
    assert [canary_draw(k, policy, 1) for k in keys] != [canary_draw(k, policy, 2) for k in keys]
    # short names keep the split they had before (a conversation's version survives upgrades)
    assert canary_draw("conversation-1", "rlproxy", 7) == 0.246177779720674


def test_the_watch_sends_its_share_of_the_other_conversations_to_the_base() -> None:
    reg = _registry(share=0.25)
    reg.watch_share = 0.2
    draws = [reg.route(reg.resolve("rlproxy"), f"m:{i}").version for i in range(20_000)]
    # the canary's quarter first, then a fifth of the rest: 0.25, 0.15 and 0.6
    assert draws.count(2) / len(draws) == pytest.approx(0.25, abs=0.02)
    assert draws.count(None) / len(draws) == pytest.approx(0.75 * 0.2, abs=0.02)
    assert draws.count(1) / len(draws) == pytest.approx(0.75 * 0.8, abs=0.02)
    # a conversation keeps its draw, on every replica (a stable hash of its key)
    other = _registry(share=0.25, seed=99)
    other.watch_share = 0.2
    again = [other.route(other.resolve("rlproxy"), f"m:{i}").version for i in range(2_000)]
    assert again == draws[:2_000]
    # pins are never split, the watch's base included
    assert {reg.route(reg.resolve("rlproxy@1"), "m:x").version for _ in range(50)} == {1}


def test_the_watch_is_off_while_the_base_serves_and_with_share_zero() -> None:
    reg = ServedModels("rlproxy", rng=random.Random(3))
    reg.watch_share = 0.4
    resolved = reg.resolve("rlproxy")
    assert {reg.route(resolved, f"m:{i}").version for i in range(500)} == {None}
    reg.add_version(3)
    reg.activate(3)
    assert {reg.route(reg.resolve("rlproxy"), f"m:{i}").version for i in range(500)} == {None, 3}
    reg.watch_share = 0.0
    assert reg.route(reg.resolve("rlproxy"), "m:any") == reg.resolve("rlproxy")
