"""Adapter versions on the serving side: names (`registry`), loading, unloading and swapping
(`manager`), and publishing what the trainer writes (`publisher`).

The swap: `publisher.Publisher.check` -> `manager.AdapterManager.activate` (load, validate,
flip the registry, unload what is no longer kept).
"""
