"""Tiny chat models of other families, built from configs (random weights, nothing downloaded).

Each is a few-layer model with a small hidden size, the embedded SmolLM2 tokenizer and another
family's chat template, saved to a folder that RLPROXY_BASE_MODEL can name:

- `qwen2`: a Qwen2ForCausalLM with a Qwen2.5-style ChatML template that renders tools itself
  (the Hermes `<tool_call>` block in the system prompt, tool results as `<tool_response>` in a
  user turn) and its own default system prompt;
- `llama3`: a LlamaForCausalLM with Llama 3.1-style special tokens added to the tokenizer
  (`<|begin_of_text|>`, `<|start_header_id|>`, `<|end_header_id|>`, `<|eot_id|>`, `<|eom_id|>`,
  `<|python_tag|>`), EOS `<|eot_id|>`, and a Llama 3.1-style template: tools in the first user
  message, calls as `{"name": ..., "parameters": ...}`, results in an `ipython` turn, one call per
  assistant turn (more raise, as Meta's template does).

The templates are written here, in those families' layout; they are not copies of the vendors'
files. Random weights produce garbage text: tests constrain output (tool_choice, json_schema)
where content matters.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

QWEN25_STYLE_TEMPLATE = """\
{%- set default_system = 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' %}
{%- set system = messages[0].content if messages[0].role == 'system' else default_system %}
{{- '<|im_start|>system\\n' + system }}
{%- if tools %}
{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and ' }}
{{- 'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n' }}
{{- '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>' }}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for call in message.tool_calls or [] %}
{%- set fn = call.function if call.function is defined else call %}
{{- '\\n<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' + (fn.arguments | tojson) }}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
{{- '<|im_start|>user' }}
{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

LLAMA31_STYLE_TEMPLATE = """\
{{- bos_token }}
{%- if messages[0].role == 'system' %}
{%- set system = messages[0].content %}{%- set messages = messages[1:] %}
{%- else %}{%- set system = '' %}{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{%- if tools %}{{- 'Environment: ipython\\n' }}{%- endif %}
{{- 'Knowledge cutoff: 2023-12\\n\\n' + system + '<|eot_id|>' }}
{%- if tools %}
{%- if not messages or messages[0].role != 'user' %}
{{- raise_exception('with tools, a user message must come first') }}
{%- endif %}
{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' }}
{{- 'To call a function, answer with JSON only: {"name": function name, "parameters": ' }}
{{- 'object of argument names and values}. Functions:\\n\\n' }}
{%- for tool in tools %}{{- (tool | tojson(indent=4)) + '\\n\\n' }}{%- endfor %}
{{- messages[0].content + '<|eot_id|>' }}
{%- set messages = messages[1:] %}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}
{%- if message.tool_calls | length != 1 %}
{{- raise_exception('This model only supports single tool-calls at once!') }}
{%- endif %}
{%- set fn = message.tool_calls[0].function %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n<|python_tag|>' }}
{{- '{"name": "' + fn.name + '", "parameters": ' + (fn.arguments | tojson) + '}<|eom_id|>' }}
{%- elif message.role in ['tool', 'ipython'] %}
{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content }}
{{- '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

LLAMA3_SPECIAL = [
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
]


def tiny_tokenizer(embedded_dir: Path, family: Literal["qwen2", "llama3"]):  # -> tokenizer
    """The embedded tokenizer with `family`'s chat template (and special tokens)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(embedded_dir))
    if family == "llama3":
        tokenizer.add_special_tokens({"additional_special_tokens": LLAMA3_SPECIAL})
        tokenizer.bos_token = "<|begin_of_text|>"
        tokenizer.eos_token = "<|eot_id|>"
        tokenizer.chat_template = LLAMA31_STYLE_TEMPLATE
    else:
        tokenizer.chat_template = QWEN25_STYLE_TEMPLATE
    return tokenizer


def build_tiny_model(
    folder: Path,
    embedded_dir: Path,
    family: Literal["qwen2", "llama3"],
    seed: int = 0,
    context: int = 4096,
    words: str | None = None,
) -> Path:
    """Save a tiny random `family` model with the embedded tokenizer into `folder`; its context
    (`max_position_embeddings`, what rlproxy serves as the model's context) is `context`. With
    `words`, its answers are a few of those words and end (`answer_in_words`)."""
    import torch
    from transformers import (
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    tokenizer = tiny_tokenizer(embedded_dir, family)
    shape = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": context,
        "tie_word_embeddings": words is None,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    torch.manual_seed(seed)
    if family == "llama3":
        model = LlamaForCausalLM(LlamaConfig(**shape))
        eos = [tokenizer.convert_tokens_to_ids(t) for t in ("<|eot_id|>", "<|eom_id|>")]
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**shape))
        eos = [tokenizer.eos_token_id]
    if words is not None:
        answer_in_words(model, tokenizer, words, end=eos[0])
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id
    )
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def answer_in_words(
    model, tokenizer, words: str, end: int, mean_tokens: int = 10, first: str = "\n"
) -> None:
    """Make a freshly built random model (untied output head) answer with the tokens of `words`
    in random order, `mean_tokens` of them on average, then `end`; never `end` first.

    A random model samples all ~49k tokens nearly uniformly, so an answer runs until the budget
    (tens of thousands of tokens in a long context, which Codex reads as an error). Here one
    hidden channel `B` of every token embedding is large, so the residual stream after the final
    norm is about `sqrt(hidden) * e_B` whatever the prompt, and the output head reads only `B`: a
    fixed bias, 0 for the words, -24 for every other token, and for `end` the log-odds that give
    probability 1 / `mean_tokens` at each step. The token `first` (the last one of the ChatML
    generation prompt, `<|im_start|>assistant\\n`) also lights a channel `F` that forbids `end`,
    so an answer is never empty. The layers stay random; nothing here is a language model.
    """
    import math

    import torch

    b, f, big = 0, 1, 10.0  # channels, and their size against the embeddings' ~0.02
    allowed = sorted(set(tokenizer.encode(words, add_special_tokens=False)))
    (first_id,) = tokenizer.encode(first, add_special_tokens=False)
    assert first_id not in allowed and end not in allowed
    scale = math.sqrt(model.config.hidden_size)  # |normalised channel B| on a word's position
    odds = len(allowed) / (mean_tokens - 1)  # P(end) = 1 / mean_tokens among the words
    with torch.no_grad():
        embed = model.get_input_embeddings().weight
        embed[:, [b, f]] = 0.0
        embed[:, b] = big
        embed[first_id, f] = big
        head = model.get_output_embeddings().weight
        head.zero_()
        head[:, b] = -24.0 / scale
        head[allowed, b] = 0.0
        head[end, b] = math.log(odds) / scale
        head[end, f] = -40.0 / scale
