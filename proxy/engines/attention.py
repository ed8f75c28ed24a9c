"""The local engine's attention on CPU: transformers' SDPA attention, with grouped-query
attention read in place when a pass carries a mask.

transformers' SDPA path lets the kernel handle grouped-query attention (several query heads per
key/value head, `enable_gqa`) only when there is no mask; with a mask (a batch with left
padding, a prefill on top of a cached prefix) it first copies every layer's keys and values
once per query head (`repeat_kv`). On CPU, torch's kernel takes the mask and `enable_gqa`
together, so the copy is pure cost, and a large share of the attention time of a prefill on top
of a long cached prefix (docs/benchmarks/long-session.md). Decode steps (one query position) and
unmasked passes (the causal kernel) keep transformers' own path, the faster one there.

Nothing here changes what is computed: outputs equal transformers' `sdpa` to float tolerance.
Not used on CUDA, where a mask with `enable_gqa` sends SDPA to its slowest kernel.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "rlproxy_cpu_sdpa"


def cpu_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # (B, H, Q, D)
    key: torch.Tensor,  # (B, H_kv, K, D)
    value: torch.Tensor,  # (B, H_kv, K, D)
    attention_mask: torch.Tensor | None,  # (B, 1, Q, K) boolean, or None
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, except that a masked pass of several query positions lets
    the kernel read each key/value head for its query heads instead of copying it per head."""
    groups = getattr(module, "num_key_value_groups", 1)
    if attention_mask is None or query.shape[2] == 1 or groups == 1 or kwargs.get("cache"):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout, scaling, **kwargs
        )
    out = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        enable_gqa=True,
    )
    return out.transpose(1, 2).contiguous(), None  # (B, Q, H, D), as transformers returns it


def use_cpu_attention(model: Any) -> bool:
    """Switch `model` (a transformers model loaded with `sdpa` attention, on CPU) to
    `cpu_sdpa_attention` (a model switched already stays so); returns whether it is. Other
    attention implementations, devices and models without grouped-query attention are left
    as they are."""
    config = model.config
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if (
        model.device.type != "cpu"
        or getattr(config, "_attn_implementation", None) not in ("sdpa", NAME)
        or not heads
        or kv_heads == heads
    ):
        return False
    AttentionInterface.register(NAME, cpu_sdpa_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
    return bool(config._attn_implementation == NAME)
