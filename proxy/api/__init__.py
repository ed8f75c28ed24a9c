"""The HTTP face: the app factory, routes, typed dependencies, OpenAI wire types and errors.

`protocol` and `errors` are also used below the routes (chat validation raises `errors`); the
app, the routes and the dependencies are only imported by `rlproxy serve`.
"""
