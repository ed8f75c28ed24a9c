"""A stand-in judge of known quality: a test fixture for measuring rlproxy, NOT a judge.

It never reads what a trajectory means. It answers RULER's request (`POST /v1/chat/completions`
as OpenAI's Chat Completions, the prompt `trainer.scoring.ruler.build_judge_messages` writes) in
RULER's documented reply format, `{"scores": [{"trajectory_id", "explanation", "score"}]}`, with
scores made from each member's *true* reward plus stated noise, so that a benchmark can measure
how rlproxy does with a judge that orders pairs correctly a known share of the time.

Truth. Each member is read as its text in the prompt: the group's shared context (if any) and its
own `<trajectory id="k">` block. Its true reward is, in order:

1. posted: `POST /truth {"fragments": {"<text>": reward, ...}}` (the benchmark, which knows its
   episodes' rewards, names a fragment that only that episode's text holds, e.g. a tool call id
   or a nonce in its first message); the longest posted fragment found in the member's text wins;
   `DELETE /truth` forgets them;
2. built in, with `--truth lookup`: examples/lookup_agent.py's reward recomputed from the
   rendered episode (`lookup_reward`: the question's word, the `find` calls and their results,
   the first `get` call); with `--truth arithmetic`: examples/arithmetic_agent.py's reward
   recomputed from the question "What is A + B?" and the assistant's reply
   (`arithmetic_reward`);
3. otherwise `--unknown-reward` (default 0.0), e.g. for a judge check's canary.

Noise (`noisy_scores`). With pair accuracy p in [0.5, 1], each group independently is, with
probability 2p - 1, "informed": every member's score is its true reward (clipped to [0, 1]);
otherwise it is "blind": every member gets an independent uniform score in [0, 1]. For two
members whose true rewards differ, P(ordered correctly) = (2p - 1) + (2 - 2p) / 2 = p exactly,
whatever the gap between their rewards and whatever the group's size: p = 0.5 is a coin flip,
p = 1 the truth. Members with equal true rewards tie when informed; such pairs do not count in the
pair accuracy. Unlike a real judge, which confuses close pairs more than far ones, its errors are
by whole groups (a blind group is wholly blind); pair accuracy is the one figure it holds to
(tests/e2e/test_standin_judge.py measures it). Each score's explanation says which it was.

    python bench/standin_judge.py --port 9100 --pair-accuracy 0.9 --truth lookup --seed 1
    python bench/standin_judge.py --port 9100 --pair-accuracy 0.5 --truth arithmetic --seed 1
    STANDIN_KEY=x RLPROXY_JUDGE_MODEL=openai/standin RLPROXY_JUDGE_API_KEY_ENV=STANDIN_KEY \\
        RLPROXY_JUDGE_API_BASE=http://127.0.0.1:9100/v1 rlproxy serve

`GET /stats` counts requests, informed and blind groups, and members with no known reward. It
answers RULER's group requests only (not `RLPROXY_JUDGE_MODE=turns`): anything else is a 400.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

Truth = Callable[[str], float | None]
"""A member's text in the judge prompt -> its true reward, or None when unknown."""

_BLOCK = re.compile(r'<trajectory id="([^"]+)">\n(.*?)\n</trajectory>', re.DOTALL)
_SHARED = re.compile(r"<shared_context>\n(.*?)\n</shared_context>", re.DOTALL)


# ----------------------------------------------------------------------------- noise


def noisy_scores(
    rewards: list[float], pair_accuracy: float, rng: random.Random
) -> tuple[list[float], bool]:
    """The scores of one group and whether it was informed (see the module's docstring)."""
    if not 0.5 <= pair_accuracy <= 1:
        raise ValueError(f"pair_accuracy must lie in [0.5, 1], not {pair_accuracy}")
    if rng.random() < 2 * pair_accuracy - 1:
        return [min(1.0, max(0.0, r)) for r in rewards], True
    return [rng.random() for _ in rewards], False


def pair_accuracy_of(rewards: list[float], scores: list[float]) -> tuple[int, int]:
    """(pairs ordered as their true rewards are, pairs whose true rewards differ) in one group;
    a tie in score counts as wrong."""
    right = total = 0
    for i in range(len(rewards)):
        for j in range(i + 1, len(rewards)):
            if rewards[i] == rewards[j]:
                continue
            total += 1
            right += (rewards[i] - rewards[j]) * (scores[i] - scores[j]) > 0
    return right, total


# ----------------------------------------------------------------------------- truth


@dataclass
class PostedTruth:
    """Fragments of member text posted by a benchmark, each with the member's true reward."""

    fragments: dict[str, float] = field(default_factory=dict)

    def __call__(self, text: str) -> float | None:
        found = [f for f in self.fragments if f in text]
        return self.fragments[max(found, key=len)] if found else None


_QUESTION = re.compile(r"number of the code of (\w+)\?")
_CALL = re.compile(r"^tool call(?: \[([^\]\n]+)\])?: (\w+)\((.*)\)$", re.MULTILINE)
_RESULT = re.compile(
    r"^\[tool result(?: of \w+)?(?: \[([^\]\n]+)\])?\]\n(.*?)(?=\n\n\[|\Z)",
    re.MULTILINE | re.DOTALL,
)


def lookup_reward(text: str, number_of: Callable[[str], int]) -> float | None:
    """examples/lookup_agent.py's reward recomputed from a rendered episode: 0 unless `find` was
    called with the question's word; then 1 when the first `get` was called with a code whose
    number is the number of the code `find` returned for that word, else 0.1. None when the text
    holds no lookup question. (`find(word)`'s result is the task's code; `get`'s result, the
    episode's final output, is `number_of` its argument.)"""
    question = _QUESTION.search(text)
    if question is None:
        return None
    word = question.group(1)
    calls = []  # (call id, name, arguments) in order
    for call_id, name, arguments in _CALL.findall(text):
        try:
            args = json.loads(arguments or "{}")
        except ValueError:
            args = {}
        calls.append((call_id, name, args if isinstance(args, dict) else {}))
    results = {call_id: body.strip() for call_id, body in _RESULT.findall(text) if call_id}
    finds = [c for c in calls if c[1] == "find" and c[2].get("word") == word]
    if not finds:
        return 0.0
    code = next((results[c[0]] for c in finds if c[0] in results), None)
    gets = [c for c in calls if c[1] == "get"]
    if code is None or not gets:
        return 0.1
    asked = str(gets[0][2].get("code", ""))
    return 1.0 if number_of(asked) == number_of(code) else 0.1


def lookup_truth() -> Truth:
    """`lookup_reward` with the lookup agent's own `number_of` (imports examples/lookup_agent.py,
    which needs the openai-agents package)."""
    examples = str(Path(__file__).resolve().parent.parent / "examples")
    if examples not in sys.path:
        sys.path.insert(0, examples)
    import lookup_agent

    return lambda text: lookup_reward(text, lookup_agent.number_of)


_SUM = re.compile(r"What is (-?\d+) \+ (-?\d+)\?")
_ASSISTANT = "[assistant]\n"
_EMPTY = "(empty)"  # what RULER's rendering writes for a message with no text and no tool call


def arithmetic_reward(text: str, reward: Callable[[str, int], float]) -> float | None:
    """examples/arithmetic_agent.py's reward recomputed from a rendered episode: `reward` of the
    assistant's reply (the text after the first assistant message's header that follows the
    question) and the question's sum. None when the text holds no "What is A + B?" question or
    no reply. A reply of exactly "(empty)" reads as an empty one: that is how RULER renders an
    empty answer (a canary's, say)."""
    question = _SUM.search(text)
    if question is None:
        return None
    start = text.find(_ASSISTANT, question.end())
    if start < 0:
        return None
    reply = text[start + len(_ASSISTANT) :]
    reply = "" if reply.strip() == _EMPTY else reply
    return reward(reply, int(question.group(1)) + int(question.group(2)))


def arithmetic_truth() -> Truth:
    """`arithmetic_reward` with examples/arithmetic_agent.py's own `reward`."""
    examples = str(Path(__file__).resolve().parent.parent / "examples")
    if examples not in sys.path:
        sys.path.insert(0, examples)
    import arithmetic_agent

    return lambda text: arithmetic_reward(text, arithmetic_agent.reward)


TRUTHS: dict[str, Callable[[], Truth] | None] = {
    "posted": None,
    "lookup": lookup_truth,
    "arithmetic": arithmetic_truth,
}
"""`--truth`: the built-in truth beside the posted fragments (None: posted fragments only)."""


# ----------------------------------------------------------------------------- the judge


@dataclass
class StandinJudge:
    pair_accuracy: float
    truth: Truth | None = None
    unknown_reward: float = 0.0
    seed: int | None = None
    posted: PostedTruth = field(default_factory=PostedTruth)
    stats: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(("requests", "informed", "blind", "unknown"), 0)
    )

    def __post_init__(self) -> None:
        if not 0.5 <= self.pair_accuracy <= 1:
            raise ValueError(f"pair_accuracy must lie in [0.5, 1], not {self.pair_accuracy}")
        self._rng = random.Random(self.seed)
        self._lock = threading.Lock()

    def true_reward(self, text: str) -> float | None:
        found = self.posted(text)
        if found is None and self.truth is not None:
            found = self.truth(text)
        return found

    def reply(self, messages: list[dict[str, Any]]) -> str:
        """RULER's reply to RULER's request; ValueError when it is not one."""
        prompt = next(
            (
                m["content"]
                for m in messages
                if m.get("role") == "user"
                and isinstance(m.get("content"), str)
                and '<trajectory id="' in m["content"]
            ),
            None,
        )
        if prompt is None:
            raise ValueError("not a RULER group request: no <trajectory> blocks in a user message")
        shared = _SHARED.search(prompt)
        head = shared.group(1) + "\n\n" if shared else ""
        members = _BLOCK.findall(prompt)
        with self._lock:
            self.stats["requests"] += 1
            known = [self.true_reward(head + body) for _, body in members]
            self.stats["unknown"] += sum(r is None for r in known)
            rewards = [self.unknown_reward if r is None else r for r in known]
            scores, informed = noisy_scores(rewards, self.pair_accuracy, self._rng)
            self.stats["informed" if informed else "blind"] += 1
        how = "from its true reward" if informed else "at random (a blind group)"
        entries = [
            {
                "trajectory_id": short,
                "explanation": (
                    f"stand-in judge, pair accuracy {self.pair_accuracy}: scored {how}; true "
                    + ("reward unknown" if r is None else f"reward {r:g}")
                ),
                "score": round(score, 6),
            }
            for (short, _), r, score in zip(members, known, scores, strict=True)
        ]
        return json.dumps({"scores": entries})


# ----------------------------------------------------------------------------- HTTP


def _error(status: int, message: str) -> JSONResponse:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    error = {"message": message, "type": kind, "param": None, "code": None}
    return JSONResponse({"error": error}, status_code=status)


def build_app(judge: StandinJudge) -> FastAPI:
    app = FastAPI(title="stand-in judge (a test fixture, not a judge)")

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: Request) -> dict[str, Any] | JSONResponse:
        body = await request.json()
        messages = body.get("messages") or []
        try:
            content = judge.reply(messages)
        except ValueError as exc:
            return _error(400, str(exc))
        prompt_chars = sum(len(str(m.get("content") or "")) for m in messages)
        prompt_tokens, completion_tokens = prompt_chars // 4 + 1, len(content) // 4 + 1
        return {
            "id": f"chatcmpl-standin-{judge.stats['requests']}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", "standin"),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "logprobs": None,
                    "finish_reason": "stop",
                }
            ],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }

    @app.post("/truth", response_model=None)
    async def post_truth(request: Request) -> dict[str, int] | JSONResponse:
        body = await request.json()
        fragments = body.get("fragments") if isinstance(body, dict) else None
        if not isinstance(fragments, dict) or not all(
            isinstance(k, str) and k and isinstance(v, int | float) and not isinstance(v, bool)
            for k, v in fragments.items()
        ):
            return _error(400, 'expected {"fragments": {"<non-empty text>": <reward>, ...}}')
        with judge._lock:
            judge.posted.fragments.update({k: float(v) for k, v in fragments.items()})
            return {"fragments": len(judge.posted.fragments)}

    @app.delete("/truth")
    async def delete_truth() -> dict[str, int]:
        with judge._lock:
            judge.posted.fragments.clear()
        return {"fragments": 0}

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        with judge._lock:
            return {"pair_accuracy": judge.pair_accuracy, **judge.stats}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return app


class StandinJudgeServer:
    """The stand-in on loopback in a daemon thread: `with StandinJudgeServer(judge) as url:`
    gives its base URL (`http://127.0.0.1:PORT/v1`)."""

    def __init__(self, judge: StandinJudge, port: int = 0) -> None:
        import socket

        if not port:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = int(s.getsockname()[1])
        self.port = port
        config = uvicorn.Config(build_app(judge), host="127.0.0.1", port=port, log_level="warning")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self) -> str:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the stand-in judge did not start")
            time.sleep(0.05)
        return f"http://127.0.0.1:{self.port}/v1"

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9100)
    parser.add_argument(
        "--pair-accuracy",
        type=float,
        default=0.9,
        help="P(a pair of members with different true rewards is ordered correctly), 0.5..1",
    )
    parser.add_argument(
        "--truth",
        choices=tuple(TRUTHS),
        default="posted",
        help="posted: only fragments POSTed to /truth; lookup, arithmetic: also recompute "
        "examples/lookup_agent.py's or examples/arithmetic_agent.py's reward from the rendered "
        "episode",
    )
    parser.add_argument("--unknown-reward", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    if not math.isfinite(args.unknown_reward):
        parser.error("--unknown-reward must be a number")
    make_truth = TRUTHS[args.truth]
    judge = StandinJudge(
        args.pair_accuracy,
        truth=make_truth() if make_truth is not None else None,
        unknown_reward=args.unknown_reward,
        seed=args.seed,
    )
    uvicorn.run(build_app(judge), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
