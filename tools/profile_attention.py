#!/usr/bin/env python3
"""One winnow attention call on the GPU, for a profiler to look at:
  ncu --kernel-name regex:attention --launch-skip 1 --launch-count 1 \\
      python3 tools/profile_attention.py --mechanism stick_breaking --length 16384 --dim 128
Warms up once, then runs the forward (and, with --backward, the backward) once more."""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import winnow  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--mechanism", choices=["softmax", "stick_breaking", "entmax15", "sieve_exact", "sieve_bound"], default="stick_breaking")
ap.add_argument("--length", type=int, default=16384)
ap.add_argument("--dim", type=int, default=128)
ap.add_argument("--tokens", type=int, default=16384)
ap.add_argument("--backward", action="store_true")
args = ap.parse_args()

heads = 12 if args.dim == 128 else 16
batch = max(1, args.tokens // args.length)
torch.manual_seed(0)
q, k, v = (torch.randn(batch, args.length, heads, args.dim, device="cuda", dtype=torch.bfloat16,
                       requires_grad=args.backward) for _ in range(3))
fn = {
    "softmax": winnow.softmax_attention,
    "stick_breaking": lambda *a: winnow.stick_breaking_attention(*a)[0],
    "entmax15": lambda *a: winnow.entmax_attention(*a, alpha=1.5),
    "sieve_exact": lambda *a: winnow.sieve_attention(*a)[0],
    "sieve_bound": lambda *a: winnow.sieve_attention(*a, filter="bound")[0],
}[args.mechanism]
for _ in range(2):
    out = fn(q, k, v)
    if args.backward:
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
torch.cuda.synchronize()
print("ok", tuple(out.shape))
