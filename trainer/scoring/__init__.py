"""Scoring: grouping, RULER (`ruler`), the judges it can ask (`litellm_judge`, `local_judge`),
background scorer that forms groups and scores them (`scoring`).

Runs in the serving process (and in `rlproxy score`), not in the trainer process. Imports no
part of `proxy`: the local judge is handed a function that completes chat requests.
"""
