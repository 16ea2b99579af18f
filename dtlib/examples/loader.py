"""Which process loads which sample: a ``DistributedSampler`` gives each rank its indices, and the rank's
``DataLoader`` workers read only those.

    torchrun --standalone --nproc_per_node=2 -m dtlib.examples.loader
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler, get_worker_info


class IndexAndWorker(Dataset):
    """Sample ``i`` is the pair (i, id of the loader worker that read it; -1 in the rank's own process)."""

    def __init__(self, length: int = 8) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        worker = get_worker_info()
        return torch.tensor([index, -1 if worker is None else worker.id])


def main() -> None:
    dist.init_process_group("gloo")
    sampler = DistributedSampler(IndexAndWorker(8), shuffle=False)  # this rank's indices
    loader = DataLoader(sampler.dataset, batch_size=2, sampler=sampler, num_workers=2)
    print(f"rank {dist.get_rank()}: {[batch.tolist() for batch in loader]}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
