"""The screened threshold forward (WINNOW_THRESHOLD_SCREEN) at the bench's shapes against the
unscreened one, and against itself over repeated back-to-back calls: a race between its kernels
(the screen, the candidate pass and the dense tiles' forward follow each other as programmatic
dependents) would show as calls that differ, where the tests' small shapes leave little time for
one. Prints one line per (method, length, beta) and exits 1 on a mismatch.

    python3 tools/screen_consistency.py [--lengths 4096 16384] [--betas 1 0.5 0] [--repeats 8]
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import winnow  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--betas", type=float, nargs="+", default=[1.0, 0.5, 0.0])
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--dim", type=int, default=128)
    args = ap.parse_args()
    torch.manual_seed(0)
    bad = 0
    for L in args.lengths:
        B = max(1, args.tokens // L)
        shape = (B, L, args.heads, args.dim)
        q, k, v, q2, k2 = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(5))
        lam = torch.full((1,), 0.5, device="cuda")
        for beta in args.betas:
            b = torch.full((1,), beta, device="cuda")
            for name, call in (("tra", lambda: winnow.threshold_attention(q, k, v, b)),
                               ("tda", lambda: winnow.threshold_attention(q, k, v, b, lam=lam, q2=q2, k2=k2))):
                with torch.no_grad():
                    plain = call().float()
                    os.environ["WINNOW_THRESHOLD_SCREEN"] = "1"
                    try:
                        outs = [call() for _ in range(args.repeats)]
                    finally:
                        del os.environ["WINNOW_THRESHOLD_SCREEN"]
                    torch.cuda.synchronize()
                first = outs[0].float()
                differing = sum(int(not torch.equal(o, outs[0])) for o in outs[1:])
                scale = plain.abs().max().item()
                err = (first - plain).abs().max().item() / max(scale, 1e-30)
                finite = bool(torch.isfinite(first).all())
                ok = differing == 0 and finite and err < 2e-2
                bad += not ok
                print(f"{name} L={L:6d} beta={beta:4.2f}: screened vs unscreened max |diff| / max |out| = {err:.2e}, "
                      f"{differing} of {args.repeats - 1} repeats differ from the first, finite {finite}"
                      f"{'' if ok else '  MISMATCH'}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
