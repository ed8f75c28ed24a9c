"""How the local engine plans a prefill: which rows share a forward pass, and whether a cached
prefix is worth using. Pure functions over token counts and the model's size; no tensors run.

Two facts about torch's CPU attention drive them: an unmasked pass takes the causal kernel,
which computes only the lower half of the (query, key) square, and transformers drops the mask
exactly when a pass has no padding and no cached prefix; a masked pass computes the whole
rectangle, so a long prompt padded beside another costs more per token than alone (the figures:
docs/benchmarks/long-session.md).
"""

from __future__ import annotations

from typing import Any

LONG_PROMPT = 512
"""Tokens to run from which a row with nothing cached is prefilled alone: its attention then
needs no mask and sdpa's causal kernel skips the masked half (a mask costs more than another
pass's overhead from here on)."""


def prefill_groups(to_run: list[int], cached: list[bool]) -> list[list[int]]:
    """Indices of `to_run` (tokens each row still has to run; `cached`: whether it has a cached
    prefix) grouped for one forward pass each: longest first, a row joining the current group
    while the group's longest is at most twice its own plus 64 (padding or recomputing more
    than that costs more than another pass). A row of `LONG_PROMPT` tokens or more with nothing
    cached runs alone."""

    def alone(i: int) -> bool:
        return not cached[i] and to_run[i] >= LONG_PROMPT

    groups: list[list[int]] = []
    for i in sorted(range(len(to_run)), key=lambda i: -to_run[i]):
        head = groups[-1][0] if groups else None
        if (
            head is not None
            and not alone(head)
            and not alone(i)
            and to_run[head] <= 2 * to_run[i] + 64
        ):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def prefill_costs(model: Any) -> tuple[float, float]:
    """The model's forward cost per token outside attention (2 x its parameters, embeddings
    excluded) and per attended (query, key) pair (4 x hidden size x layers), for
    `worth_reusing`."""
    config = model.config
    embedding = model.get_input_embeddings().weight.numel()
    params = sum(p.numel() for p in model.parameters()) - embedding
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    return 2.0 * params, 4.0 * hidden * layers


def worth_reusing(hit: int, prompt: int, token_flops: float, pair_flops: float) -> bool:
    """Whether prefilling a `prompt`-token prompt on top of its first `hit` tokens' cached KV
    costs less than prefilling it whole.

    Reusing skips the hit tokens' layers (`token_flops` each) but needs an attention mask, and
    with a mask the kernel computes every (query, key) pair of the new tokens against all keys
    (`pair_flops` each), where a whole prompt alone takes the causal kernel, which computes only
    the lower half. A short hit on a long prompt (8 agents whose system prompts share their
    first 15 tokens) is cheaper ignored; an agent's next turn (most of the prompt cached) never
    is."""
    new = prompt - hit
    return hit * token_flops >= pair_flops * (new * prompt - prompt * prompt / 2)
