"""The ranks of a tensor-parallel engine: where they run, how they start, follow rank 0, stop and fail.

N ranks (`tensor_parallel_size`) over `nnodes` hosts, N / nnodes on each: host h holds ranks h * n .. h * n + n - 1,
on its devices 0 .. n - 1 (the local rank; CPU ranks all use the CPU). The ds4 process of a host is the
host's first rank and starts the others itself (spawn), or torchrun started every rank (`env://`). Rank 0 runs
the LLMEngine (scheduler, sampler, server); every other rank builds its shard of the model, its own caches and
runner the same way, then runs what rank 0 sends (ModelRunner.follow, ds4.engine.step_channel) until rank 0
sends None.

Faults. A started rank that exits while the engine runs is seen at once (its process sentinel): the log names
it, the other ranks this process started are killed (they would wait in a collective) and the fault listeners
(the server) are called; the engine's next step raises RanksOutOfStep. A rank on another host that dies closes
its gloo connections: rank 0's collective fails at once (gloo; NCCL waits for its watchdog). A rank that hangs
makes rank 0's collective time out after `distributed_timeout_s`. Started ranks watch the process that started
them and exit when it is gone, so nothing is left behind even when rank 0 is killed.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import wait

import torch

from ds4.engine.config import EngineConfig, EngineConfigError, Launch
from ds4.engine.loader import ModelSource
from ds4.engine.model_runner import build_runner
from ds4.engine.step_channel import StepChannel

logger = logging.getLogger(__name__)

# How long a stop waits for the ranks to leave their loop before they are killed.
STOP_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Placement:
    """This process's place among the ranks."""

    world_size: int
    rank: int
    local_rank: int  # its device index on its host
    started: tuple[tuple[int, int], ...]  # (rank, local rank) of the ranks this process starts
    init_method: str

    @property
    def is_torchrun(self) -> bool:
        return self.init_method == "env://"

    def device(self, device_type: str) -> torch.device:
        return torch.device("cuda", self.local_rank) if device_type == "cuda" else torch.device(device_type)


def start_ranks(
    cfg, config: EngineConfig, source: ModelSource, device: torch.device, launch: Launch | None
) -> Ranks | None:
    """This process's ranks of a tensor-parallel engine (None with one rank), after checking that the model splits
    over them: nothing is read before."""
    if config.tensor_parallel_size == 1 and not config.enable_expert_parallel:
        return None
    from ds4.distributed.parallel import ParallelConfig

    parallel = ParallelConfig(config.tensor_parallel_size, config.enable_expert_parallel)
    env = os.environ
    if "TORCHELASTIC_RUN_ID" in env:
        hosts = int(env["WORLD_SIZE"]) // int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"]))
    else:
        hosts = launch.nnodes if launch is not None else 1
    try:
        num_devices = torch.cuda.device_count() * hosts if device.type == "cuda" else None
        parallel.validate(cfg, num_devices, source.weight_format)
    except ValueError as e:
        raise EngineConfigError(str(e)) from None
    if parallel.world_size == 1:
        return None
    return Ranks(place(parallel.world_size, launch), source, config, device.type)


def place(world_size: int, launch: Launch | None = None) -> Placement:
    """This process's placement: from torchrun's environment when it started the ranks, else from the flags."""
    launch = launch or Launch()
    env = os.environ
    if "TORCHELASTIC_RUN_ID" in env:
        if int(env["WORLD_SIZE"]) != world_size:
            raise EngineConfigError(
                f"torchrun started {env['WORLD_SIZE']} processes but tensor_parallel_size is {world_size}: "
                "start one process per rank (--nnodes x --nproc-per-node = tensor_parallel_size)"
            )
        return Placement(world_size, int(env["RANK"]), int(env["LOCAL_RANK"]), (), "env://")
    nnodes, node_rank = launch.nnodes, launch.node_rank
    if nnodes < 1 or world_size % nnodes:
        raise EngineConfigError(f"nnodes ({nnodes}) must divide tensor_parallel_size ({world_size})")
    if not 0 <= node_rank < nnodes:
        raise EngineConfigError(f"node_rank ({node_rank}) must be in 0 .. nnodes - 1 ({nnodes - 1})")
    per_node = world_size // nnodes
    first = node_rank * per_node
    port = launch.master_port or _free_port(launch.master_addr)
    started = tuple((first + i, i) for i in range(1, per_node))
    return Placement(world_size, first, 0, started, f"tcp://{launch.master_addr}:{port}")


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Ranks:
    """This process's rank joined to the others, and the ranks it started (rank 0's process or a host's first)."""

    def __init__(self, placement: Placement, source: ModelSource, config: EngineConfig, device_type: str):
        """Start this host's other ranks, then join the process groups (blocks until every rank has joined)."""
        from ds4.distributed.parallel import init_distributed

        self.placement = placement
        self.fault: str | None = None
        self._listeners: list[Callable[[str], None]] = []
        self._stopping = False
        self._failing = threading.Lock()
        context = mp.get_context("spawn")
        self.processes, ready = {}, {}
        for rank, local_rank in placement.started:
            ready[rank], signal = context.Pipe(duplex=False)
            self.processes[rank] = context.Process(
                target=_rank_main,
                args=(placement, rank, local_rank, source, config, device_type, signal),
                name=f"ds4-rank-{rank}",
                daemon=True,
            )
            self.processes[rank].start()
            signal.close()
        # The rendezvous's timeout starts once this host's ranks have imported torch and ds4 (seconds, under load).
        for rank, conn in ready.items():
            if conn not in wait([conn, self.processes[rank].sentinel]) or not conn.poll():
                for process in self.processes.values():
                    process.kill()
                raise RuntimeError(f"tensor-parallel rank {rank} exited while starting (see its error above)")
            conn.close()
        self._monitor = threading.Thread(target=self._watch, name="ds4-ranks-monitor", daemon=True)
        self._monitor.start()
        try:
            self.parallel = init_distributed(
                placement.rank,
                placement.world_size,
                placement.init_method,
                "nccl" if device_type == "cuda" else "gloo",
                config.distributed_timeout_s,
                expert_parallel=config.enable_expert_parallel,
                local_rank=placement.local_rank,
            )
            self.channel = StepChannel(placement.rank, placement.world_size)
        except BaseException:
            self._stopping = True
            for process in self.processes.values():
                process.kill()
            raise

    def on_fault(self, listener: Callable[[str], None]) -> None:
        """Call listener(reason) once when the ranks fail: a started rank exits (from the monitor thread) or a step
        finds them out of step (from the engine's thread)."""
        self._listeners.append(listener)
        if self.fault is not None:
            listener(self.fault)

    def stop(self) -> None:
        """Rank 0: tell every rank to leave its loop; then wait for the started ones (killing those that stay)."""
        from ds4.distributed.parallel import destroy

        self._stopping = True
        if self.fault is None and self.placement.rank == 0:
            try:
                self.channel.send(None)
                self.channel.flush()
            except Exception:  # a rank is gone: the ones left are killed below
                logger.exception("could not tell the ranks to stop")
        for process in self.processes.values():
            process.join(STOP_TIMEOUT_S)
            if process.is_alive():
                logger.warning("rank %s did not stop within %.0f s; killing it", process.name, STOP_TIMEOUT_S)
                process.kill()
                process.join()
        destroy()  # also after a fault: this process may join a new group later (an offline LLM)

    def _watch(self) -> None:
        alive = {process.sentinel: rank for rank, process in self.processes.items()}
        while alive:
            for sentinel in wait(list(alive)):
                rank = alive.pop(sentinel)
                process = self.processes[rank]
                if self._stopping or self.fault is not None:
                    continue
                process.join(1.0)  # its sentinel is ready: the exit code comes with the join
                self.fail(f"tensor-parallel rank {rank} (pid {process.pid}) exited with code {process.exitcode}")

    def fail(self, reason: str) -> None:
        """The ranks are out of step: log why, kill the started ranks, tell the listeners (once)."""
        with self._failing:
            if self.fault is not None:
                return
            self.fault = reason
        logger.error("%s; stopping the engine", reason)
        for process in self.processes.values():
            if process.is_alive():
                process.kill()
        for listener in self._listeners:
            listener(reason)


def follow(ranks: Ranks, source: ModelSource, config: EngineConfig, device_type: str) -> None:
    """A rank other than 0: build its shard and runner like rank 0 does, then run rank 0's steps until told to
    stop."""
    device = ranks.placement.device(device_type)
    model = source.load(device, ranks.parallel)
    _, runner = build_runner(model, config, device, None, ranks.channel)
    runner.follow(ranks.channel)


def _rank_main(
    placement: Placement,
    rank: int,
    local_rank: int,
    source: ModelSource,
    config: EngineConfig,
    device_type: str,
    ready,
) -> None:
    """A started rank's process: the placement of the process that started it, moved to this rank."""
    ready.send(True)
    ready.close()
    threading.Thread(target=_exit_with_parent, name="ds4-parent-watch", daemon=True).start()
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s %(levelname)s rank {rank} %(name)s: %(message)s")
    mine = Placement(placement.world_size, rank, local_rank, (), placement.init_method)
    ranks = Ranks(mine, source, config, device_type)
    follow(ranks, source, config, device_type)
    ranks.stop()


def _exit_with_parent() -> None:
    wait([mp.parent_process().sentinel])
    os._exit(1)
