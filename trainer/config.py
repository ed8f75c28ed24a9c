"""The trainer's configuration: one dataclass, defaults from the literature, checked on creation.

This is the configuration of one GRPO run on a LoRA (what `trainer.peft_backend` and
`trainer.grpo` need, and how many groups a step takes and how stale they may be, which
`trainer.loop` reads); where the data comes from, how groups are formed and when a step runs
belong to the background loop, not here.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from trainer.staleness import STALE_POLICIES

BACKENDS = frozenset({"peft", "unsloth"})
DTYPES = frozenset({"auto", "float32", "bfloat16"})
OFF_POLICY_CORRECTIONS = frozenset({"ppo", "tis"})
MASKED_LOGPROBS = frozenset({"trainer", "stored"})
COHORT_ADVANTAGES = frozenset({"leave_one_out", "group"})
RELEASE_MEMORY = frozenset({"mmap", "trim", "off"})
MAX_MMAP_THRESHOLD = 32 * 1024 * 1024
"""mallopt(3)'s ceiling for M_MMAP_THRESHOLD on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)."""


@dataclass
class TrainerConfig:
    """GRPO on a LoRA adapter. Every field's help text says where its default comes from."""

    learning_rate: float = field(
        default=1.2e-3,
        metadata={
            "help": "AdamW learning rate on the LoRA parameters. LoRA wants a far larger rate than "
            "full fine-tuning (B starts at zero). Measured on SmolLM2-135M, r=8, one run each: "
            "the learning proof's task for 4 training minutes a rate (bench/lr_sweep.py, "
            "bench/results/lr_sweep.json): held-out reward 0.06-0.08 -> 0.10 at 1e-4, 0.26 at "
            "3e-4, 0.33 at 6e-4, 0.39 at 1.2e-3 (greedy exact 1 % -> 1 %, 8 %, 16 %, 21 %), and "
            "2.4e-3 collapsed to one answer for everything; the lookup agent's live traffic for "
            "60 minutes, seed 2 (bench/heldout_rerun_proof.py): +2.5 s.e. held out at 6e-4 "
            "(greedy success 1 % -> 1 %), +9.4 s.e. at 1.2e-3 (1 % -> 34 %). Trained far on one "
            "narrow task a version answers everything the task's way (about 30 steps at 6e-4), "
            "and the forgetting check holds it (docs/concepts/hot-swap.md)."
        },
    )
    lora_rank: int = field(default=8, metadata={"help": "LoRA rank r (DESIGN.md measured r=8)."})
    lora_alpha: int = field(
        default=16, metadata={"help": "LoRA alpha; the update is scaled by alpha / r (2 here)."}
    )
    lora_dropout: float = field(
        default=0.0, metadata={"help": "Dropout on the LoRA input; 0 keeps steps deterministic."}
    )
    target_modules: tuple[str, ...] = field(
        default=("q_proj", "k_proj", "v_proj", "o_proj"),
        metadata={"help": "Module names that get a LoRA: the attention projections."},
    )
    epsilon: float = field(
        default=0.2,
        metadata={"help": "PPO clip range: the ratio is clipped to [1 - epsilon, 1 + epsilon]."},
    )
    kl_beta: float = field(
        default=0.0,
        metadata={
            "help": "Weight of the k3 KL to the base model (adapter disabled). 0 turns it off and "
            "skips the reference forward pass, as in DAPO, Dr. GRPO and TRL's default."
        },
    )
    scale_advantages_by_std: bool = field(
        default=True,
        metadata={
            "help": "Divide advantages by the group's population std (DeepSeekMath GRPO); "
            "False keeps reward - group mean (Dr. GRPO)."
        },
    )
    cohort_advantage: str = field(
        default="leave_one_out",
        metadata={
            "help": "Advantages of a cohort group (different tasks of one agent, live traffic): "
            "'leave_one_out' takes r_i - mean of the other members, unscaled (RLOO; the "
            "baseline does not depend on the member's own answer, so task difficulty adds "
            "variance, not bias: trainer/grpo.py); 'group' uses the same rule as same-task "
            "groups (scale_advantages_by_std applies)."
        },
    )
    off_policy_correction: str = field(
        default="ppo",
        metadata={
            "help": "How the loss treats samples another version generated. 'ppo': the clipped "
            "ratio pi_theta / mu against the logprobs mu stored at sampling time (tokens whose "
            "ratio left [1 - epsilon, 1 + epsilon] on the advantage's side get no gradient; a "
            "negative advantage's ratio is unbounded above). 'tis': decoupled PPO with truncated "
            "importance sampling (Yao et al. 2025, 'Your efficient RL framework secretly brings "
            "you off-policy RL training'; AReaL's decoupled objective): the clipped ratio "
            "against the trainer's own logprobs pi_old at the step's start, each token's term "
            "weighted by min(pi_old / mu, tis_cap). On fresh samples (pi_old = mu) both are the "
            "same loss; 'tis' keeps the gradient of tokens the policy has moved away from and "
            "bounds each token's weight. Opt-in: 'ppo' is what every measured run used."
        },
    )
    masked_logprobs: str = field(
        default="trainer",
        metadata={
            "help": "The reference of the ratio for turns whose stored logprobs were taken after "
            "a grammar's mask (served by vLLM under tools or response_format: vLLM renormalises "
            "over the tokens the grammar allows, so the stored logprob is not the policy's; "
            "measured against a real vLLM: 1.02 nats higher per token on average, a first "
            "step's ratio of 0.69, below PPO's clip). 'trainer': the trainer's own logprobs at "
            "the step's start stand in for them (the ratio starts at 1; those turns get no "
            "off-policy correction). 'stored': use them as stored. Turns the local engine "
            "served, or served without a grammar, always use the stored logprobs."
        },
    )
    tis_cap: float = field(
        default=2.0,
        metadata={
            "help": "The cap C on the truncated importance weight min(pi_old / mu, C) "
            "(off_policy_correction 'tis'); 2 as in Yao et al. 2025. Lower "
            "caps cut variance and add bias; C = 1 never up-weights a token."
        },
    )
    max_staleness: int | None = field(
        default=4,
        metadata={
            "help": "Samples (turns) generated more than this many versions behind the version "
            "the step starts from are left out or down-weighted (stale_policy); null (None) "
            "turns the bound off, 0 trains only on samples the current weights generated. Each "
            "sample alone, after its group's advantages were taken over all members (a group is "
            "dropped only when every sample is: the base's watch share puts a base member in "
            "most groups); the base model is version 0; versions behind are counted along the "
            "checkpoint lineage (trainer/staleness.py). 4 is TRL's AsyncGRPOTrainer default; the "
            "learning proof's rounds are 1 version behind, so the bound acts on backlogs (the "
            "trainer takes the oldest groups first) and on versions left unpublished. With "
            "publish_adapters off (or a long canary), the trainer can run at most this many "
            "versions ahead of what serves before it drops everything: raise it or use None."
        },
    )
    max_ahead_of_serving: int | None = field(
        default=None,
        metadata={
            "help": "Wait instead of stepping while the trainer's weights are this many versions "
            "(or more) ahead of the version serving the policy name, and serving still has a "
            "newer version to decide on (a canary on trial, or a version it has not loaded "
            "yet): the traffic the serving version answers then stays within max_staleness. "
            "null (None, the default) never waits. Serving's state is read from the database "
            "(no policy state there, no wait); a wait ends after max_wait_for_serving_s whatever "
            "serving does. Each step records how far it was ahead (ahead_of_serving) either way."
        },
    )
    max_wait_for_serving_s: float = field(
        default=900.0,
        metadata={
            "help": "The longest max_ahead_of_serving waits in one stretch before it steps anyway "
            "(a canary that never ends must not stop training)."
        },
    )
    stale_policy: str = field(
        default="drop",
        metadata={
            "help": "What a step does with a sample past max_staleness: 'drop' (left out of the "
            "loss; a group whose every sample is past it is never trained on, marked skipped, as "
            "TRL's async trainer does) or 'downweight' (its loss is multiplied by stale_weight "
            "once per version past the bound)."
        },
    )
    stale_weight: float = field(
        default=0.5,
        metadata={
            "help": "With stale_policy 'downweight': the factor per version past max_staleness "
            "(a sample K + 2 behind counts stale_weight ** 2)."
        },
    )
    groups_per_step: int = field(
        default=4,
        metadata={"help": "Scored groups that make up one optimizer step."},
    )
    backend: str = field(
        default="peft",
        metadata={
            "help": "Which trainer runs the step: 'peft' (transformers + PEFT, CPU or CUDA; "
            "trainer/peft_backend.py) or 'unsloth' (Unsloth's FastLanguageModel, CUDA only, "
            "installed from deploy/requirements-trainer-gpu.txt; trainer/unsloth_backend.py). "
            "Both compute the same GRPO loss and write the same checkpoints."
        },
    )
    dtype: str = field(
        default="auto",
        metadata={
            "help": "Weights' dtype for the forward and backward: 'auto' (bfloat16 on CUDA, "
            "float32 on CPU), 'float32' or 'bfloat16'. The LoRA weights and AdamW state stay "
            "float32 either way (PEFT's autocast_adapter_dtype). On CPU, bfloat16 gave garbage "
            "for a left-padded batch in serving (DESIGN.md), so 'auto' keeps float32 there."
        },
    )
    micro_batch_size: int = field(
        default=4,
        metadata={
            "help": "Most rows (assistant turns) per forward/backward pass; gradients accumulate "
            "over micro-batches, so this trades memory for speed without changing the result. "
            "micro_batch_tokens bounds the same passes by tokens."
        },
    )
    micro_batch_tokens: int | None = field(
        default=4096,
        metadata={
            "help": "Most tokens one forward/backward pass runs (rows sharing a prompt: the "
            "prompt once plus each row's rest; other rows: rows x the longest, padded): "
            "activation memory grows with the tokens of a pass, not its rows, so long agent "
            "turns go a few (or one) at a time and short ones many at a time (verl's "
            "ppo_max_token_len_per_gpu, AReaL's max_tokens_per_mb). A row longer than this "
            "runs alone. Null (None): rows are counted by micro_batch_size only. Like "
            "micro_batch_size, it never changes the step's result."
        },
    )
    logprob_chunk: int = field(
        default=1024,
        metadata={
            "help": "Completion positions projected through the LM head at a time, each chunk "
            "recomputed in the backward (trainer/logprobs.py): bounds the logits to chunk x "
            "vocabulary floats (1,024 x 49,152 x 4 bytes = 200 MB for SmolLM2) however long "
            "the completions are. Does not change the result."
        },
    )
    share_prompt_prefix: bool = field(
        default=True,
        metadata={
            "help": "Run the prompt tokens that all rows of a micro-batch share once: the rows "
            "are packed into one sequence, the shared prefix and then each row's rest, under "
            "an attention mask where each rest sees the prefix and itself, with gradients "
            "through the prefix from every row. The members of a GRPO group share their "
            "prompt, so this removes most of the prompt's compute without changing logprobs or "
            "gradients beyond float rounding. Needs sdpa or eager attention and full attention "
            "in every layer (no sliding window); off on the unsloth backend (its forward builds "
            "its own masks)."
        },
    )
    pack_turns: bool = field(
        default=True,
        metadata={
            "help": "Train the turns of one trajectory as one row when each turn's stored prompt "
            "begins with exactly the previous turn's prompt and sampled tokens (an agent's "
            "chain of calls): the prompt runs once instead of once per turn, and the loss is "
            "unchanged. Turns whose tokens differ (the template re-tokenized an answer) or "
            "that would exceed max_seq_len keep rows of their own."
        },
    )
    gradient_checkpointing: bool = field(
        default=True,
        metadata={
            "help": "Recompute each decoder layer's activations in the backward instead of "
            "keeping them (transformers' non-reentrant checkpointing; Unsloth's own offloading "
            "variant on the unsloth backend): about a third more compute for far less "
            "activation memory. Measured on SmolLM2-135M: a forward of 2,000 tokens keeps "
            "about 2.5 GB of activations without it, 150 MB with it, so an agent's whole "
            "3,500-token prompt trains in a few GB only with it. TRL turns it on by default "
            "too; turn it off for short rows where memory is plentiful."
        },
    )
    checkpoint_min_tokens: int = field(
        default=1024,
        metadata={
            "help": "With gradient_checkpointing on, only a forward/backward pass that runs at "
            "least this many tokens (a micro-batch's shared prompt once plus each row's rest, "
            "or rows x the longest when padded) is checkpointed; shorter passes keep their "
            "activations (about 1.25 MB a token for SmolLM2-135M in float32, so at most about "
            "1.3 GB below 1,024) and skip the recomputation, which made the learning proof's "
            "short steps 1.87x slower than without checkpointing and 1.28x with this default "
            "(the rest was release_memory 'mmap' at a 64 KiB mmap_threshold, 1.05x at 1 MiB; "
            "bench/bench_trainer_defaults.py). Does not change the result. 0 checkpoints "
            "every pass."
        },
    )
    max_seq_len: int | None = field(
        default=None,
        metadata={
            "help": "Longest row (prompt + completion, or a packed trajectory) trained on. Null "
            "(None): the base model's context (config.json's max_position_embeddings; 8,192 for "
            "SmolLM2-135M). A longer turn is never cut (a prompt cut from the left is a context "
            "the policy never saw, so the stored logprobs would not fit it): it is left out of "
            "the step and counted (too_long in the step's metrics, "
            "rlproxy_trainer_turns_too_long_total). Memory is bounded by micro_batch_tokens, "
            "not by this."
        },
    )
    release_memory: str = field(
        default="mmap",
        metadata={
            "help": "How the trainer process hands freed memory back to the system (glibc only; "
            "nothing elsewhere). 'mmap': every allocation of mmap_threshold bytes (1 MiB) or "
            "more gets pages of its own (mallopt M_MMAP_THRESHOLD, which also stops glibc from "
            "raising that threshold as it does by default), returned when freed, plus 'trim' "
            "after each step. 'trim': malloc_trim(0) after each step only. 'off': glibc's "
            "defaults, under which the freed activations of long rows stay in the process's "
            "heap. Measured peak of one step on eight 3,500-token rows: 1,509 MB with 'mmap', "
            "7,396 MB with 'trim', 6,331 MB with 'off' (bench/bench_trainer_memory.py). "
            "'mmap' costs short steps 1.05x (learning proof's rows) to 1.19x (agent proof's) "
            "the CPU time of 'off' (page faults; bench/bench_trainer_defaults.py)."
        },
    )
    mmap_threshold: int = field(
        default=1024 * 1024,
        metadata={
            "help": "With release_memory 'mmap': allocations of this many bytes or more get "
            "pages of their own (mallopt M_MMAP_THRESHOLD, at most 32 MiB); smaller "
            "ones reuse the heap. Measured (bench/bench_trainer_memory.py, "
            "bench/bench_trainer_defaults.py; docs/concepts/grpo.md): one step on eight "
            "3,500-token rows peaked at 1,496 MB with 64 KiB, 1,509 MB with 1 MiB (the "
            "default), 2,417 MB with 4 MiB and 6,105 MB with 16 MiB; CPU time a step against "
            "release_memory 'off' was 1.30x / 1.05x / 1.05x / 1.08x on the learning proof's "
            "short rows and 1.33x / 1.19x / 1.02x / 1.01x on the agent proof's (page faults "
            "of fresh pages)."
        },
    )
    max_grad_norm: float = field(
        default=1.0, metadata={"help": "Clip the global gradient norm to this (TRL default)."}
    )
    weight_decay: float = field(
        default=0.0, metadata={"help": "AdamW weight decay on the LoRA parameters."}
    )
    seed: int = field(
        default=0, metadata={"help": "Seeds the LoRA initialisation and per-step dropout."}
    )

    def __post_init__(self) -> None:
        if isinstance(self.target_modules, str):
            raise ValueError(
                "target_modules must be a list of module names, e.g. ('q_proj', 'v_proj'), "
                f"not the string {self.target_modules!r}"
            )
        self.target_modules = tuple(self.target_modules)
        _check(
            math.isfinite(self.learning_rate) and self.learning_rate > 0,
            f"learning_rate must be a positive number, got {self.learning_rate}; "
            "for a LoRA use 5e-5..2e-4",
        )
        _check(self.lora_rank > 0, f"lora_rank must be >= 1, got {self.lora_rank}; 8 is typical")
        _check(self.lora_alpha > 0, f"lora_alpha must be > 0, got {self.lora_alpha}; use 2 x rank")
        _check(
            0.0 <= self.lora_dropout < 1.0,
            f"lora_dropout must be in [0, 1), got {self.lora_dropout}; 0 turns it off",
        )
        _check(
            len(self.target_modules) > 0
            and all(isinstance(m, str) and m for m in self.target_modules),
            f"target_modules must name at least one module, got {self.target_modules}; "
            "use e.g. ('q_proj', 'k_proj', 'v_proj', 'o_proj')",
        )
        _check(
            0.0 < self.epsilon < 1.0,
            f"epsilon must be in (0, 1), got {self.epsilon}; PPO and GRPO use 0.2",
        )
        _check(
            math.isfinite(self.kl_beta) and self.kl_beta >= 0.0,
            f"kl_beta must be >= 0, got {self.kl_beta}; 0 turns the KL term off",
        )
        _check(
            self.off_policy_correction in OFF_POLICY_CORRECTIONS,
            f"off_policy_correction must be one of {sorted(OFF_POLICY_CORRECTIONS)}, got "
            f"{self.off_policy_correction!r}",
        )
        _check(
            self.masked_logprobs in MASKED_LOGPROBS,
            f"masked_logprobs must be one of {sorted(MASKED_LOGPROBS)}, got "
            f"{self.masked_logprobs!r}",
        )
        _check(
            math.isfinite(self.tis_cap) and self.tis_cap >= 1.0,
            f"tis_cap must be a number >= 1, got {self.tis_cap}; 2 is the usual value",
        )
        _check(
            self.max_staleness is None
            or (
                isinstance(self.max_staleness, int)
                and not isinstance(self.max_staleness, bool)
                and self.max_staleness >= 0
            ),
            f"max_staleness must be an integer >= 0 or None (no bound), got {self.max_staleness}",
        )
        _check(
            self.max_ahead_of_serving is None
            or (
                isinstance(self.max_ahead_of_serving, int)
                and not isinstance(self.max_ahead_of_serving, bool)
                and self.max_ahead_of_serving >= 1
            ),
            "max_ahead_of_serving must be an integer >= 1 or None (never wait), got "
            f"{self.max_ahead_of_serving}; max_staleness is the value that keeps what serves "
            "trainable",
        )
        _check(
            math.isfinite(self.max_wait_for_serving_s) and self.max_wait_for_serving_s > 0,
            f"max_wait_for_serving_s must be a positive number of seconds, got "
            f"{self.max_wait_for_serving_s}",
        )
        _check(
            self.stale_policy in STALE_POLICIES,
            f"stale_policy must be one of {sorted(STALE_POLICIES)}, got {self.stale_policy!r}",
        )
        _check(
            0.0 < self.stale_weight <= 1.0,
            f"stale_weight must be in (0, 1], got {self.stale_weight}; use stale_policy 'drop' "
            "for 0",
        )
        _check(
            self.cohort_advantage in COHORT_ADVANTAGES,
            f"cohort_advantage must be one of {sorted(COHORT_ADVANTAGES)}, got "
            f"{self.cohort_advantage!r}",
        )
        _check(
            self.groups_per_step >= 1, f"groups_per_step must be >= 1, got {self.groups_per_step}"
        )
        _check(
            self.backend in BACKENDS,
            f"backend must be one of {sorted(BACKENDS)}, got {self.backend!r}",
        )
        _check(
            self.dtype in DTYPES,
            f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}; 'auto' picks bfloat16 "
            "on CUDA and float32 on CPU",
        )
        _check(
            not (self.backend == "unsloth" and self.dtype == "float32"),
            "the unsloth backend trains in 16-bit: use dtype 'auto' or 'bfloat16', or backend "
            "'peft' for float32",
        )
        _check(
            self.micro_batch_size >= 1,
            f"micro_batch_size must be >= 1, got {self.micro_batch_size}; lower it to save memory",
        )
        _check(
            self.micro_batch_tokens is None or self.micro_batch_tokens >= 2,
            f"micro_batch_tokens must be >= 2 or None (rows only), got {self.micro_batch_tokens}",
        )
        _check(
            self.checkpoint_min_tokens >= 0,
            f"checkpoint_min_tokens must be >= 0 (0 checkpoints every pass), got "
            f"{self.checkpoint_min_tokens}",
        )
        _check(
            self.release_memory in RELEASE_MEMORY,
            f"release_memory must be one of {sorted(RELEASE_MEMORY)}, got {self.release_memory!r}",
        )
        _check(
            0 < self.mmap_threshold <= MAX_MMAP_THRESHOLD,
            f"mmap_threshold must be 1..{MAX_MMAP_THRESHOLD} bytes (mallopt's ceiling), got "
            f"{self.mmap_threshold}",
        )
        _check(
            self.logprob_chunk >= 1,
            f"logprob_chunk must be >= 1, got {self.logprob_chunk}; 1024 is the default",
        )
        _check(
            self.max_seq_len is None or self.max_seq_len >= 2,
            f"max_seq_len must be >= 2 (a prompt and a completion token) or None (the model's "
            f"context), got {self.max_seq_len}",
        )
        _check(
            math.isfinite(self.max_grad_norm) and self.max_grad_norm > 0,
            f"max_grad_norm must be > 0, got {self.max_grad_norm}; 1.0 is the usual value",
        )
        _check(
            self.weight_decay >= 0.0,
            f"weight_decay must be >= 0, got {self.weight_decay}; 0 turns it off",
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (target_modules as a list)."""
        data = asdict(self)
        data["target_modules"] = list(self.target_modules)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainerConfig:
        """The inverse of `to_dict`; an unknown key is an error naming the nearest known one, so
        a typo does not pass silently."""
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(known))
        if unknown:
            named = []
            for key in unknown:
                near = difflib.get_close_matches(key, known, n=1)
                named.append(f"{key!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
            word = "field" if len(named) == 1 else "fields"
            raise ValueError(f"unknown trainer config {word} {', '.join(named)}")
        return cls(**data)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
