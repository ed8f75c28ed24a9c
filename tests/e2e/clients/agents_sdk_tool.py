"""An OpenAI Agents SDK program as its docs write one: an agent with a function tool, run once.

It knows nothing of rlproxy: the SDK's default model class (the Responses API) reaches the
server through OPENAI_BASE_URL and OPENAI_API_KEY alone. It prints one JSON line for the test:
the final output, the tool's calls, and the response ids the SDK received.
"""

import json

from agents import Agent, ModelSettings, Runner, function_tool, set_tracing_disabled
from agents.items import ToolCallItem

set_tracing_disabled(True)  # the SDK would send its traces to OpenAI's platform

weather_asked: list[str] = []


@function_tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    weather_asked.append(city)
    return f"It is sunny and 21 C in {city}."


agent = Agent(
    name="weather",
    instructions="You answer questions about the weather. Use the get_weather tool.",
    model="gpt-4o-mini",
    tools=[get_weather],
    # The SDK resets tool_choice to "auto" after the tool runs, so the second turn may answer.
    model_settings=ModelSettings(
        tool_choice="required", parallel_tool_calls=False, max_tokens=48, temperature=0.0
    ),
)

result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4)
print(
    json.dumps(
        {
            "final_output": result.final_output,
            "weather_asked": weather_asked,
            "tool_calls": [
                item.raw_item.name
                for item in result.new_items
                if isinstance(item, ToolCallItem) and hasattr(item.raw_item, "name")
            ],
            "response_ids": [r.response_id for r in result.raw_responses],
        }
    )
)
