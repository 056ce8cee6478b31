#!/usr/bin/env python3
"""The small GPT of examples/python_gpt (its attention a winnow.nn module) trained data-parallel
under torch.nn.parallel.DistributedDataParallel, one process per device, launched by torchrun:

    torchrun --standalone --nproc-per-node 2 examples/python_ddp/train_ddp.py --device cuda
    torchrun --standalone --nproc-per-node 2 examples/python_ddp/train_ddp.py --device cpu --steps 4

Every rank draws the step's whole batch of Copy sequences from the same generator and keeps its
slice, so the ranks together train on exactly the batches one process would (run the script
without torchrun for that one process): the losses agree up to the order of DDP's gradient
sums. The back end is NCCL on CUDA (NVLink multicast off: NCCL_NVLS_ENABLE=0) and gloo on the
CPU. Rank 0 prints the losses and, with --json, writes them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

_spec = importlib.util.spec_from_file_location(
    "train_gpt", Path(__file__).resolve().parents[1] / "python_gpt" / "train_gpt.py")
gpt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpt)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--mechanism", default="stick_breaking")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--batch", type=int, default=16, help="sequences per step over all ranks")
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=32)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    return ap.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.batch % world != 0:
        raise SystemExit(f"--batch: expected a multiple of the {world} processes, got {args.batch}")
    if args.device == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise SystemExit(f"LOCAL_RANK {local_rank} asks for GPU {local_rank}, but "
                             f"{torch.cuda.device_count()} are visible")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if world > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = gpt.GPT(args.vocab, args.d_model, args.layers, args.heads, args.mechanism, "kernel").to(device)
    ddp = DistributedDataParallel(model, device_ids=[local_rank] if device.type == "cuda" else None) \
        if world > 1 else model
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=0.0)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else torch.autocast("cpu", enabled=False))
    gen = torch.Generator().manual_seed(args.seed + 1)
    shard = args.batch // world
    losses = []
    for step in range(args.steps):
        tokens, targets = gpt.copy_batch(gen, args.batch, args.length, args.vocab, "cpu")
        tokens = tokens[rank * shard:(rank + 1) * shard].to(device)
        targets = targets[rank * shard:(rank + 1) * shard].to(device)
        with autocast:
            loss = ddp(tokens, targets)
        loss.backward()  # DDP averages the gradients over the ranks, bucket by bucket
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        report = loss.detach().float().reshape(1)
        if world > 1:
            dist.all_reduce(report)
            report /= world
        losses.append(report.item())
        if rank == 0:
            print(f"step {step + 1}/{args.steps} loss {losses[-1]:.4f} ({world} process"
                  f"{'es' if world > 1 else ''})", flush=True)
    if rank == 0 and args.json:
        checksum = sum(p.detach().double().sum().item() for p in model.parameters())
        Path(args.json).write_text(json.dumps({"world": world, "losses": losses, "checksum": checksum}))
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
