"""Run a function on N ranks: N spawned processes joined over gloo (file:// rendezvous in a fresh temporary
directory), each calling fn(parallel, *args); the ranks' return values come back in rank order.

A rank that raises, dies or outlives the timeout fails the call with its rank named (and its traceback);
every process started here is killed and reaped before the call returns, so nothing is left behind.
fn must be importable by name (a module-level function), as the spawned processes import it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import time
import traceback


def run_ranks(fn, world_size: int, *args, expert_parallel: bool = False, timeout_s: float = 240.0) -> list:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="ds4-ranks-") as tmp:
        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(fn, rank, world_size, init, expert_parallel, args, results),
                name=f"ds4-rank-{rank}",
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        try:
            return _collect(procs, results, world_size, time.monotonic() + timeout_s)
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join()
            results.close()


def _collect(procs, results, world_size: int, deadline: float) -> list:
    out: dict[int, object] = {}
    while len(out) < world_size:
        left = deadline - time.monotonic()
        if left <= 0:
            waiting = sorted(set(range(world_size)) - set(out))
            raise TimeoutError(f"ranks {waiting} gave no result in time")
        try:
            rank, ok, payload = results.get(timeout=min(left, 0.5))
        except queue.Empty:
            dead = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in out]
            if dead:
                raise RuntimeError(f"rank {dead[0][0]} died (exit code {dead[0][1]}) without a result") from None
            continue
        if not ok:
            raise RuntimeError(f"rank {rank} failed:\n{payload}")
        out[rank] = pickle.loads(payload)
    return [out[r] for r in range(world_size)]


def _rank_main(fn, rank, world_size, init, expert_parallel, args, results) -> None:
    import torch

    from ds4.distributed.parallel import destroy, init_distributed

    torch.set_num_threads(1)
    try:
        parallel = init_distributed(rank, world_size, init, "gloo", 120.0, expert_parallel=expert_parallel)
        # Plain bytes: torch's queue pickler would share tensors through file descriptors of a dying process.
        results.put((rank, True, pickle.dumps(fn(parallel, *args))))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        destroy()
