"""Adapter versions on the serving side: names (`registry`), loading, unloading and swapping
(`manager`), publishing what the trainer writes (`publisher`), holding back a version that
forgot general answers (`forgetting`, recorded as `held`), and the canary (`rollout`).

The swap: `publisher.Publisher.check` -> `manager.AdapterManager.activate` (load, validate,
flip the registry, unload what is no longer kept).
"""
