"""Several processes calibrating one model (torchrun, accelerate launch): who does what.

Each process (rank) runs its share of the calibration samples through the model; the
statistics the algorithms read (Hessians, ranges, mean magnitudes, AWQ's losses) are
summed or maxed over the ranks before they are read, so every rank sees the statistics of
all samples. Each weight is solved once, by one rank, and sent to the others; rank 0
writes the checkpoint. With one process (no process group) every function here is the
identity, at no cost: the library never needs torch.distributed.

gloo (CPUs) and nccl (GPUs) take the same calls; tensors are moved to the backend's device
and back where the backend needs it.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, replace

import torch
from torch import Tensor


def _dist():
    return torch.distributed if torch.distributed.is_available() and torch.distributed.is_initialized() else None


def world_size() -> int:
    dist = _dist()
    return dist.get_world_size() if dist else 1


def rank() -> int:
    dist = _dist()
    return dist.get_rank() if dist else 0


def is_main() -> bool:
    """Whether this process writes files and prints (rank 0, or the only process)."""
    return rank() == 0


def launched() -> bool:
    """Whether a launcher (torchrun, accelerate launch) started this process as one of several."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


TIMEOUT = datetime.timedelta(hours=6)  # how long a rank waits for the others (rank 0 evaluates alone)


def start(device: torch.device) -> torch.device:
    """Join the process group a launcher set up (torchrun and accelerate launch set RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK): nccl with one GPU per process
    (cuda:LOCAL_RANK) when the device is CUDA, else gloo. Returns this process's device."""
    from ptq.errors import PtqError

    local = int(os.environ.get("LOCAL_RANK", "0"))
    backend = "gloo"
    if device.type == "cuda":
        if local >= torch.cuda.device_count():
            raise PtqError(f"process {local} on this machine has no GPU: there are {torch.cuda.device_count()}; "
                           "start at most that many processes per node (--nproc-per-node)")
        device, backend = torch.device("cuda", local), "nccl"
        torch.cuda.set_device(device)
    if not torch.distributed.is_initialized():
        try:
            torch.distributed.init_process_group(backend, timeout=TIMEOUT)
        except (ValueError, RuntimeError) as error:
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise PtqError(f"cannot join the other processes ({backend}): {first}; start ptq with torchrun "
                           "or accelerate launch") from None
    return device


def stop() -> None:
    if _dist():
        torch.distributed.destroy_process_group()


def _backend_device(tensor: Tensor) -> torch.device:
    """Where the process group's backend wants tensors: CUDA for nccl, else where they are."""
    dist = _dist()
    if dist and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return tensor.device


def all_reduce_(tensor: Tensor, op: str = "sum") -> Tensor:
    """tensor, replaced in place by its sum ("sum") or elementwise maximum ("max") over the ranks."""
    dist = _dist()
    if not dist or dist.get_world_size() == 1:
        return tensor
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
    device = _backend_device(tensor)
    moved = tensor if tensor.device == device else tensor.to(device)
    dist.all_reduce(moved, op=ops[op])
    if moved is not tensor:
        tensor.copy_(moved)
    return tensor


def all_reduce_count(count: int) -> int:
    """The sum over the ranks of a count (tokens seen)."""
    if world_size() == 1:
        return count
    total = torch.tensor([count], dtype=torch.int64)
    return int(all_reduce_(total)[0])


def broadcast_object(value, source: int):
    """Rank `source`'s picklable value, on every rank (small things: shapes, messages)."""
    dist = _dist()
    if not dist or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=source)
    return box[0]


def share_from(value, source: int):
    """Rank `source`'s value (a picklable structure holding tensors: a solved weight), on
    every rank; the others pass None. Tensors travel through the CPU and arrive there
    (a CUDA tensor pickled as it is would arrive on the sender's device number)."""
    if world_size() == 1:
        return value
    return broadcast_object(_to_cpu(value) if rank() == source else None, source)


def _to_cpu(value):
    if isinstance(value, Tensor):
        return value.cpu()
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if hasattr(value, "__dataclass_fields__"):
        return replace(value, **{f: _to_cpu(getattr(value, f)) for f in value.__dataclass_fields__})
    return value


@dataclass(frozen=True)
class Share:
    """The calibration samples of one rank: samples[start:stop] of the whole set."""

    start: int
    stop: int


def sample_share(samples: int, batch_size: int) -> Share:
    """This rank's contiguous slice of the samples, in whole batches where there are enough
    (each rank's batches are then the single-process batches, only summed in another order)."""
    size, me = world_size(), rank()
    batches = -(-samples // batch_size)
    first, last = batches * me // size, batches * (me + 1) // size
    return Share(min(first * batch_size, samples), min(last * batch_size, samples))
