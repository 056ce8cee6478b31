"""The selecting mechanisms on the CPU: winnow's operators (the streaming CPU kernels, through
the Python package) beside the composed PyTorch expressions (`winnow.composed`: the score
matrix materialized, every weight computed from it) on the same inputs, in one process with
one thread count. Median milliseconds over repeated calls, the forward alone or with the
backward, and the ratio composed / winnow.

  python3 bench/cpu_mechanism_bench.py --lengths 1024 --threads 1
  python3 bench/cpu_mechanism_bench.py --mechanisms entmax13 sieve_exact --backward --json out.json

The library comes from $WINNOW_LIBRARY (or the package's own lookup); a CPU build's
libwinnow_torch.so works with a CPU torch.
"""

import argparse
import json
import platform
import time

import torch

import winnow
from winnow import composed

# name -> (winnow's call, the composed expression's call), each f(q, k, v) -> the output
MECHANISMS = {
    "softmax": (lambda q, k, v: winnow.softmax_attention(q, k, v),
                lambda q, k, v: composed.softmax_attention(q, k, v)),
    "stick_breaking": (lambda q, k, v: winnow.stick_breaking_attention(q, k, v)[0],
                       lambda q, k, v: composed.stick_breaking_attention(q, k, v)[0]),
    "entmax15": (lambda q, k, v: winnow.entmax_attention(q, k, v, alpha=1.5),
                 lambda q, k, v: composed.entmax_attention(q, k, v, alpha=1.5)),
    "sparsemax": (lambda q, k, v: winnow.entmax_attention(q, k, v, alpha=2.0),
                  lambda q, k, v: composed.entmax_attention(q, k, v, alpha=2.0)),
    "entmax13": (lambda q, k, v: winnow.entmax_attention(q, k, v, alpha=1.3),
                 lambda q, k, v: composed.entmax_attention(q, k, v, alpha=1.3)),
    "sieve_exact": (lambda q, k, v: winnow.sieve_attention(q, k, v)[0],
                    lambda q, k, v: composed.sieve_attention(q, k, v)[0]),
    "sieve_bound": (lambda q, k, v: winnow.sieve_attention(q, k, v, filter="bound")[0],
                    lambda q, k, v: composed.sieve_attention(q, k, v, filter="bound")[0]),
}


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def median_ms(fn, repeats):
    fn()  # warm-up: thread pool, first-touch pages
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2] * 1e3


def call(fn, q, k, v, backward):
    if not backward:
        with torch.no_grad():
            return lambda: fn(q, k, v)
    grad = torch.randn_like(v)

    def forward_backward():
        out = fn(q, k, v)
        torch.autograd.grad(out, (q, k, v), grad)
    return forward_backward


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch's and winnow's threads (0: all cores)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--mechanisms", nargs="+", choices=list(MECHANISMS), default=list(MECHANISMS))
    ap.add_argument("--backward", action="store_true", help="time forward and backward together")
    ap.add_argument("--no-composed", action="store_true", help="winnow's operators only")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    rows = []
    print(f"{'L':>6} {'mechanism':16} {'winnow ms':>10} {'composed ms':>12} {'composed/winnow':>16}")
    for L in args.lengths:
        torch.manual_seed(0)
        q, k, v = (torch.randn(args.batch, L, args.heads, args.dim, requires_grad=args.backward)
                   for _ in range(3))
        for name in args.mechanisms:
            ours, theirs = MECHANISMS[name]
            ms = median_ms(call(ours, q, k, v, args.backward), args.repeats)
            ref = None if args.no_composed else median_ms(call(theirs, q, k, v, args.backward), args.repeats)
            composed_text = f"{ref:12.2f}" if ref else f"{'-':>12}"
            ratio = f"{ref / ms:16.2f}" if ref else f"{'-':>16}"
            print(f"{L:6d} {name:16} {ms:10.2f} {composed_text} {ratio}")
            rows.append({"length": L, "mechanism": name, "winnow_ms": ms, "composed_ms": ref})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": cpu_name(), "threads": torch.get_num_threads(),
                       "torch": torch.__version__, "batch": args.batch, "heads": args.heads, "dim": args.dim,
                       "backward": args.backward, "repeats": args.repeats, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
