"""rlproxy's serving side: the OpenAI-compatible HTTP face and everything behind it.

    api/       the HTTP face: app factory, routes, typed dependencies, auth, error rendering
    protocols/ the wire formats: Chat Completions' types, Responses and Messages translated
    chat/      request validation, prompts, grammars, tool parsing, services, streaming, records
    engines/   token generation: the contract, the local engine, the upstream client
    adapters/  served names and versions: loading, unloading, swapping, publishing
    cli/       the `rlproxy` command
    runtime.py the one builder of store, engine, services and scorer for every command
    settings.py
    errors.py  the errors a client sees, raised anywhere below the routes

docs/ARCHITECTURE.md says what each may import.
"""
