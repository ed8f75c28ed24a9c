"""The HTTP face: the app factory, routes, typed dependencies, auth, limits, error rendering.

Only HTTP lives here. The wire types are `proxy.protocols`, the errors `proxy.errors`; nothing
below this package imports it (an import-linter contract). The app, the routes and the
dependencies are only imported by `rlproxy serve`.
"""
