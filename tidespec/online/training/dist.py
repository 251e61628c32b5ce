"""``DistContext``, the trainer's place in a ``torchrun`` group, and the DDP replica check.

Why this exists: the trainer may run on several ranks with DDP. Launched by ``torchrun``
(``WORLD_SIZE`` > 1) it joins a process group (gloo on CPU, nccl on CUDA); rank 0 lists shards and
decides, the others follow its broadcasts. With world size 1 every operation is a no-op, so the
rounds are written once for one process and for many.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tidespec.models.eagle3.head import Eagle3Head


@dataclass
class DistContext:
    """This process's place in a torch.distributed group (world size 1 = no group)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @staticmethod
    def from_env(backend: str, device: str) -> DistContext:
        """Join the group ``torchrun`` describes in the environment, if any."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return DistContext()
        if backend == "auto":
            backend = "nccl" if device.startswith("cuda") else "gloo"
        if not dist.is_initialized():
            dist.init_process_group(backend=backend)
        return DistContext(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.enabled:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def close(self) -> None:
        """Leave the process group. DDP wrappers sit in reference cycles (module graphs), so their
        reducers and gloo work can outlive the group until the interpreter finalizes, where a gloo
        thread releasing a tensor aborts the process ("terminate called without an active
        exception", seen once in 8 two-rank runs on a loaded 2-core host): collect them first."""
        if self.enabled and dist.is_initialized():
            gc.collect()
            dist.destroy_process_group()


def check_replicas_in_sync(head: Eagle3Head, ctx: DistContext) -> None:
    """DDP keeps every rank's weights identical; a mismatch means ranks trained apart (a bug)."""
    local = torch.stack([p.detach().double().sum() for p in head.parameters()])  # [P] on the head's device
    gathered = [torch.zeros_like(local) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, local)
    if any(not torch.allclose(g, gathered[0], rtol=1e-6, atol=1e-9) for g in gathered[1:]):
        raise RuntimeError("DDP replicas diverged: rank weights differ after training")
