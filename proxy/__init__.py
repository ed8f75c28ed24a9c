"""rlproxy's serving side: the OpenAI-compatible HTTP face and everything behind it.

    api/       app factory, routes, typed dependencies, wire types, errors
    chat/      request validation, prompts, grammars, tool parsing, services, streaming, records
    engines/   token generation: the contract, the local engine, the upstream client
    adapters/  served names and versions: loading, unloading, swapping, publishing
    cli/       the `rlproxy` command
    runtime.py the one builder of store, engine, services and scorer for every command
    settings.py

docs/ARCHITECTURE.md says what each may import.
"""
