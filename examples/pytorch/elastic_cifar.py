"""An elastic DDP program: the seed tutorial's CNN on CIFAR-10, made elastic with
``trainctl.torch``. Under ``trainctl run --nnodes MIN:MAX`` a lost, added or departing node
regroups the workers in place (no restart, no checkpoint read, every sample once); under plain
``torchrun``, or run alone, it is ordinary DDP and resumes from its checkpoint when restarted.

Its loop has what real ones have, each behind a flag: a per-step LR schedule
(``--lr-schedule onecycle``), gradient accumulation (``--accumulate K``), mixed precision with
a GradScaler (``--amp``), DataLoader worker processes (``--workers N``), and an evaluation on
the test set every epoch whose result the ranks all-reduce.

    pip install ./python
    trainctl run --standalone --nproc-per-node 2 -- python examples/pytorch/elastic_cifar.py --data ./data
    trainctl run --nnodes 2:4 --rdzv-endpoint host-a --rdzv-id job1 -- \\
        python examples/pytorch/elastic_cifar.py --data /shared/data --out /shared/runs

Data: either official CIFAR-10 layout in --data (binary ``data_batch_N.bin``/``test_batch.bin``,
or python ``data_batch_N``/``test_batch``), directly or in the folder its archive extracts to
(``trainctl data fetch`` gets it). Records: OUT/RUN_ID/metrics/rank-N.jsonl, as the built-in
trainer's; ``trainctl report OUT/RUN_ID`` draws them.
"""

import argparse
import math
import os
import pickle

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from trainctl.torch import Elastic

CLASSES = ("plane", "car", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


class Net(nn.Module):
    """The seed tutorial's CNN (PyTorch's "Training a classifier")."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def load_cifar(root, train):
    """Images (N, 3, 32, 32) normalised as the tutorial does, and labels, from either layout."""
    for folder in (root, os.path.join(root, "cifar-10-batches-bin"), os.path.join(root, "cifar-10-batches-py")):
        names = [f"data_batch_{i}" for i in range(1, 6)] if train else ["test_batch"]
        binary = [os.path.join(folder, n + ".bin") for n in names]
        python = [os.path.join(folder, n) for n in names]
        if any(os.path.isfile(p) for p in binary):
            raw = b"".join(open(p, "rb").read() for p in binary if os.path.isfile(p))
            rows = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(-1, 3073)
            labels, pixels = rows[:, 0].long(), rows[:, 1:]
            break
        if any(os.path.isfile(p) for p in python):
            labels, chunks = [], []
            for p in (p for p in python if os.path.isfile(p)):
                with open(p, "rb") as f:
                    batch = pickle.load(f, encoding="bytes")
                chunks.append(torch.as_tensor(batch[b"data"], dtype=torch.uint8))
                labels += list(batch[b"labels"])
            labels, pixels = torch.tensor(labels), torch.cat(chunks)
            break
    else:
        raise SystemExit(
            f"no CIFAR-10 in {root}: expected data_batch_1.bin (binary) or data_batch_1 (python), "
            "also under cifar-10-batches-bin/ or cifar-10-batches-py/; `trainctl data fetch --data DIR` gets it"
        )
    images = pixels.view(-1, 3, 32, 32).float().div(255).sub(0.5).div(0.5)
    return images, labels


def test_accuracy(model, images, labels, device):
    """This rank's share of the test set, summed over the ranks: a collective, so the loop runs
    it inside ``job.evaluate()``, which regroups and runs it again if a node is lost meanwhile."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model.eval()
    with torch.no_grad():
        x, y = images[rank::world].to(device), labels[rank::world].to(device)
        counts = torch.stack([(model(x).argmax(1) == y).sum().float(), torch.tensor(float(len(y)), device=device)])
    model.train()
    dist.all_reduce(counts)
    return (counts[0] / counts[1]).item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="./data", help="CIFAR-10 (either official layout)")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=128, help="images per forward on each worker")
    parser.add_argument("--accumulate", type=int, default=1, help="forwards per update (gradient accumulation)")
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--lr-schedule", choices=["constant", "onecycle"], default="constant",
                        help="onecycle: OneCycleLR up to 10x the learning rate, stepped after every step")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--weight-decay", type=float, default=1e-4)
    parser.add_argument("--amp", action="store_true", help="fp16 autocast with a GradScaler")
    parser.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    parser.add_argument("--out", default="./runs", help="OUT/RUN_ID/ gets the metrics and the checkpoint")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--print-freq", type=int, default=10, help="a loss line every N steps")
    parser.add_argument("--checkpoint-every", type=int, default=None, help="also checkpoint every N steps")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads of this worker")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")

    train = TensorDataset(*load_cifar(args.data, train=True))
    test_images, test_labels = load_cifar(args.data, train=False)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = Net().to(device)
    optimizer = torch.optim.SGD(
        model.parameters(), lr=args.learning_rate, momentum=args.momentum, weight_decay=args.weight_decay
    )
    scheduler = None
    if args.lr_schedule == "onecycle":
        # Steps counted at world size 1, the most a run can take: a smaller world takes more
        # steps per epoch (each step's global batch is batch size x accumulate x world size).
        steps = args.epochs * math.ceil(len(train) / (args.batch_size * args.accumulate))
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=10 * args.learning_rate, total_steps=steps)
    scaler = torch.amp.GradScaler(device.type) if args.amp else None
    job = Elastic(
        model,
        optimizer,
        dataset_size=len(train),
        batch_size=args.batch_size,
        accumulate=args.accumulate,
        scheduler=scheduler,
        scaler=scaler,
        seed=args.seed,
        out=args.out,
        checkpoint_every=args.checkpoint_every,
        print_freq=args.print_freq,
        config={"data": args.data, "model": "seed-cnn", "image_size": 32},
    )
    loader = job.loader(train, num_workers=args.workers, pin_memory=cuda)
    for epoch in job.epochs(args.epochs):
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            with job.step() as step:
                with torch.autocast(device.type, dtype=torch.float16, enabled=args.amp):
                    out = job.model(x)
                    loss = F.cross_entropy(out, y) / args.accumulate
                (scaler.scale(loss) if scaler is not None else loss).backward()
                step.loss = loss.item() * args.accumulate
                step.correct = (out.argmax(1) == y).sum().item()
            if scheduler is not None:
                scheduler.step()
        accuracy = job.evaluate(test_accuracy, job.module, test_images, test_labels, device)
        if accuracy is not None and job.rank == 0:
            print(f"epoch {epoch}: test accuracy {100 * accuracy:.1f} %", flush=True)

    if job.rank == 0:
        model.eval()
        with torch.no_grad():
            predicted = torch.cat([model(b.to(device)).argmax(1).cpu() for b in test_images.split(500)])
        right = (predicted == test_labels).sum().item()
        print(f"Accuracy of the network on the {len(test_labels)} test images: {100 * right / len(test_labels):.1f} %")
        for c, name in enumerate(CLASSES):
            mask = test_labels == c
            if mask.any():
                print(f"Accuracy for class: {name:5s} is {100 * (predicted[mask] == c).float().mean().item():.1f} %")
    job.finish()


if __name__ == "__main__":
    main()
