#!/usr/bin/env python3
"""One winnow attention call on the GPU, for a profiler to look at:
  ncu --kernel-name regex:attention --launch-skip 1 --launch-count 1 \\
      python3 tools/profile_attention.py --mechanism stick_breaking --length 16384 --dim 128
Warms up once, then runs the forward (and, with --backward, the backward) once more. TRA / TDA's
int8 screen runs with WINNOW_THRESHOLD_SCREEN=1 in the environment (with --beta 1)."""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import winnow  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--mechanism", choices=["softmax", "stick_breaking", "entmax15", "sieve_exact", "sieve_bound", "tra", "tda"],
                default="stick_breaking")
ap.add_argument("--beta", type=float, default=0.0, help="TRA / TDA: the threshold's beta (1: over 99%% exact zeros)")
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
beta = torch.full((heads,), args.beta, device="cuda", dtype=torch.float32)
lam = torch.full((heads,), 0.5, device="cuda", dtype=torch.float32)
q2, k2 = (torch.randn_like(q).requires_grad_(args.backward) for _ in range(2))
fn = {
    "softmax": winnow.softmax_attention,
    "stick_breaking": lambda *a: winnow.stick_breaking_attention(*a)[0],
    "entmax15": lambda *a: winnow.entmax_attention(*a, alpha=1.5),
    "sieve_exact": lambda *a: winnow.sieve_attention(*a)[0],
    "sieve_bound": lambda *a: winnow.sieve_attention(*a, filter="bound")[0],
    "tra": lambda *a: winnow.threshold_attention(*a, beta),
    "tda": lambda *a: winnow.threshold_attention(*a, beta, lam=lam, q2=q2, k2=k2),
}[args.mechanism]
for _ in range(2):
    out = fn(q, k, v)
    if args.backward:
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
torch.cuda.synchronize()
print("ok", tuple(out.shape))
