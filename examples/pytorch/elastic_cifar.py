"""An elastic DDP program: the seed tutorial's CNN on CIFAR-10, made elastic with
``trainctl.torch``. Under ``trainctl run --nnodes MIN:MAX`` a lost, added or departing node
regroups the workers in place (no restart, no checkpoint read, every sample once); under plain
``torchrun``, or run alone, it is ordinary DDP and resumes from its checkpoint when restarted.

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
import os
import pickle

import torch
import torch.nn.functional as F
from torch import nn

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


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="./data", help="CIFAR-10 (either official layout)")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=128, help="images per step on each worker")
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--weight-decay", type=float, default=1e-4)
    parser.add_argument("--out", default="./runs", help="OUT/RUN_ID/ gets the metrics and the checkpoint")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--print-freq", type=int, default=10, help="a loss line every N steps")
    parser.add_argument("--checkpoint-every", type=int, default=None, help="also checkpoint every N steps")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads of this worker")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    images, labels = load_cifar(args.data, train=True)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = Net()
    optimizer = torch.optim.SGD(
        model.parameters(), lr=args.learning_rate, momentum=args.momentum, weight_decay=args.weight_decay
    )
    job = Elastic(
        model,
        optimizer,
        dataset_size=len(labels),
        batch_size=args.batch_size,
        seed=args.seed,
        out=args.out,
        checkpoint_every=args.checkpoint_every,
        print_freq=args.print_freq,
        config={"data": args.data, "model": "seed-cnn", "image_size": 32},
    )
    for _epoch in job.epochs(args.epochs):
        for indices in job.batches():
            x, y = images[indices], labels[indices]
            with job.step() as step:
                out = job.model(x)
                loss = F.cross_entropy(out, y)
                loss.backward()
                step.loss = loss.item()
                step.correct = (out.argmax(1) == y).sum().item()

    if job.rank == 0:
        test_images, test_labels = load_cifar(args.data, train=False)
        model.eval()
        with torch.no_grad():
            predicted = torch.cat([model(b).argmax(1) for b in test_images.split(500)])
        right = (predicted == test_labels).sum().item()
        print(f"Accuracy of the network on the {len(test_labels)} test images: {100 * right / len(test_labels):.1f} %")
        for c, name in enumerate(CLASSES):
            mask = test_labels == c
            if mask.any():
                print(f"Accuracy for class: {name:5s} is {100 * (predicted[mask] == c).float().mean().item():.1f} %")
    job.finish()


if __name__ == "__main__":
    main()
