"""`rlproxy train`: the GRPO loop alone, against a database and a checkpoint folder.

`rlproxy serve` starts it as a child process; run it by hand on a separate machine that shares
the database (Postgres) and the checkpoint folder with the servers. It resumes from the newest
complete checkpoint, then trains whenever enough scored groups wait. SIGTERM stops it between
steps or mid-step; a killed step leaves no checkpoint behind. With `--steps N` on a terminal it
draws a progress bar; with `WANDB_PROJECT` set it logs each step's metrics to Weights & Biases
(`trainer.wandb_log`). It opens the store alone (`proxy.database`): the serving stack
(`proxy.runtime`, the engines' generation, the chat services) is never loaded here.

Data-parallel: under `torchrun --nproc-per-node N -m proxy.cli train` (or `accelerate launch`)
rank 0 does all of the above and the other ranks only train their share of each step
(`trainer.distributed`): they open no database, write nothing, and stop when rank 0 stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
from contextlib import AsyncExitStack
from pathlib import Path

from proxy.adapters.deployment import PRESENCE_TTL_S, trainer_presence_name
from proxy.cli.progress import progress
from proxy.database import opened_store
from proxy.settings import Settings
from storage.store import Store
from trainer import distributed
from trainer.loop import TrainingLoop
from trainer.wandb_log import WandbLog

logger = logging.getLogger(__name__)


async def train_command(settings: Settings, steps: int | None = None) -> int:
    """Train until stopped (or for `steps` steps); return an exit code."""
    from proxy.trainer_child import PARENT_PID_ENV, lower_priority, stop_with_parent

    if os.environ.get(PARENT_PID_ENV):  # serve's child: serving comes first
        logger.info(
            "trainer niceness %d (RLPROXY_TRAINER_NICE)", lower_priority(settings.trainer.nice)
        )
    if distributed.launched():
        _stop_with_server()  # our parent is torchrun; the server is its parent
    else:
        stop_with_parent()
    from proxy.engines.loader import resolve_model_dir
    from trainer.backends import open_trainer

    if settings.trainer.threads is not None:
        import torch

        torch.set_num_threads(settings.trainer.threads)
    config = settings.trainer.config
    collective = await asyncio.to_thread(distributed.from_env)  # None: one process
    device = None if collective is None else str(collective.device)

    def model_dir_() -> Path:
        # The base model the server serves (RLPROXY_BASE_MODEL), as a folder from_pretrained
        # loads. Data-parallel: rank 0 first (it may convert or unpack it), then the others.
        if collective is not None and not collective.leader:
            collective.barrier()
        found = resolve_model_dir(settings.base_model, settings.model_dir or settings.data_dir)
        if collective is not None and collective.leader:
            collective.barrier()
        return found

    if collective is not None and not collective.leader:
        try:
            model_dir = await asyncio.to_thread(model_dir_)
            follower = await asyncio.to_thread(
                open_trainer, model_dir, config, device=device, collective=collective
            )
            await asyncio.to_thread(distributed.follow, follower, collective)
        finally:
            collective.close()
        return 0
    model_dir = await asyncio.to_thread(model_dir_)
    async with AsyncExitStack() as stack:
        store = await stack.enter_async_context(opened_store(settings))  # closed last
        if collective is not None:
            stack.callback(collective.close)
            stack.callback(_stop_followers, collective)
        # The backend RLPROXY_TRAINER names (peft, or unsloth in the GPU trainer image).
        trainer = await asyncio.to_thread(
            open_trainer, model_dir, config, device=device, collective=collective
        )
        if collective is not None:
            await asyncio.to_thread(trainer.sync_followers)  # the same starting weights
        wandb = WandbLog.from_env(dataclasses.asdict(config), settings.model_name)
        if wandb is not None:
            stack.callback(wandb.close)
        loop = TrainingLoop(
            store,
            trainer,
            settings.checkpoints_dir,
            policy=settings.model_name,
            reward_policy=settings.reward_policy,
            poll_s=settings.trainer.poll_s,
            step_hooks=[wandb] if wandb is not None else [],
        )
        await loop.resume()
        logger.info("training %s into %s", settings.model_name, settings.checkpoints_dir)
        present = asyncio.create_task(_announce(store, settings))
        stack.push_async_callback(_cancelled, present)
        task = asyncio.create_task(_train(loop, steps, settings.trainer.poll_s))
        stop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            stop.add_signal_handler(sig, task.cancel)
        try:
            await task
        except asyncio.CancelledError:
            logger.info("trainer stopping")
        return 0


async def _announce(store: Store, settings: Settings) -> None:
    """Say on the database that a trainer of this policy runs (`trainer_presence_name`), for as
    long as it does: servers with no trainer of their own judge groups only while one does."""
    name = trainer_presence_name(settings.model_name)
    holder = f"{socket.gethostname()}:{os.getpid()}"
    ttl = max(PRESENCE_TTL_S, 3 * settings.trainer.poll_s)
    try:
        while True:
            try:  # held by another trainer of the policy: it says the same
                await store.acquire_lease(name, holder, ttl)
            except Exception:
                logger.exception("could not announce the trainer on the database; trying again")
            await asyncio.sleep(ttl / 3)
    finally:  # gone: servers with no trainer stop judging at once, not when the lease runs out
        with contextlib.suppress(Exception):
            await asyncio.shield(store.release_lease(name, holder))


async def _cancelled(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def _stop_with_server() -> None:
    """A rank of a data-parallel trainer that `rlproxy serve` started through torchrun
    (RLPROXY_TRAINER_PROCESSES > 1): SIGTERM when torchrun dies (the kernel's parent-death
    signal), and when the server that started torchrun dies (a thread checks every 2 s that
    torchrun's parent is still the server); torchrun then stops the other ranks."""
    import ctypes
    import os
    import sys
    import threading
    import time

    from proxy.trainer_child import PARENT_PID_ENV

    server = os.environ.get(PARENT_PID_ENV)
    if not server or sys.platform != "linux":
        return
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    launcher = os.getppid()

    def launcher_parent() -> int:
        try:
            stat = Path(f"/proc/{launcher}/stat").read_text()
        except OSError:
            return 0
        return int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state

    if launcher_parent() != int(server):
        return  # not started by the server's supervisor (torchrun run by hand)

    def watch() -> None:
        while launcher_parent() == int(server):
            time.sleep(2.0)
        logger.warning("the server that started this trainer is gone; stopping")
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="rlproxy-server-watch", daemon=True).start()


def _stop_followers(collective: distributed.Collective) -> None:
    """Rank 0 is done: tell the other ranks (best effort: they may be gone already). Not after
    a step left the ranks out of step: they wait in another collective, which the broadcast
    would be paired with; rank 0 exits and torchrun stops them."""
    if collective.out_of_step is not None:
        return
    try:
        collective.broadcast(("stop",))
    except Exception as exc:
        logger.warning("could not tell the other trainer ranks to stop: %s", exc)


async def _train(loop: TrainingLoop, steps: int | None, poll_s: float) -> None:
    if steps is None:
        await loop.run()
        return
    with progress(steps, "train", "steps") as bar:
        done = 0
        while done < steps:
            report = await loop.step_once()
            if report is None:
                await asyncio.sleep(poll_s)
                continue
            done += 1
            bar.set_postfix(
                version=report.version,
                loss=f"{report.metrics.get('loss', float('nan')):.4f}",
                reward=f"{report.mean_reward:.3f}",
            )
            bar.update(1)
