"""Per-kernel CUDA times of one threshold-attention forward (torch.profiler), for finding where
the time goes: TRA and TDA at beta 0 and 1 on the benchmark's inputs (bf16, D = 128, H = 12,
B L = 16384 tokens), with and without key-tile skipping (WINNOW_DENSE_KEY_TILES).

  WINNOW_LIBRARY=build-gpu/libwinnow_torch.so python3 bench/profile_threshold.py --length 4096
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
    args = ap.parse_args()
    B, L, H, D = args.tokens // args.length, args.length, args.heads, args.dim
    torch.manual_seed(0)
    q, k, v, q2, k2 = (torch.randn(B, L, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(5))
    lam = torch.full((1,), 0.5, device="cuda")
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
                rows = {}
                for e in prof.events():
                    if e.device_type == torch.autograd.DeviceType.CUDA:
                        name = e.name.split("(")[0].split("<")[0].replace("void ", "")[-48:]
                        rows[name] = rows.get(name, 0.0) + e.device_time / 5
                total = sum(rows.values())
                print(f"L {L} {'TDA' if tda else 'TRA'} beta {beta_value} {'dense' if dense else 'skipping'}: "
                      f"{total / 1000:.3f} ms")
                for name, us in sorted(rows.items(), key=lambda kv: -kv[1]):
                    print(f"    {us / 1000:8.3f} ms  {name}")


if __name__ == "__main__":
    main()
