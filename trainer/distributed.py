"""Data-parallel training: `rlproxy train` under `torchrun --nproc-per-node N`.

    torchrun --standalone --nproc-per-node 2 -m proxy.cli train

torchrun (or `accelerate launch`, which sets the same variables) starts N copies of
`rlproxy train` with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set. `from_env`
joins them into one process group: gloo on CPU, NCCL on CUDA (rank r on `cuda:<LOCAL_RANK>`).

Rank 0 leads. It alone opens the store, runs the training loop (`trainer.loop`), picks each
step's groups, marks them used and writes the checkpoint through `trainer.checkpoints`. The other
ranks never touch the database or the checkpoint folder: they run `follow`, which waits for rank
0's commands and carries them out on their own copy of the model:

- `("step", step, examples)`: the step's training examples, broadcast by rank 0 from inside
  `PeftTrainer.train_step` (so `trainer.loop` is the same with one process or N). Why a
  broadcast rather than every rank reading the same groups: the groups a step takes depend on
  the database at that moment (new groups arrive, rank 0 marks them used), so ranks reading
  separately could see different batches; a broadcast of a few megabytes of token ids per step
  costs nothing next to the step itself, and followers need no database access at all.
- `("sync", step, lora, optimizer)`: the LoRA weights and AdamW state after rank 0 loaded a
  checkpoint (resume, leaving a rolled-back version, a rewind) or reset its adapter, so every
  rank steps from the same weights.
- `("stop",)`: rank 0 is done; followers return and exit 0.

Each rank trains on its share of the step's rows (`shard`: the rows in the trainer's order, cut
into N contiguous runs of about the same number of tokens, so a group's members stay together
and keep sharing their prompt), with per-token weights computed over the whole batch
(`grpo.sample_row_weights`). The losses of the N shards therefore add up to the full-batch
loss, and `all_reduce_gradients` sums the LoRA gradients (one flat buffer, one all-reduce per
step): every rank then holds the full batch's gradient, clips it by the same global norm and
makes the same AdamW update, which equals one process's update up to float rounding. The
gradients are summed by hand rather than through torch's DistributedDataParallel wrapper
because the ranks run different numbers of micro-batches (DDP all-reduces on every backward and
would wait on the rank with fewer) and because the loss is already normalised over the whole
batch (DDP averages).

Followers wait for rank 0 without a time limit (it may wait hours for groups). When a rank dies,
torchrun stops the others; a follower's SIGTERM ends it at once (it holds nothing to write).

A failure during a step is the same on every rank only before the step's collectives (the
examples are checked on every rank) or after them (a non-finite loss or gradient, summed over
the ranks): those refuse the step on every rank and training goes on. Anything else raised in
between (out of memory on one GPU, a failed all-reduce) is this rank's alone while the others go
on to the next collective, so the ranks no longer agree on what comes next: with a 365-day
timeout, the next collective would wait for ever, or pair a broadcast with an all-reduce. Such
an error becomes `OutOfStep` (`Collective.lockstep`), which the training loop never retries: the
rank exits with it, torchrun stops the other ranks, and `rlproxy serve`'s supervisor starts them
all again from the last checkpoint. After it, this rank makes no further collective (rank 0 does
not send "stop").
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
"""What torchrun and accelerate launch set for each process."""

WAIT = timedelta(days=365)
"""Collective timeout: followers wait for rank 0's next step however long it waits for groups."""


def launched() -> bool:
    """Whether this process was started by torchrun (or accelerate launch) as one of several
    ranks: RANK and WORLD_SIZE are set."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


class OutOfStep(RuntimeError):
    """This rank failed part-way through a data-parallel step while the other ranks went on:
    the ranks no longer agree on the next collective, and the process must exit (torchrun then
    stops the others). Never retried."""


@dataclass
class Collective:
    """This process's place in the process group and the few collectives the trainer uses."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device
    out_of_step: OutOfStep | None = None
    """Set once `lockstep` saw this rank fail: every later collective raises it again."""

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @contextmanager
    def lockstep(self) -> Iterator[None]:
        """Around the part of a step between its first and last collective: an error raised
        there is this rank's alone, and is raised again as `OutOfStep`."""
        try:
            yield
        except OutOfStep:
            raise
        except Exception as exc:
            self.out_of_step = OutOfStep(
                f"rank {self.rank} of {self.world_size} failed inside a data-parallel step "
                f"({type(exc).__name__}: {exc}); the other ranks went on to the step's next "
                "collective, so this process exits and torchrun stops the others"
            )
            raise self.out_of_step from exc

    def _check(self) -> None:
        if self.out_of_step is not None:
            raise self.out_of_step

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0's `obj` on every rank (pickled; NCCL carries it through the GPU)."""
        self._check()
        box = [obj if self.leader else None]
        dist.broadcast_object_list(box, src=0, device=self._object_device())
        return box[0]

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` over all ranks, in place."""
        self._check()
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)

    def sum_floats(self, values: Sequence[float]) -> list[float]:
        """Each value summed over all ranks (float64 on the wire)."""
        dtype = torch.float64 if self.device.type != "mps" else torch.float32
        t = torch.tensor(list(values), dtype=dtype, device=self.device)
        self.all_reduce_sum(t)
        return [float(x) for x in t.tolist()]

    def barrier(self) -> None:
        self._check()
        if self.backend == "nccl":
            dist.barrier(device_ids=[self.device.index or 0])
        else:
            dist.barrier()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    def _object_device(self) -> torch.device | None:
        return self.device if self.backend == "nccl" else None


def from_env(device: str | None = None) -> Collective | None:
    """Join the process group torchrun describes (None when not launched that way).

    `device`: "cpu" or "cuda" forces one; default CUDA when available. On CUDA each rank uses
    `cuda:<LOCAL_RANK>` and NCCL, on CPU gloo.
    """
    if not launched():
        return None
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
    if missing:
        raise RuntimeError(
            f"RANK and WORLD_SIZE are set but {', '.join(missing)} is not: start the "
            "data-parallel trainer with torchrun (or accelerate launch), which sets all of them"
        )
    cuda = device != "cpu" and torch.cuda.is_available()
    if device is not None and device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError("the trainer was asked for CUDA but torch sees no CUDA device")
    if cuda:
        if local >= torch.cuda.device_count():
            raise RuntimeError(
                f"LOCAL_RANK {local} but this machine has {torch.cuda.device_count()} CUDA "
                "devices: start at most one trainer process per GPU"
            )
        where = torch.device("cuda", local)
        torch.cuda.set_device(where)
        backend = "nccl"
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=WAIT, device_id=where)
    else:
        where = torch.device("cpu")
        backend = "gloo"
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=WAIT)
    logger.info("data-parallel trainer: rank %d of %d on %s (%s)", rank, world, where, backend)
    return Collective(rank, world, local, backend, where)


def shard(lengths: Sequence[int], world_size: int, rank: int) -> slice:
    """Rank `rank`'s contiguous run of rows whose token counts are `lengths` (in the order the
    trainer runs them): N runs of about equal tokens, the same on every rank. A rank may get
    none when there are fewer rows than ranks."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    total = sum(lengths)
    cuts = [0]
    running = 0
    k = 1
    for i, n in enumerate(lengths):
        running += n
        # cut after row i once this run reaches its share of the tokens
        while k < world_size and running * world_size >= total * k:
            cuts.append(i + 1)
            k += 1
    cuts += [len(lengths)] * (world_size + 1 - len(cuts))
    return slice(cuts[rank], cuts[rank + 1])


def all_reduce_gradients(params: Iterable[torch.nn.Parameter], collective: Collective) -> None:
    """Sum every parameter's gradient over all ranks (a rank without one counts zeros): one
    flat buffer, one all-reduce."""
    params = list(params)
    if not params:
        return
    flat = torch.cat(
        [
            (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
            for p in params
        ]
    )
    collective.all_reduce_sum(flat)
    offset = 0
    for p in params:
        n = p.numel()
        grad = flat[offset : offset + n].view_as(p).to(p.dtype)
        if p.grad is None:
            p.grad = grad.clone()
        else:
            p.grad.copy_(grad)
        offset += n


def lora_checksum(weights: dict[str, torch.Tensor]) -> float:
    """sum |w| over LoRA weights, in float64: what a follower logs after taking rank 0's."""
    return float(sum(float(w.double().abs().sum()) for w in weights.values()))


class Follower(Protocol):
    """What `follow` needs of a trainer (`trainer.peft_backend.PeftTrainer` is one): this module
    stands below the backends and imports none of them."""

    step: int

    def step_shard(self, examples: Any) -> Any: ...

    def apply_state(
        self, lora: dict[str, torch.Tensor], optimizer: dict[str, torch.Tensor], step: int
    ) -> None: ...


def follow(trainer: Follower, collective: Collective) -> int:
    """A follower's whole life: carry out rank 0's commands until it says stop; return the
    number of steps made."""
    steps = 0
    while True:
        command = collective.broadcast()
        kind = command[0]
        if kind == "stop":
            logger.info("rank 0 stopped; rank %d stops after %d steps", collective.rank, steps)
            return steps
        if kind == "sync":
            _, step, lora, optimizer = command
            trainer.apply_state(lora, optimizer, step)
            logger.info(
                "rank %d took rank 0's weights at step %d (LoRA sum |w| %.6e)",
                collective.rank,
                step,
                lora_checksum(lora),
            )
            continue
        if kind == "step":
            _, step, examples = command
            trainer.step = step
            try:
                trainer.step_shard(examples)
            except (ValueError, FloatingPointError) as exc:
                # rank 0 refused the same examples the same way: its step changed nothing
                logger.warning("step refused on rank %d too: %s", collective.rank, exc)
                trainer.step = step
                continue
            steps += 1
            continue
        raise RuntimeError(f"unknown command from rank 0: {kind!r}")
