"""The wire protocols, one room each: their types, and the translation in and out of the core.

    chat.py         OpenAI's Chat Completions (`/v1/chat/completions`): the request model and
                    the body and chunk builders, which are the core's own shapes
    responses.py    OpenAI's Responses API (`/v1/responses`): request items -> the core's chat
                    request; the core's body or chunks -> a `response` object or typed events
    messages.py     Anthropic's Messages API (`/v1/messages`): the same, in Anthropic's shapes

The core is Chat Completions' shape (`chat.ChatCompletionRequest` in, a chat body or chunk
stream out), which every engine serves; a call is stored in that one shape with the
protocol it came in by (`CallRecord.protocol`), so linking, grouping, RULER and GRPO treat the
three alike. No HTTP here: the routes in `proxy.api.routes` frame what these functions build.
"""
