"""Threshold attention's CPU kernels beside winnow's CPU softmax, forward only, float32, through
the package's operators (same process, same threads): TRA and TDA at beta = 0 (about half the
weights nonzero, no key tile skippable), 0.5 and 1 (almost all weights zero), with each setting's
exact-zero fraction. Median of 5 calls after one warm-up.

    PYTHONPATH=python WINNOW_LIBRARY=build/libwinnow_torch.so python3 bench/cpu_threshold_bench.py
"""

import argparse
import time

import torch

import winnow


def median_seconds(fn, repeats=5):
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 2]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    L, H, D = args.length, args.heads, args.dim
    q, k, v, q2, k2 = (torch.randn(1, L, H, D) for _ in range(5))
    visible = torch.arange(1, L + 1, dtype=torch.float32).view(1, L, 1)
    print(f"L = {L}, H = {H}, D = {D}, float32, forward")
    print(f"{'variant':40s} {'median ms':>10s}")
    print(f"{'softmax':40s} {1e3 * median_seconds(lambda: winnow.softmax_attention(q, k, v)):10.1f}")
    for beta in (0.0, 0.5, 1.0):
        b = torch.tensor([beta])
        lam = torch.tensor([0.5])
        _, nonzero, _ = torch.ops.winnow.threshold_attention_forward(q, k, v, b, count_nonzero=True)
        zeros = 1 - (nonzero.float() / visible).mean().item()
        tra = median_seconds(lambda: winnow.threshold_attention(q, k, v, b))
        tda = median_seconds(lambda: winnow.threshold_attention(q, k, v, b, lam=lam, q2=q2, k2=k2))
        print(f"{f'TRA beta {beta} (zero fraction {zeros:.4f})':40s} {1e3 * tra:10.1f}")
        print(f"{f'TDA beta {beta}':40s} {1e3 * tda:10.1f}")


if __name__ == "__main__":
    main()
