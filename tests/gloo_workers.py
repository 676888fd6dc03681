"""Spawn N local processes joined in one gloo group (`spawn_gloo`), importable from every test folder (the suite's
root conftest puts tests/ on the import path).

How the processes end is the point of this module. A rank whose process tore gloo down, or ran the interpreter's
shutdown (which destroys what still holds gloo's threads), while a peer was still in the last collective aborted
that peer now and then ('terminate called without an active exception', SIGABRT): a test that passed, failed in
CI one run in a few. So a rank that finished its work leaves in three steps (`_leave_together`): a gloo barrier
(every collective done), then the store, not gloo, says every rank is past it, then the process ends at once
(os._exit: nothing left to tear down that a peer could still be using). The store lives in rank 0's process, so
rank 0 leaves last, once every other rank is done with it.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ports import free_port

STORE_TIMEOUT = timedelta(minutes=5)


def spawn_gloo(world: int, fn, *args, result_file=None) -> list | None:
    """Run fn(rank, world, *args) in `world` spawned processes joined in one gloo group (one torch thread each).

    `fn` must be a module-level function (the processes import it). With
    `result_file`, every rank's return value is gathered on rank 0, saved
    there, and returned in rank order. A rank that raises ends the spawn with
    its traceback (torch.multiprocessing ends the other ranks).
    """
    out = None if result_file is None else str(result_file)
    mp.spawn(_gloo_worker, args=(world, free_port(), fn, args, out), nprocs=world, join=True)
    return None if out is None else torch.load(out, weights_only=False)


def _gloo_worker(rank: int, world: int, port: int, fn, args: tuple, result_file: str | None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=STORE_TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    result = fn(rank, world, *args)
    if result_file is not None:
        gathered = [None] * world
        dist.all_gather_object(gathered, result)
        if rank == 0:
            torch.save(gathered, result_file)
    _leave_together(store, rank, world)


def _leave_together(store: dist.Store, rank: int, world: int) -> None:
    """End this rank's process once no rank uses gloo any more and, for rank 0, once no rank uses the store."""
    dist.barrier()
    store.set(f"past_barrier/{rank}", "1")
    store.wait([f"past_barrier/{r}" for r in range(world)])
    if rank:
        store.set(f"left/{rank}", "1")
    else:
        store.wait([f"left/{r}" for r in range(1, world)])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
