"""Turning stored trajectories into better adapters: GRPO (`grpo`, `loop`, `peft_backend`,
`config`), the checkpoint layout (`checkpoints`), and the rewards it trains on (`rewards`: RULER,
the judges, the scorer).

Speaks no HTTP to agents and imports nothing of `proxy`; reads and writes the database only
through `storage.Store`.
"""
