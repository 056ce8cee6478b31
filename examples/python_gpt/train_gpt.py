#!/usr/bin/env python3
"""A small GPT written in plain PyTorch whose attention block is a winnow.nn module, trained
under torch.compile(fullgraph=True): how winnow drops into an existing PyTorch model.

The task is Copy: each sequence is L/2 random tokens followed by the same tokens again, so the
second half is predictable only by attending back L/2 positions. With --compare the same model
(same initialization, same batches) trains twice, once with winnow's fused operators and once
with the same attention as a composed PyTorch expression (winnow.composed), and the script
prints both loss curves and their speeds side by side.

    python3 examples/python_gpt/train_gpt.py --device cuda --mechanism stick_breaking \\
        --length 1024 --steps 50 --compare --json gpt.json
    python3 examples/python_gpt/train_gpt.py --device cpu --length 64 --steps 20 --no-compile

On CUDA the step runs under bf16 autocast; on the CPU in float32. Tokens/s is the median over
the steps after --timing-warmup (compilation excluded). --profile N prints where N more steps
spend their time.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

try:
    import winnow
except ImportError:  # run from a source tree without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))
    import winnow


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class Block(nn.Module):
    """Pre-norm transformer block; the attention is whatever winnow.nn module it is given."""

    def __init__(self, d: int, attention: nn.Module) -> None:
        super().__init__()
        hidden = 64 * math.ceil(8 * d / 3 / 64)
        self.norm1, self.attention = RMSNorm(d), attention
        self.norm2 = RMSNorm(d)
        self.gate, self.up = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        x = x + self.attention(self.norm1(x))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, mechanism: str,
                 implementation: str) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(
            Block(d, winnow.nn.attention(mechanism, d, heads, implementation=implementation))
            for _ in range(layers))
        self.norm = RMSNorm(d)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("o.weight", "down.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, tokens, targets):
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x)
        logits = self.norm(x) @ self.embedding.weight.t()  # tied embedding
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def copy_batch(gen, batch: int, length: int, vocab: int, device):
    """L/2 random tokens, then the same again; the loss counts the second half only (-100
    elsewhere), where each target is predictable."""
    half = length // 2
    first = torch.randint(0, vocab, (batch, half), generator=gen)
    seq = torch.cat([first, first, first[:, :1]], 1)[:, :length + 1]
    tokens, targets = seq[:, :-1].clone(), seq[:, 1:].clone()
    targets[:, :half - 1] = -100
    targets[:, -1] = -100  # the start of a third copy: not part of the task
    return tokens.to(device), targets.to(device)


def train(args, implementation: str):
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    model = GPT(args.vocab, args.d_model, args.layers, args.heads, args.mechanism,
                implementation).to(device)
    params = sum(p.numel() for p in model.parameters())
    fused = dict(fused=True) if device.type == "cuda" else {}
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, **fused)
    step_fn = torch.compile(model, fullgraph=True) if args.compile else model
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else torch.autocast("cpu", enabled=False))
    gen = torch.Generator().manual_seed(args.seed + 1)
    losses, times = [], []
    first_step_s = None
    for step in range(args.steps):
        tokens, targets = copy_batch(gen, args.batch, args.length, args.vocab, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with autocast:
            loss = step_fn(tokens, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item()  # synchronizes
        elapsed = time.perf_counter() - start
        if step == 0:
            first_step_s = elapsed
        losses.append(loss_value)
        times.append(elapsed)
        if args.verbose:
            print(f"  {implementation} step {step + 1}/{args.steps} loss {loss_value:.4f} "
                  f"{elapsed * 1e3:.1f} ms", flush=True)
    timed = times[args.timing_warmup:] or times
    median = statistics.median(timed)
    if args.profile:
        profile_steps(args, implementation, step_fn, optimizer, autocast, gen, device)
    return {
        "implementation": implementation,
        "parameters": params,
        "losses": losses,
        "first_step_s": first_step_s,
        "median_step_ms": median * 1e3,
        "tokens_per_s": args.batch * args.length / median,
        "peak_memory_gib": (torch.cuda.max_memory_allocated(device) / 2**30
                            if device.type == "cuda" else None),
    }


def profile_steps(args, implementation, step_fn, optimizer, autocast, gen, device) -> None:
    """--profile N: N more steps under torch.profiler; prints where the device time goes."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(args.profile):
            tokens, targets = copy_batch(gen, args.batch, args.length, args.vocab, device)
            with autocast:
                loss = step_fn(tokens, targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        loss.item()
    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    print(f"profile of {args.profile} steps ({implementation}):")
    print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=70))


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mechanism", default="stick_breaking", choices=sorted(winnow.nn.MECHANISMS))
    p.add_argument("--implementation", default="kernel", choices=["kernel", "composed"])
    p.add_argument("--compare", action="store_true",
                   help="train with the kernels and with the composed expression, same seed")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--compile", dest="compile", action="store_true", default=True)
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--length", type=int, default=1024)
    # 64 x 1024 = 65,536 tokens a step, the step of `winnow train-bench`. At 16 sequences the
    # H100 waits on the CPU launching kernels and the comparison measures Python, not attention.
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--timing-warmup", type=int, default=10)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after training, profile N more steps and print the top operators")
    args = p.parse_args(argv)
    if args.length < 4 or args.length % 2:
        p.error(f"argument --length: expected an even length >= 4, got {args.length}")
    if args.compile and not hasattr(torch, "compile"):
        p.error(f"torch.compile needs torch >= 2.0 (this is {torch.__version__}): pass --no-compile")
    return args


def main(argv=None):
    args = parse(argv)
    implementations = ["kernel", "composed"] if args.compare else [args.implementation]
    runs = []
    for implementation in implementations:
        run = train(args, implementation)
        runs.append(run)
        print(f"{args.mechanism} ({implementation}): {run['parameters']} parameters, "
              f"loss {run['losses'][0]:.4f} -> {run['losses'][-1]:.4f} in {args.steps} steps, "
              f"{run['tokens_per_s'] / 1e6:.3f} M tokens/s (median step {run['median_step_ms']:.2f} ms, "
              f"first step {run['first_step_s']:.1f} s)", flush=True)
    result = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "torch": torch.__version__, "runs": runs,
              "device_name": (torch.cuda.get_device_name() if args.device.startswith("cuda")
                              else "cpu")}
    if args.compare:
        kernel, comp = runs
        diffs = [abs(a - b) for a, b in zip(kernel["losses"], comp["losses"])]
        result["max_loss_difference"] = max(diffs)
        result["max_relative_loss_difference"] = max(
            d / abs(b) for d, b in zip(diffs, comp["losses"]))
        result["speedup"] = kernel["tokens_per_s"] / comp["tokens_per_s"]
        print(f"kernel / composed: {result['speedup']:.2f}x tokens/s; losses differ by at most "
              f"{result['max_loss_difference']:.2e} ({100 * result['max_relative_loss_difference']:.2f}%) "
              f"over {args.steps} steps")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
