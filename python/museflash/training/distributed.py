"""One process or many: what //:train_drafter needs of torch.distributed.

Launched by `torchrun` (RANK, WORLD_SIZE and LOCAL_RANK in the environment), `start` joins the
process group: `nccl` when the process gets a CUDA device (cuda:LOCAL_RANK), `gloo` on CPU.
Without them it is one process, rank 0 of 1, and every collective here is a no-op.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Rank 0 makes the data while the others wait at a barrier: on a CPU that can take hours.
BARRIER_TIMEOUT = datetime.timedelta(hours=48)


@dataclass(frozen=True)
class Ranks:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    backend: str | None  # None: one process, no process group

    @property
    def main(self) -> bool:
        return self.rank == 0


def launched_by_torchrun() -> bool:
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def choose_device(local_rank: int, device: str | None = None) -> torch.device:
    """`device` when given ("cpu", "cuda"); else this rank's CUDA device when there is one,
    else the CPU."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        return torch.device("cuda", local_rank)
    return torch.device(device)


def start(device: str | None = None) -> Ranks:
    """Joins torchrun's process group (backend from the device), or returns rank 0 of 1."""
    if not launched_by_torchrun():
        return Ranks(0, 1, 0, choose_device(0, device), None)
    local_rank = int(os.environ["LOCAL_RANK"])
    chosen = choose_device(local_rank, device)
    backend = "nccl" if chosen.type == "cuda" else "gloo"
    if chosen.type == "cuda":
        torch.cuda.set_device(chosen)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=BARRIER_TIMEOUT)
    return Ranks(dist.get_rank(), dist.get_world_size(), local_rank, chosen, backend)


def stop(ranks: Ranks) -> None:
    if ranks.backend is not None and dist.is_initialized():
        dist.destroy_process_group()


def barrier(ranks: Ranks) -> None:
    if ranks.backend is not None:
        dist.barrier()


def sum_all(ranks: Ranks, values: torch.Tensor) -> torch.Tensor:
    """`values` (float64, CPU) summed over the ranks."""
    if ranks.backend is None:
        return values
    moved = values.to(ranks.device)
    dist.all_reduce(moved, op=dist.ReduceOp.SUM)
    return moved.cpu()


def any_rank(ranks: Ranks, flag: bool) -> bool:
    """Whether any rank says yes (every rank gets the same answer)."""
    return bool(sum_all(ranks, torch.tensor([float(flag)], dtype=torch.float64))[0] > 0)
