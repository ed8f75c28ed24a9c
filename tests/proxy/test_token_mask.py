"""Token masks as the local engine applies them: bitmask words to -inf logits, row by row.
(The grammars that fill the bits: tests/proxy/test_grammar.py.)"""

from __future__ import annotations

import torch

from proxy.engines.token_mask import (
    allocate_bitmask,
    apply_bitmask,
    build_tokenizer_info,
)


def test_a_fresh_bitmask_allows_every_token_of_the_vocabulary(tokenizer) -> None:
    info = build_tokenizer_info(tokenizer)
    bitmask = allocate_bitmask(2, info)
    assert bitmask.shape == (2, (info.vocab_size + 31) // 32)
    assert bitmask.dtype == torch.int32
    logits = torch.zeros(2, info.vocab_size)
    apply_bitmask(logits, bitmask)
    assert torch.isfinite(logits).all()


def test_apply_bitmask_handles_vocab_size_mismatch() -> None:
    bitmask = torch.zeros(2, 2, dtype=torch.int32)  # 64 token slots, all banned...
    bitmask[0, 0] = 1 << 3  # ...except token 3 in row 0
    bitmask[1, 1] = -(1 << 31)  # ...and token 63 in row 1 (the sign bit)
    wide = torch.zeros(2, 70)  # logits wider than the bitmask: the extra tokens are banned
    apply_bitmask(wide, bitmask)
    assert torch.isfinite(wide[0]).nonzero().flatten().tolist() == [3]
    assert torch.isfinite(wide[1]).nonzero().flatten().tolist() == [63]
    narrow = torch.zeros(2, 40)  # logits narrower: bits past V are ignored
    apply_bitmask(narrow, bitmask)
    assert torch.isfinite(narrow[0]).nonzero().flatten().tolist() == [3]
    assert not torch.isfinite(narrow[1]).any()
    only_row_1 = torch.zeros(2, 64)
    apply_bitmask(only_row_1, bitmask, rows=[1])
    assert torch.isfinite(only_row_1[0]).all()
    assert torch.isfinite(only_row_1[1]).nonzero().flatten().tolist() == [63]


def test_no_rows_leaves_the_logits_alone() -> None:
    logits = torch.zeros(2, 64)
    apply_bitmask(logits, torch.zeros(2, 2, dtype=torch.int32), rows=[])
    assert torch.isfinite(logits).all()
