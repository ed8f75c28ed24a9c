"""Turning stored trajectories into better adapters: linking and grouping policy, RULER, GRPO.

Speaks no HTTP to agents; reads and writes the database only through `storage.Store`.
"""
