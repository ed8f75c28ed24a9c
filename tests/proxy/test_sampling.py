"""Per-row sampling (`proxy.engines.sampling`) at the edges of its parameters, without a model."""

from __future__ import annotations

import pytest
import torch

from proxy.engines.base import SamplingParams
from proxy.engines.sampling import RowSampler


@pytest.mark.parametrize("top_p", [5e-324, 1e-45, 1e-300])
def test_a_vanishing_top_p_keeps_the_most_likely_token(top_p: float) -> None:
    """5e-324 is 0 in float32: it cut every token and multinomial failed (a 500, found by
    schemathesis). The nucleus always holds at least the most likely token."""
    logits = torch.tensor([0.5, 3.0, -1.0, 2.0])
    sampler = RowSampler(
        SamplingParams(max_tokens=1, top_p=top_p), seed=0, device=torch.device("cpu")
    )
    assert {sampler.sample(logits, []) for _ in range(20)} == {1}


def test_top_p_keeps_the_smallest_prefix_that_reaches_it() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    sampler = RowSampler(
        SamplingParams(max_tokens=1, top_p=0.7), seed=0, device=torch.device("cpu")
    )
    assert {sampler.sample(logits, []) for _ in range(200)} == {0, 1}
