"""Per-kernel CUDA times of one threshold-attention forward (torch.profiler), for finding where
the time goes: TRA and TDA at beta 0 and 1 on the benchmark's inputs (bf16, D = 128, H = 12,
B L = 16384 tokens), with and without key-tile skipping (WINNOW_DENSE_KEY_TILES). With
--backward, one backward instead (beta 0), softmax's beside TRA's and TDA's: they share the
key-stationary kernel on Hopper, so the rows show what threshold attention adds around it.

  WINNOW_LIBRARY=build-gpu/libwinnow_torch.so python3 bench/profile_threshold.py --length 4096
  WINNOW_LIBRARY=build-gpu/libwinnow_torch.so python3 bench/profile_threshold.py --length 16384 --backward
"""

import argparse
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import winnow  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--backward", action="store_true", help="profile the backward pass (beta 0)")
    args = ap.parse_args()
    B, L, H, D = args.tokens // args.length, args.length, args.heads, args.dim
    torch.manual_seed(0)
    q, k, v, q2, k2 = (torch.randn(B, L, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(5))
    lam = torch.full((1,), 0.5, device="cuda")
    if args.backward:
        return profile_backward(L, q, k, v, q2, k2, lam)
    for tda in (False, True):
        for beta_value in (0.0, 1.0):
            for dense in (False, True):
                if dense:
                    os.environ["WINNOW_DENSE_KEY_TILES"] = "1"
                else:
                    os.environ.pop("WINNOW_DENSE_KEY_TILES", None)
                beta = torch.full((1,), beta_value, device="cuda")
                extra = dict(lam=lam, q2=q2, k2=k2) if tda else {}
                with torch.no_grad():
                    for _ in range(3):
                        winnow.threshold_attention(q, k, v, beta, **extra)
                    torch.cuda.synchronize()
                    with profile(activities=[ProfilerActivity.CUDA]) as prof:
                        for _ in range(5):
                            winnow.threshold_attention(q, k, v, beta, **extra)
                        torch.cuda.synchronize()
                print_kernels(f"L {L} {'TDA' if tda else 'TRA'} beta {beta_value} "
                              f"{'dense' if dense else 'skipping'}", prof, 5)


def print_kernels(title, prof, calls):
    rows = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            # The anonymous namespace's parenthesis would cut every winnow kernel's name short.
            name = e.name.replace("(anonymous namespace)::", "").split("(")[0].split("<")[0]
            name = name.replace("void ", "")[-48:]
            rows[name] = rows.get(name, 0.0) + e.device_time / calls
    print(f"{title}: {sum(rows.values()) / 1000:.3f} ms")
    for name, us in sorted(rows.items(), key=lambda kv: -kv[1]):
        print(f"    {us / 1000:8.3f} ms  {name}")


def profile_backward(L, q, k, v, q2, k2, lam):
    leaves = [t.detach().requires_grad_() for t in (q, k, v, q2, k2)]
    beta = torch.zeros(1, device="cuda", requires_grad=True)
    lam = lam.detach().requires_grad_()
    runs = {
        "softmax": lambda: winnow.softmax_attention(*leaves[:3]),
        "TRA": lambda: winnow.threshold_attention(*leaves[:3], beta),
        "TDA": lambda: winnow.threshold_attention(*leaves[:3], beta, lam=lam, q2=leaves[3], k2=leaves[4]),
    }
    for name, run in runs.items():
        out = run()
        grad = torch.randn_like(out)
        inputs = [t for t in leaves + [beta, lam] if t.requires_grad]
        for _ in range(3):
            torch.autograd.grad(out, inputs, grad, retain_graph=True, allow_unused=True)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                torch.autograd.grad(out, inputs, grad, retain_graph=True, allow_unused=True)
            torch.cuda.synchronize()
        print_kernels(f"L {L} {name} backward, beta 0", prof, 5)


if __name__ == "__main__":
    main()
