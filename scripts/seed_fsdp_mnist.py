"""The seed tutorial's ``FSDP_mnist.py`` (FSDP1, size-based wrap policy, Adadelta + StepLR), as the
baseline that ``fsdp2lab train`` is measured against (docs/speed.md).

    python scripts/seed_fsdp_mnist.py --dataset fashion-mnist --epochs 2 --target-accuracy 90

Its model, data pipeline (torchvision dataset, ``ToTensor`` + ``Normalize`` per sample, a
``DistributedSampler``, two loader workers), training and test loops and printed lines are the
seed's. What differs, so that it runs where the seed's cannot: without GPUs its ranks are CPU
processes on gloo (``--world-size``, default 2; the seed asks one rank per GPU); the wrap policy
the seed builds is passed to FSDP (the seed's comment says it shards layers of more than 100
parameters, but its call leaves the policy out); ``--dataset fashion-mnist`` reads Debian's
``dataset-fashion-mnist`` files; ``--target-accuracy A`` stops at the first test at or above A%
and prints the time it took from the start of the training loop, the seed's timer; each rank
ends through ``exit_process``, as fsdp2lab's do; ``--train-samples N`` trains on the first N
training samples only (a quick check of the script; its timings use them all).
"""

from __future__ import annotations

import argparse
import functools
import gzip
import os
import shutil
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy
from torch.optim.lr_scheduler import StepLR
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

from fsdp2lab.runtime.distributed import exit_process

DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
# Each dataset's mean and standard deviation (the seed's values for MNIST).
NORMALIZE = {"mnist": ((0.1307,), (0.3081,)), "fashion-mnist": ((0.2860,), (0.3530,))}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


def train(model, rank, train_loader, optimizer, epoch, sampler, device):
    model.train()
    ddp_loss = torch.zeros(2).to(device)
    sampler.set_epoch(epoch)
    for data, target in train_loader:
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target, reduction="sum")
        loss.backward()
        optimizer.step()
        ddp_loss[0] += loss.item()
        ddp_loss[1] += len(data)
    dist.all_reduce(ddp_loss, op=dist.ReduceOp.SUM)
    if rank == 0:
        print(f"Train Epoch: {epoch} \tLoss: {ddp_loss[0] / ddp_loss[1]:.6f}")


def test(model, rank, test_loader, device) -> float:
    model.eval()
    ddp_loss = torch.zeros(3).to(device)
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            ddp_loss[0] += F.nll_loss(output, target, reduction="sum").item()
            pred = output.argmax(dim=1, keepdim=True)
            ddp_loss[1] += pred.eq(target.view_as(pred)).sum().item()
            ddp_loss[2] += len(data)
    dist.all_reduce(ddp_loss, op=dist.ReduceOp.SUM)
    accuracy = 100.0 * float(ddp_loss[1] / ddp_loss[2])
    if rank == 0:
        print(
            f"Test set: Average loss: {ddp_loss[0] / ddp_loss[2]:.4f}, "
            f"Accuracy: {int(ddp_loss[1])}/{int(ddp_loss[2])} ({accuracy:.2f}%)\n"
        )
    return accuracy


def unpack_fashion_mnist(root: Path) -> None:
    """Debian's gzipped IDX files, unpacked once where torchvision looks (before the ranks start)."""
    raw = root / "FashionMNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for gz in DEBIAN_FASHION_MNIST.glob("*-ubyte.gz"):
        target = raw / gz.name.removesuffix(".gz")
        if not target.exists():
            with gzip.open(gz) as src, open(target.with_suffix(".tmp"), "wb") as dst:
                shutil.copyfileobj(src, dst)
            target.with_suffix(".tmp").rename(target)


def datasets_for(name: str, root: Path, transform):
    kind = datasets.MNIST if name == "mnist" else datasets.FashionMNIST
    return (
        kind(root, train=True, download=name == "mnist", transform=transform),
        kind(root, train=False, transform=transform),
    )


def fsdp_main(rank, world_size, args, port):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = str(port)
    cuda = torch.cuda.is_available() and not args.no_cuda
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    torch.manual_seed(args.seed)

    transform = transforms.Compose(
        [transforms.ToTensor(), transforms.Normalize(*NORMALIZE[args.dataset])]
    )
    dataset1, dataset2 = datasets_for(args.dataset, Path(args.data_dir), transform)
    if args.train_samples is not None:
        dataset1 = torch.utils.data.Subset(dataset1, range(args.train_samples))
    sampler1 = DistributedSampler(dataset1, rank=rank, num_replicas=world_size, shuffle=True)
    sampler2 = DistributedSampler(dataset2, rank=rank, num_replicas=world_size)
    loader_kwargs = {"num_workers": 2, "pin_memory": cuda, "shuffle": False}
    train_loader = torch.utils.data.DataLoader(
        dataset1, batch_size=args.batch_size, sampler=sampler1, **loader_kwargs
    )
    test_loader = torch.utils.data.DataLoader(
        dataset2, batch_size=args.test_batch_size, sampler=sampler2, **loader_kwargs
    )
    policy = functools.partial(size_based_auto_wrap_policy, min_num_params=100)
    if cuda:
        torch.cuda.set_device(rank)
    model = FSDP(Net().to(device), auto_wrap_policy=policy, device_id=device)
    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)

    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        train(model, rank, train_loader, optimizer, epoch, sampler1, device)
        accuracy = test(model, rank, test_loader, device)
        scheduler.step()
        if args.target_accuracy is not None and accuracy >= args.target_accuracy:
            if rank == 0:
                print(
                    f"Time to {args.target_accuracy:g}%: {time.perf_counter() - start:.1f}s "
                    f"(epoch {epoch})"
                )
            break
    if rank == 0:
        print(f"Elapsed time: {time.perf_counter() - start:.1f}sec")
    dist.destroy_process_group()
    exit_process(0)  # no interpreter teardown beside gloo's threads (fsdp2lab.runtime.distributed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--test-batch-size", type=int, default=1000)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--gamma", type=float, default=0.7)
    parser.add_argument("--no-cuda", action="store_true")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--dataset", choices=list(NORMALIZE), default="mnist")
    parser.add_argument("--data-dir", default="../data")
    parser.add_argument("--world-size", type=int, default=None)
    parser.add_argument("--target-accuracy", type=float, default=None, metavar="PERCENT")
    parser.add_argument("--train-samples", type=int, default=None, metavar="N")
    args = parser.parse_args()
    if args.dataset == "fashion-mnist":
        unpack_fashion_mnist(Path(args.data_dir))
    gpus = torch.cuda.device_count() if not args.no_cuda else 0
    world_size = args.world_size or gpus or 2
    with socket.socket() as s:  # the seed's fixed port 12355, unless taken
        port = 12355 if s.connect_ex(("localhost", 12355)) else 0
    if not port:
        with socket.socket() as s:
            s.bind(("localhost", 0))
            port = s.getsockname()[1]
    mp.spawn(fsdp_main, args=(world_size, args, port), nprocs=world_size, join=True)


if __name__ == "__main__":
    main()
