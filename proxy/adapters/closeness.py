"""How far a canary's answers can be from the active version's on the team's own traffic: a bound
on how much worse it can be, found in seconds, with no reward needed.

A version trained a few steps past the active one usually answers almost as it does. Waiting for
dozens of rewarded groups to show that is what makes a guard slow. Instead, on the newest
trajectories the active version served whole, each call's answer is teacher-forced through both
versions (`proxy.engines.base.TeacherForcing`), and

    KL_call = sum over the answer's positions of KL(active || canary)   (nats, whole distributions)

is the call's sequence KL along the active version's own sampled answer (an unbiased estimate of
KL between the two versions' answer distributions for that prompt). The distributions compared
are the ones the call sampled from: both versions' next-token distributions at the call's
temperature. A greedy call (temperature 0) is deterministic: the smallest change can flip its
answer, so no bound holds and its episode is left out; with too few sampled episodes left, the
canary waits for rewards. (Top-p/top-k cuts and a grammar's mask are not modelled: they change
both versions' distributions alike, and the bound is taken over the full ones.)

By Pinsker's inequality the two versions' answer distributions differ in total variation by at
most sqrt(KL_call / 2), and an episode of several calls by at most the sum over its calls (capped
at 1). For any reward in
[0, 1] that depends on the episode, the two versions' expected rewards on that task differ by at
most that total variation. So

    bound = mean over the sampled episodes of min(1, sum over calls of sqrt(KL_call / 2))

plus two standard errors of that mean (the episodes are a sample of the traffic), bounds how much
worse the canary can be, in reward units, on traffic like the sample: no reward, no judge.

`Rollout` promotes a canary at once when its bound, added to the bounds of the versions promoted
this way since the last version a reward test decided (total variation obeys the triangle
inequality, so drift cannot pile up unseen), stays within the budget (half the harm margin).
Otherwise the canary waits for the reward test as before.

Only an engine that can teacher-force runs it (the local engine); on vLLM every canary waits for
rewards. Bounded: at most `episodes` trajectories of at most `calls_per_episode` calls each,
answers cut at `answer_tokens` (a cut answer's KL is a lower bound: such an episode is left out).
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from proxy.adapters.forgetting import token_kl
from proxy.adapters.registry import adapter_name
from proxy.engines.base import Engine, TeacherForcing
from storage.store import Store


@dataclass(frozen=True)
class ClosenessConfig:
    episodes: int = 8
    """Trajectories sampled (the newest the active version served whole)."""
    min_episodes: int = 4
    """Fewer usable episodes than this: no bound (the canary waits for rewards)."""
    calls_per_episode: int = 8
    """Longer episodes are left out (their cost)."""
    answer_tokens: int = 256
    """Longer answers are left out (a cut answer's KL would be a lower bound)."""


@dataclass(frozen=True)
class Closeness:
    """The bound for one canary against the active version."""

    bound: float | None
    """Mean episode total-variation bound plus two standard errors; None: not measured."""
    mean: float | None
    episodes: int
    calls: int
    mean_kl_per_call: float | None
    left_out: int
    """Episodes sampled but not usable (too long, no stored tokens)."""
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def episode_bound(kls: list[float]) -> float:
    """min(1, sum over an episode's calls of sqrt(KL / 2)): Pinsker, then the union over calls."""
    return min(1.0, sum(math.sqrt(max(k, 0.0) / 2.0) for k in kls))


def sequence_kl(both: torch.Tensor, temperature: float) -> float:
    """Sum over positions of KL(first || second) between the two rows of `both` (2, T, V)
    log-probabilities, each first tempered: log_softmax(logp / temperature)."""
    tempered = torch.log_softmax(both / temperature, dim=-1) if temperature != 1.0 else both
    return float(token_kl(tempered[0], tempered[1]).sum())


def summarise(episodes: list[list[float]], left_out: int, min_episodes: int) -> Closeness:
    """The bound from each usable episode's per-call KLs."""
    calls = sum(len(e) for e in episodes)
    if len(episodes) < min_episodes:
        return Closeness(
            None,
            None,
            len(episodes),
            calls,
            None,
            left_out,
            f"{len(episodes)} of {min_episodes} episodes the active version served whole",
        )
    bounds = [episode_bound(e) for e in episodes]
    n = len(bounds)
    mean = sum(bounds) / n
    sd = math.sqrt(sum((b - mean) ** 2 for b in bounds) / (n - 1))
    bound = min(1.0, mean + 2.0 * sd / math.sqrt(n))
    mean_kl = sum(k for e in episodes for k in e) / max(calls, 1)
    return Closeness(
        bound,
        mean,
        n,
        calls,
        mean_kl,
        left_out,
        f"answers differ by at most {bound:.3f} in total variation over {n} episodes "
        f"({calls} calls, mean KL {mean_kl:.4f} nats per answer)",
    )


class ClosenessCheck:
    def __init__(self, engine: Engine, store: Store, config: ClosenessConfig | None = None):
        self.engine = engine
        self.store = store
        self.config = config or ClosenessConfig()

    @property
    def supported(self) -> bool:
        return isinstance(self.engine, TeacherForcing)

    async def measure(self, active: int | None, canary: int, since: float) -> Closeness:
        """`canary` (loaded) against `active` (None: the base model; loaded) on the newest
        trajectories `active` served whole since `since`."""
        forcing = self.engine
        if not isinstance(forcing, TeacherForcing):
            return Closeness(None, None, 0, 0, None, 0, "the engine cannot teacher-force")
        cfg = self.config
        ids = await self.store.recent_trajectories(
            version=active or 0, since=since, limit=cfg.episodes
        )
        adapters = [None if not active else adapter_name(active), adapter_name(canary)]
        episodes: list[list[float]] = []
        left_out = 0
        for trajectory_id in ids:
            calls = [
                c
                for c in await self.store.get_trajectory_calls(trajectory_id)
                if c.superseded_by is None
            ]
            usable = 0 < len(calls) <= cfg.calls_per_episode
            kls: list[float] = []
            for call in calls if usable else []:
                prompt = call.record.prompt_token_ids
                choices = call.record.choices
                answer = choices[0].completion_token_ids if choices else None
                if not prompt or not answer or len(answer) > cfg.answer_tokens:
                    usable = False
                    break
                temperature = call.record.params.get("temperature")
                temperature = 1.0 if temperature is None else float(temperature)
                if temperature <= 0.0:
                    usable = False
                    break
                both = await forcing.forced_logprobs(list(prompt), list(answer), adapters)
                kls.append(await asyncio.to_thread(sequence_kl, both, temperature))
            if usable:
                episodes.append(kls)
            else:
                left_out += 1
        return summarise(episodes, left_out, cfg.min_episodes)
