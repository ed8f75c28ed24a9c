// The Vercel AI SDK as its docs write it: an OpenAI provider pointed at a base URL
// (`openai(...)` speaks the Responses API by default), then generateText, streamText or a
// tool call. It knows nothing of rlproxy. Usage: node ai_sdk.mjs BASE_URL generate|stream|tool
// Prints one JSON line: what the SDK returned, and the response ids it received.
import { createOpenAI } from '@ai-sdk/openai';
import { generateText, streamText, tool } from 'ai';
import { z } from 'zod';

const [baseURL, mode] = process.argv.slice(2);
const openai = createOpenAI({ baseURL, apiKey: 'sk-test' });
const model = openai('rlproxy');
const settings = { model, temperature: 0, maxRetries: 0 };

let out;
if (mode === 'generate') {
  const result = await generateText({
    ...settings,
    prompt: 'Write a long story about a dragon.',
    maxOutputTokens: 12,
  });
  out = {
    text: result.text,
    finishReason: result.finishReason,
    usage: result.usage,
    responseId: result.response.id,
  };
} else if (mode === 'stream') {
  const result = streamText({
    ...settings,
    prompt: 'Write a long story about a dragon.',
    maxOutputTokens: 12,
  });
  const deltas = [];
  for await (const delta of result.textStream) {
    deltas.push(delta);
  }
  out = {
    deltas,
    text: await result.text,
    finishReason: await result.finishReason,
    usage: await result.usage,
    responseId: (await result.response).id,
  };
} else if (mode === 'tool') {
  const result = await generateText({
    ...settings,
    prompt: 'What is the weather in Paris?',
    maxOutputTokens: 48,
    tools: {
      weather: tool({
        description: 'Get the current weather in a city',
        inputSchema: z.object({ city: z.string().describe('The city') }),
        execute: async ({ city }) => ({ city, temperature: 21 }),
      }),
    },
    toolChoice: 'required',
    // One call: the 135M model repeats a call until the budget ends when it may make several.
    providerOptions: { openai: { parallelToolCalls: false } },
  });
  out = {
    toolCalls: result.toolCalls.map((c) => ({ toolName: c.toolName, input: c.input })),
    toolResults: result.toolResults.map((r) => ({ toolName: r.toolName, output: r.output })),
    finishReason: result.finishReason,
    responseId: result.response.id,
  };
} else {
  throw new Error(`unknown mode ${mode}`);
}
console.log(JSON.stringify(out));
