"""A plain PyTorch DDP training script on the CPU (gloo), as the seed tutorials' CPU example:
no trainctl in it. Run it anywhere torchrun runs it:

    trainctl run --standalone --nproc-per-node 2 -- python examples/ddp_gloo.py --epochs 2
    trainctl job launch -- python /data/code/ddp_gloo.py --epochs 2 --out /data/runs/ddp-gloo

It learns a small linear problem from generated data, each rank on its shard
(DistributedSampler), averages gradients through DDP, and rank 0 saves the model.
"""
import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--out", default=None, help="folder rank 0 saves model.pt in")
args = parser.parse_args()

dist.init_process_group("gloo")  # MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE from the launcher
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)  # the same data and initial weights on every rank
x = torch.randn(1024, 8)
y = x @ torch.arange(1.0, 9.0).unsqueeze(1) + 0.5
data = TensorDataset(x, y)
sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
model = DistributedDataParallel(torch.nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
for epoch in range(args.epochs):
    sampler.set_epoch(epoch)
    total, batches = 0.0, 0
    for xb, yb in loader:
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        loss.backward()
        optimizer.step()
        total, batches = total + loss.item(), batches + 1
    mean = torch.tensor([total / batches])
    dist.all_reduce(mean)
    if rank == 0:
        print(f"epoch {epoch + 1} loss {mean.item() / world:.4f} world {world}", flush=True)
if rank == 0 and args.out:
    os.makedirs(args.out, exist_ok=True)
    torch.save(model.module.state_dict(), os.path.join(args.out, "model.pt"))
    print(f"saved {args.out}/model.pt", flush=True)
# Every rank past its last collective before any tears gloo down: a rank that destroys the group
# while a peer's gloo thread still talks to it can abort ("terminate called without an active
# exception"; seen once in 3 full runs of the suite).
dist.barrier()
# The DDP wrapper (its reducer holds the group and threads of its own) goes first, then the group.
del model, optimizer
dist.destroy_process_group()
