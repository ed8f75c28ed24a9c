"""GRPO step speed: rlproxy's PeftTrainer beside TRL's GRPOTrainer, same work, same run.

    .venv/bin/python bench/bench_grpo_speed.py [--steps 3] [--threads 2]

Needs `trl==1.16.0` and `datasets` (the `learn` extra; `make bench-grpo` installs it).
Both sides train the same thing:

- the fp32 SmolLM2-135M-Instruct checkpoint (`ensure_fp32_cache(rlproxy-data)`), a fresh LoRA
  r=8, alpha 16, dropout 0 on q,k,v,o, AdamW at lr 1e-4, gradient norm clipped to 1.0;
- one group of 8 samples of one chat prompt of exactly --prompt-tokens tokens (ChatML template
  with generation prompt; the prompt ids are checked to be identical on both sides), each with
  exactly --completion-tokens completion tokens (EOS suppressed by `min_new_tokens`);
- fp32 on CPU, no KL (beta 0: no reference pass), no gradient checkpointing (off on both
  sides; rlproxy's default is on since 2026-12-05), all 8 rows in one forward/backward pass,
  one optimizer step per GRPO step, the same torch thread count (`torch.set_num_threads`).

TRL (per_device_train_batch_size = num_generations = 8, gradient_accumulation_steps = 1, so
steps_per_generation = 1 and generation_batch_size = 8: one optimizer step covers exactly the 8
samples generated for it, and no separate old-logprob pass runs) generates inside its step;
rlproxy's trainer never generates (serving sampled the tokens and stored their logprobs), so
its examples are sampled once, before timing, with `model.generate` and its logits. Reported:

- TRL full step: on_step_begin .. on_step_end (generation, reward, advantages, forward with
  TRL's fused LM head, loss, backward, clipping, optimizer step);
- TRL training part: the full step minus `_generate_and_score_completions` (timed by a subclass);
- rlproxy: `PeftTrainer.train_step` (padding, forward, loss, backward, clipping, optimizer step),
  as configured by default (the 8 rows share their 64 prompt tokens: they run once), and, for
  the record of where the gain comes from, the same trainer with `share_prompt_prefix` off
  (every row runs its prompt, as TRL does).

One warm-up step each, then --steps measured steps, interleaved (TRL step, then the rlproxy
steps, driven from a TRL callback), so that load from other processes hits every side of a pair
alike. The ratios are given pair by pair (each step's rlproxy tokens/s over the same step's TRL
tokens/s) with their median and spread, in wall time and in process CPU time (less disturbed by
waiting for a core on a shared machine). Tokens per second count completion tokens trained
(those under the loss) and forward tokens (prompt + completion, no padding). A benchmark, not a
test: numbers depend on the machine and what else runs on it.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from peft import LoraConfig, TaskType
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from trl import __version__ as trl_version

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from proxy.engines.loader import ensure_fp32_cache  # noqa: E402
from trainer.config import TrainerConfig  # noqa: E402
from trainer.grpo import TrainingExample  # noqa: E402
from trainer.peft_backend import PeftTrainer  # noqa: E402

GROUP = 8
LR = 1e-4
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
TEXT = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle that was "
    "written by her grandmother fifty years ago. Describe the storm that night, the old lamp, "
    "the smell of salt and paraffin, and what the message finally asks her to do before dawn, "
    "in plain words a child could follow, with a hopeful ending and no dialogue at all."
)


def make_prompt(tokenizer, n_tokens: int) -> tuple[list[dict[str, str]], list[int]]:
    """A one-message chat whose templated prompt (as TRL tokenizes it) has exactly n_tokens."""

    def ids(text: str) -> list[int]:
        chat = [{"role": "user", "content": text}]
        out = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)
        return list(out["input_ids"])

    words = TEXT.split()
    text = next(
        (t for k in range(len(words), 0, -1) if len(ids(t := " ".join(words[:k]))) <= n_tokens),
        "",
    )
    while len(ids(text)) < n_tokens:  # top up one short word at a time
        text += " ok"
    return [{"role": "user", "content": text}], ids(text)


def sample_examples(
    trainer: PeftTrainer, prompt_ids: list[int], n_new: int
) -> list[TrainingExample]:
    """8 completions of exactly n_new tokens with their sampling logprobs, as serving stores."""
    inputs = torch.tensor([prompt_ids] * GROUP)
    with torch.no_grad():
        out = trainer.model.generate(
            input_ids=inputs,
            attention_mask=torch.ones_like(inputs),
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            min_new_tokens=n_new,
            max_new_tokens=n_new,
            return_dict_in_generate=True,
            output_logits=True,
        )
    completions = out.sequences[:, len(prompt_ids) :]
    logits = torch.stack(out.logits, dim=1).float()  # (B, n_new, V), before any processor
    logprobs = torch.log_softmax(logits, -1).gather(-1, completions[..., None]).squeeze(-1)
    return [
        TrainingExample(
            sample_id=f"s{i}",
            prompt_ids=list(prompt_ids),
            completion_ids=completions[i].tolist(),
            old_logprobs=logprobs[i].tolist(),
            advantage=1.0 if i % 2 == 0 else -1.0,
        )
        for i in range(GROUP)
    ]


class TimedGRPOTrainer(GRPOTrainer):
    """GRPOTrainer that times generation and scoring and keeps what it trains on."""

    gen_seconds = 0.0
    gen_cpu = 0.0
    last_batch: dict[str, Any] | None = None

    def _generate_and_score_completions(self, inputs):
        start, cpu = time.perf_counter(), time.process_time()
        batch = super()._generate_and_score_completions(inputs)
        self.gen_seconds += time.perf_counter() - start
        self.gen_cpu += time.process_time() - cpu
        self.last_batch = batch
        return batch


class Interleave(TrainerCallback):
    """Times each TRL optimizer step, then runs one step of each rlproxy trainer right after."""

    def __init__(self, rls: dict[str, PeftTrainer], examples: list[TrainingExample]) -> None:
        self.rls, self.examples = rls, examples
        self.trl_obj: TimedGRPOTrainer | None = None
        self.rows: list[dict[str, float]] = []
        self._start = self._cpu = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        assert self.trl_obj is not None
        self.trl_obj.gen_seconds = self.trl_obj.gen_cpu = 0.0
        self._start, self._cpu = time.perf_counter(), time.process_time()

    def on_step_end(self, args, state, control, **kwargs):
        full, cpu = time.perf_counter() - self._start, time.process_time() - self._cpu
        trl = self.trl_obj
        assert trl is not None
        batch = trl.last_batch
        assert batch is not None
        completion = int(batch["completion_mask"].sum())
        forward = completion + int(batch["prompt_mask"].sum())
        row = {
            "trl_full": full,
            "trl_gen": trl.gen_seconds,
            "trl_train": full - trl.gen_seconds,
            "trl_train_cpu": cpu - trl.gen_cpu,
            "trl_tokens": completion,
            "trl_forward": forward,
        }
        line = f"TRL {full:.2f} s (training part {full - trl.gen_seconds:.2f} s)"
        for name, rl in self.rls.items():
            cpu_start = time.process_time()
            metrics = rl.train_step(self.examples)
            row |= {
                name: metrics.seconds,
                f"{name}_cpu": time.process_time() - cpu_start,
                f"{name}_tokens": metrics.tokens,
                f"{name}_forward": metrics.forward_tokens,
                f"{name}_computed": metrics.computed_tokens,
            }
            line += f", {name} {metrics.seconds:.2f} s"
        self.rows.append(row)
        warm = " (warm-up)" if len(self.rows) == 1 else ""
        print(f"  step {len(self.rows) - 1}{warm}: {line}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="measured steps after 1 warm-up")
    parser.add_argument(
        "--no-ablation",
        action="store_true",
        help="skip the rlproxy trainer with share_prompt_prefix off",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--completion-tokens", type=int, default=64)
    parser.add_argument("--data-dir", type=Path, default=REPO / "rlproxy-data")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)
    warnings.filterwarnings("ignore")
    model_dir = ensure_fp32_cache(args.data_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    messages, prompt_ids = make_prompt(tokenizer, args.prompt_tokens)

    def rlproxy(share: bool) -> PeftTrainer:
        config = TrainerConfig(
            learning_rate=LR,
            lora_rank=8,
            lora_alpha=16,
            lora_dropout=0.0,
            target_modules=TARGETS,
            kl_beta=0.0,
            micro_batch_size=GROUP,  # all 8 rows in one pass, as TRL does
            max_seq_len=args.prompt_tokens + args.completion_tokens,
            share_prompt_prefix=share,
            gradient_checkpointing=False,  # as TRL is run here
            micro_batch_tokens=None,  # rows by count only, as before
        )
        return PeftTrainer(model_dir, config, device="cpu")

    rls = {"rlproxy": rlproxy(True)}
    if not args.no_ablation:
        rls["rlproxy_unshared"] = rlproxy(False)
    examples = sample_examples(rls["rlproxy"], prompt_ids, args.completion_tokens)

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench-trl-grpo-"),  # nothing is saved
        use_cpu=True,
        bf16=False,
        fp16=False,
        per_device_train_batch_size=GROUP,
        num_generations=GROUP,
        gradient_accumulation_steps=1,
        num_iterations=1,
        max_steps=1 + args.steps,
        max_completion_length=args.completion_tokens,
        generation_kwargs={"min_new_tokens": args.completion_tokens},
        temperature=1.0,
        beta=0.0,
        learning_rate=LR,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        gradient_checkpointing=False,
        logging_steps=10_000,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    lora = LoraConfig(
        task_type=TaskType.CAUSAL_LM,
        r=8,
        lora_alpha=16,
        lora_dropout=0.0,
        target_modules=list(TARGETS),
        bias="none",
    )
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)

    def reward_distinct_words(completions, **kwargs) -> list[float]:
        # Any varying reward will do: it only has to give non-zero advantages.
        return [float(len(set(c[0]["content"].split()))) for c in completions]

    callback = Interleave(rls, examples)
    trl = TimedGRPOTrainer(
        model=base,
        reward_funcs=reward_distinct_words,
        args=config,
        train_dataset=Dataset.from_list([{"prompt": messages}] * (1 + args.steps)),
        processing_class=tokenizer,
        peft_config=lora,
        callbacks=[callback],
    )
    callback.trl_obj = trl
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; group {GROUP}, prompt "
        f"{len(prompt_ids)} tokens, completion {args.completion_tokens} tokens; "
        f"1 warm-up + {args.steps} measured steps, interleaved",
        flush=True,
    )
    a = trl.args
    print(
        f"TRL {trl_version}: generation_batch_size {a.generation_batch_size}, "
        f"steps_per_generation {a.steps_per_generation}, loss {a.loss_type}, beta {a.beta}, "
        f"gradient_checkpointing {a.gradient_checkpointing}, optim {a.optim}",
        flush=True,
    )
    trl.train()
    shutil.rmtree(a.output_dir, ignore_errors=True)

    last = trl.last_batch
    assert last is not None
    trl_prompt = last["prompt_ids"][0][last["prompt_mask"][0].bool()].tolist()
    print(f"same prompt ids on both sides: {trl_prompt == prompt_ids}")
    measured = callback.rows[1:]

    def med(key: str) -> float:
        return statistics.median(r[key] for r in measured)

    tok, fwd = measured[-1]["trl_tokens"], measured[-1]["trl_forward"]
    table: list[tuple[str, float, int | None, int | None]] = []
    for name in rls:
        label = "rlproxy train_step" if name == "rlproxy" else "  (prompt not shared)"
        table.append(
            (label, med(name), measured[-1][f"{name}_tokens"], measured[-1][f"{name}_forward"])
        )
    table += [
        ("TRL training part", med("trl_train"), tok, fwd),
        ("TRL full step", med("trl_full"), tok, fwd),
        ("(TRL generation)", med("trl_gen"), None, None),
    ]
    print(f"\nmedian of {len(measured)} steps")
    print(f"{'':22}{'s/step':>9}{'tokens':>8}{'tok/s':>9}{'fwd tok':>9}{'fwd tok/s':>11}")
    for name, sec, t, f in table:
        if t is None or f is None:
            print(f"{name:22}{sec:9.2f}")
            continue
        print(f"{name:22}{sec:9.2f}{t:8d}{t / sec:9.1f}{f:9d}{f / sec:11.1f}")
    for name in rls:
        print(f"{name}: {measured[-1][f'{name}_computed']} tokens run per step (of {fwd})")

    # Noise: how much each side's own step time moved over the run.
    print("\nspread of step times over the run (max / min, wall):")
    for key in ("trl_train", *rls):
        times = [r[key] for r in measured]
        print(
            f"  {key:18}: {min(times):6.2f} .. {max(times):6.2f} s ({max(times) / min(times):.2f}x)"
        )

    # Ratios of completion tokens/s, pair by pair: each rlproxy step against the TRL step run
    # just before it (same load), then their median and range.
    print("\nrlproxy / TRL training part, pair by pair (completion tokens/s):")
    for name in rls:
        for clock, suffix in (("wall", ""), ("cpu", "_cpu")):
            pairs = [
                (r[f"{name}_tokens"] / r[name + suffix])
                / (r["trl_tokens"] / r["trl_train" + suffix])
                for r in measured
            ]
            listed = " ".join(f"{p:.2f}" for p in pairs)
            print(
                f"  {name:17} {clock:4}: {listed}  -> median {statistics.median(pairs):.2f}x "
                f"(range {min(pairs):.2f}..{max(pairs):.2f})"
            )
    full_pairs = [
        (r["rlproxy_tokens"] / r["rlproxy"]) / (r["trl_tokens"] / r["trl_full"]) for r in measured
    ]
    full = statistics.median(full_pairs)
    print(f"rlproxy / TRL full step (with generation), median pair: {full:.2f}x")


if __name__ == "__main__":
    main()
