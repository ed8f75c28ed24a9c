"""The Unsloth trainer backend: rlproxy's own GRPO step on Unsloth's fast model, CUDA only.

`UnslothTrainer` is a `PeftTrainer` whose model comes from Unsloth's `FastLanguageModel`
(`from_pretrained` in 16-bit, then `get_peft_model` with the same LoRA shape); everything else
is the PEFT backend's: the rows, micro-batches and per-sample weights, the GRPO loss of
`trainer.grpo` on stored samples, AdamW on the LoRA, and the checkpoint contract of
`trainer.checkpoints` (PEFT's adapter files: no `modules_to_save`, no DoRA, bias "none", so
vLLM and the local engine load them). No TRL trainer is involved.

What differs from the PEFT backend, read from Unsloth's source (unsloth/models/llama.py,
`CausalLM_fast_forward`; unsloth/models/loader.py, `FastLanguageModel.from_pretrained`):

- The logits. Unsloth's forward ignores a boolean `logits_to_keep` and, with
  `UNSLOTH_RETURN_HIDDEN_STATES=1` (read on every call), returns the last hidden states in place
  of the logits, as Unsloth's own GRPO does. Those hidden states are what the PEFT backend's
  `_logprobs` takes from the decoder: the completion positions' go through `lm_head` and the
  model family's final logit transform in chunks (`trainer.logprobs`), as on the PEFT backend.
- No shared prompt prefix: Unsloth's forward builds its own attention masks (a packed sequence
  under a mask of rlproxy's, `PeftTrainer._packed`, is not one it takes), so every row runs in
  full, padded.
- Gradient checkpointing is Unsloth's own (`use_gradient_checkpointing="unsloth"`, activations
  offloaded to the host) when `gradient_checkpointing` is on.
- `from_pretrained` defaults to a 4-bit base; this backend always loads 16-bit weights
  (`load_in_4bit=False`), so the adapter is trained against the weights vLLM serves.

Unsloth pins a transformers range the CPU stack cannot share and refuses to run without a GPU:
it is installed only in the GPU trainer image (deploy/requirements-trainer-gpu.txt) and imported
only when this class is built (`trainer.backends.open_trainer` with backend "unsloth").
Unsloth asks to be imported before transformers; the trainer process has imported transformers
already by then, which costs Unsloth's patches of transformers' own Trainer (not used here), not
those of the model it loads.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel

from trainer.config import TrainerConfig
from trainer.distributed import Collective
from trainer.peft_backend import PeftTrainer


class UnslothUnavailable(RuntimeError):
    """Unsloth is not installed here, or this machine has no CUDA device for it."""


def import_unsloth() -> Any:
    """Unsloth's `FastLanguageModel`, or UnslothUnavailable saying why not."""
    if not torch.cuda.is_available():
        raise UnslothUnavailable(
            "the unsloth backend needs a CUDA GPU (Unsloth refuses to run without one); "
            "use backend 'peft' on this machine"
        )
    try:
        from unsloth import FastLanguageModel
    except ImportError as exc:
        raise UnslothUnavailable(
            "Unsloth is not installed: it lives in the GPU trainer image "
            "(pip install -r deploy/requirements-trainer-gpu.txt), not in the CPU install"
        ) from exc
    return FastLanguageModel


class UnslothTrainer(PeftTrainer):
    backend = "unsloth"

    def __init__(
        self,
        model_dir: Path,
        config: TrainerConfig,
        *,
        device: str | None = None,
        collective: Collective | None = None,
    ) -> None:
        self._fast = import_unsloth()
        if device is None and collective is None:
            device = "cuda"
        super().__init__(model_dir, config, device=device, collective=collective)

    def _load_model(self) -> PeftModel:
        config = self.config
        checkpointing: str | bool = "unsloth" if config.gradient_checkpointing else False
        model, _tokenizer = self._fast.from_pretrained(
            model_name=str(self.model_dir),
            max_seq_length=self.max_seq_len,
            dtype=self.dtype,
            load_in_4bit=False,
            load_in_8bit=False,
            full_finetuning=False,
            use_gradient_checkpointing=checkpointing,
            random_state=config.seed,
        )
        peft_model: PeftModel = self._fast.get_peft_model(
            model,
            r=config.lora_rank,
            target_modules=list(config.target_modules),
            lora_alpha=config.lora_alpha,
            lora_dropout=config.lora_dropout,
            bias="none",  # vLLM's LoRA loader refuses anything else
            use_gradient_checkpointing=checkpointing,
            random_state=config.seed,
            use_rslora=False,
            loftq_config=None,
        )
        return peft_model

    def _can_share_prefix(self) -> bool:
        return False  # Unsloth's forward builds its own masks

    def _hidden_states(
        self, input_ids: torch.Tensor, attention: torch.Tensor, positions: torch.Tensor | None
    ) -> torch.Tensor:
        """(B, T, H) last hidden states of padded rows (no packed prefix: every row in full)."""
        if positions is not None:
            raise ValueError("the unsloth backend runs every row in full (no shared prefix)")
        with _hidden_states_as_logits():
            out = self.model(input_ids=input_ids, attention_mask=attention, use_cache=False)
        hidden: torch.Tensor = out.logits
        return hidden


@contextlib.contextmanager
def _hidden_states_as_logits() -> Iterator[None]:
    """Unsloth's forward returns hidden states instead of logits while this is set."""
    previous = os.environ.get("UNSLOTH_RETURN_HIDDEN_STATES")
    os.environ["UNSLOTH_RETURN_HIDDEN_STATES"] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("UNSLOTH_RETURN_HIDDEN_STATES", None)
        else:
            os.environ["UNSLOTH_RETURN_HIDDEN_STATES"] = previous
