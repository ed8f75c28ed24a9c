"""A tiny model that uses tools: it answers a coding agent's task with a fixed tool call, the next
turn with a second one once the first tool's result is in its context, and a final answer once
the second's is. Built here from a config with weights set by hand (nothing downloaded, nothing
trained); it is a Qwen2 model with a ChatML template that writes Hermes `<tool_call>` blocks
(tests/tiny_models.py), served by rlproxy like any model folder RLPROXY_BASE_MODEL names.

    folder = build_scripted_model(folder, embedded_dir, scripts, markers)

`scripts` are three answers, one per phase; `markers` two words, one in each tool's output. The
phase is what the context holds: neither marker (phase 0: the task alone), the first (phase 1:
the first tool has run) or the second (phase 2). The tests put the first word in a file the
first call reads and the second in the output of the shell command the second call runs, so a
model that answers phase 1 or 2 proves that a tool really ran and its result came back.

How one layer does it (the residual stream has named channels, everything else is zero):

- Every token's embedding lights a constant channel; a marker word's tokens (the word alone and
  after a space) light their marker's channel; each token a script uses lights its own channel.
- Attention head 0 finds the phase: its query is a constant (a bias), a key is large only for a
  marker's tokens, and only in the head's last rotary pair, whose frequency (2^-31 a token) is so
  low that the score does not depend on where the marker is. Softmax puts all the weight on the
  markers when there are any, the second marker's key beating the first's by e^10, and the
  values write the winning marker's phase channel. With no marker the weight spreads over tokens
  whose values are zero.
- The other heads look back: for each distance b in LOOK_BACK, query and key are constants whose
  rotary pairs (frequencies 1, 1/2, ... 2^-19 a token; rope_theta 2^32) are set so the score
  peaks b tokens back, by at least 29 over every other distance up to the context (checked when
  the model is built); the values copy that token's channel into a "b back" channel.
- The MLP holds one neuron per step of each script: "the phase is p and the last four tokens
  are these", a SwiGLU gate that is positive only when all of it holds (thresholds against the
  constant channel, so they do not move with RMSNorm's scale); it writes a large value into the
  channel of the script's next token.
- The output head reads each script token's channel; that token's logit is then about 40 and
  every other token's about 0, so sampling at temperature 1 follows the script (the chance of
  another token is about 49k * e^-40 per step).

A script is a string of tokens from the end of the generation prompt (`<|im_start|>assistant`
and "\\n") to `<|im_end|>`, in the tokenizer's own spelling: where rlproxy's tool-call grammar
leaves one way to go on (the JSON around the values, the closing tag), llguidance lets only that
spelling through. Each step's next token depends on the phase and the last four tokens, so no
two steps of a script may start from the same four with different next tokens (the builder
checks; the opening tag is spelled apart from the closing one, see `spell`). Arguments must be
written in the order of the tool's schema, and only with keys it has: the grammar holds the
model to that order. The answers rlproxy stores are these tokens; a history the client sends
back is rendered by the template, in its own spelling.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from tests.tiny_models import tiny_tokenizer

HEAD_DIM = 64
PHASE_PAIR = HEAD_DIM // 2 - 1  # head 0's lowest-frequency rotary pair: dims 31 and 63
LOOK_BACK = (1, 2, 3)  # the earlier tokens a step reads, by distance
NEAR_PAIRS = 20  # the look-back heads' rotary pairs: frequencies 1 ... 2^-19
NEAR_WEIGHT = 48.0  # each pair's share of a look-back score
CONST, MARK1, MARK2, PHASE1, PHASE2 = range(5)
FIRST_FREE = 5
OPEN_TAG = "<tool_call>"


def hermes_call(name: str, arguments: dict[str, object]) -> str:
    """A tool call as rlproxy's Hermes grammar has the model write it (proxy/chat/grammar.py:
    no whitespace around the JSON, ", " and ": " between items)."""
    body = json.dumps({"name": name, "arguments": arguments}, separators=(", ", ": "))
    return f"<tool_call>{body}</tool_call>"


def spell(text: str, tokenizer) -> list[int]:
    """The token ids the scripted model writes for `text`: the tokenizer's own (canonical)
    spelling, which is also what rlproxy's grammar lets through where it allows one spelling
    only (the JSON around the arguments' values, the closing tag), except an opening tool-call
    tag, spelled without the token `tool` so that it does not end like the closing one (the
    model must stop after that one and go on after this one)."""
    if not text.startswith(OPEN_TAG):
        return tokenizer.encode(text, add_special_tokens=False)
    (tool,) = tokenizer.encode("tool", add_special_tokens=False)
    pieces = ["<", "to", "ol", "_", "call", ">"]
    tag = [i for p in pieces for i in tokenizer.encode(p, add_special_tokens=False)]
    assert tool not in tag and tokenizer.decode(tag) == OPEN_TAG, tag
    return tag + tokenizer.encode(text[len(OPEN_TAG) :], add_special_tokens=False)


def marker_tokens(word: str, tokenizer) -> set[int]:
    """The tokens of `word` alone and after a space; each must be one token."""
    ids = [tokenizer.encode(w, add_special_tokens=False) for w in (word, " " + word)]
    assert all(len(i) == 1 for i in ids), (word, ids)
    return {i[0] for i in ids}


def build_scripted_model(
    folder: Path,
    embedded_dir: Path,
    scripts: Sequence[str],
    markers: tuple[str, str],
    context: int = 65536,
) -> Path:
    """Save the model described in the module docstring into `folder`: `scripts[p]` is its
    answer in phase p (0, 1, 2), `markers` the words that open phases 1 and 2. Beside the
    model, `scripts.json` holds each phase's answer as the token ids it samples."""
    import numpy as np
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    assert len(scripts) == 3
    tokenizer = tiny_tokenizer(embedded_dir, "qwen2")
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    context_size = max(LOOK_BACK) + 1
    prompt_end = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    prompt_end = prompt_end[-context_size:]
    marks = [marker_tokens(word, tokenizer) for word in markers]
    spelled = [[*prompt_end, *spell(text, tokenizer), end] for text in scripts]

    # One step per token a script writes: (phase, the tokens before it, newest last) -> it. A
    # script that writes a marker itself is in that marker's phase from there on (the model
    # reads its own answer as part of its context).
    steps: dict[tuple[int, tuple[int, ...]], int] = {}
    for script_phase, ids in enumerate(spelled):
        phase = script_phase
        for n in range(context_size, len(ids)):
            phase = max([phase] + [1 + k for k, m in enumerate(marks) if ids[n - 1] in m])
            key = (phase, tuple(ids[n - context_size : n]))
            if steps.setdefault(key, ids[n]) != ids[n]:
                seen = tokenizer.convert_ids_to_tokens(list(key[1]))
                raise ValueError(f"script {script_phase} goes on two ways after {seen}")

    d = np.arange(context + 1)
    for back in LOOK_BACK:
        scores = sum(NEAR_WEIGHT * np.cos(2.0**-k * (d - back)) for k in range(NEAR_PAIRS))
        assert scores[back] - np.delete(scores, back).max() >= 29.0, "look-back head too blunt"

    vocab = sorted({i for ids in spelled for i in ids})
    # Channels: the current token's, then the token `back` places earlier's for each distance.
    seen_at = [
        {token: FIRST_FREE + k * len(vocab) + n for n, token in enumerate(vocab)}
        for k in range(context_size)
    ]
    now = seen_at[0]
    per_back = math.ceil(len(vocab) / HEAD_DIM)  # heads per look-back distance
    heads = max(1 + per_back * len(LOOK_BACK), math.ceil(seen_at[-1][vocab[-1]] / HEAD_DIM) + 1)
    hidden = heads * HEAD_DIM

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=len(steps),
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=HEAD_DIM,
        max_position_embeddings=context,
        rope_theta=2.0**32,  # pair k turns 2^-k a token
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=end,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen2ForCausalLM(config)
    layer = model.model.layers[0]
    attention, mlp = layer.self_attn, layer.mlp
    half = HEAD_DIM // 2
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for norm in (layer.input_layernorm, layer.post_attention_layernorm, model.model.norm):
            norm.weight.fill_(1.0)

        embed = model.get_input_embeddings().weight
        embed[:, CONST] = 1.0
        for mark, ids in zip((MARK1, MARK2), marks, strict=True):
            embed[sorted(ids), mark] = 1.0
        for token, c in now.items():
            embed[token, c] = 1.0

        # Two channels lit (the constant and a marker's or a token's) normalise to
        # sqrt(hidden / 2) each. Head 0: scores q.k / 8 = 8 * key * lit / 8, so 30 for the
        # first marker and 40 for the second; values carry the marker to its phase channel.
        lit = (hidden / 2) ** 0.5
        attention.q_proj.bias[PHASE_PAIR] = 8.0
        attention.k_proj.weight[PHASE_PAIR, MARK1] = 30.0 / lit
        attention.k_proj.weight[PHASE_PAIR, MARK2] = 40.0 / lit
        attention.v_proj.weight[0, MARK1] = 1.0
        attention.v_proj.weight[1, MARK2] = 1.0
        attention.o_proj.weight[PHASE1, 0] = 1.0 / lit
        attention.o_proj.weight[PHASE2, 1] = 1.0 / lit

        # Look-back heads, `per_back` of them for each distance b: pair k of the query is
        # (r, 0), of the key r (cos bw, sin bw), w = 2^-k; rotated to their positions i and j
        # their product is r^2 cos(w (i - j - b)), largest b tokens back; r^2 / 8 = NEAR_WEIGHT.
        # The values copy that token's channel into its look-back channel.
        r = (NEAR_WEIGHT * HEAD_DIM**0.5) ** 0.5
        for k_back, back in enumerate(LOOK_BACK):
            for h in range(1 + k_back * per_back, 1 + (k_back + 1) * per_back):
                for k in range(NEAR_PAIRS):
                    w = back * 2.0**-k
                    attention.q_proj.bias[h * HEAD_DIM + k] = r
                    attention.k_proj.bias[h * HEAD_DIM + k] = r * math.cos(w)
                    attention.k_proj.bias[h * HEAD_DIM + k + half] = r * math.sin(w)
            for n, token in enumerate(vocab):
                row = (1 + k_back * per_back + n // HEAD_DIM) * HEAD_DIM + n % HEAD_DIM
                attention.v_proj.weight[row, now[token]] = 1.0
                attention.o_proj.weight[seen_at[back][token], row] = 1.0 / lit

        # Gates, in units of the constant channel: +0.5 when the phase and the tokens read all
        # hold, -0.5 or less otherwise; times 4 and RMSNorm's ~10, silu is ~20 or ~0. Each
        # writes its next token's channel at ~100 (up reads the constant).
        phase_terms = {
            0: {PHASE1: -1.0, PHASE2: -1.0},
            1: {PHASE1: 1.0, PHASE2: -1.0},
            2: {PHASE2: 1.0},
        }
        for n, ((phase, read), following) in enumerate(steps.items()):
            for back, token in enumerate(reversed(read)):
                mlp.gate_proj.weight[n, seen_at[back][token]] = 4.0
            needed = context_size + (phase > 0) - 0.5
            for c, weight in {**phase_terms[phase], CONST: -needed}.items():
                mlp.gate_proj.weight[n, c] = 4.0 * weight
            mlp.up_proj.weight[n, CONST] = 1.0
            mlp.down_proj.weight[now[following], n] = 0.5

        # The final norm leaves the next token's channel at ~sqrt(hidden): logit ~40.
        head = model.get_output_embeddings().weight
        for token, c in now.items():
            head[token, c] = 40.0 / hidden**0.5

    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=[end], pad_token_id=tokenizer.pad_token_id
    )
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    # What each phase's answer is, token for token (from the prompt's end token on).
    (folder / "scripts.json").write_text(json.dumps([ids[context_size:] for ids in spelled]))
    return folder
