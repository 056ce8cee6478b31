"""Multiscreen's screening (issue 15) on the GPU beside torch SDPA (FlashAttention-2 and cuDNN back
ends) on the same heads and tokens, in one run.

Shapes (issue 15): bf16, B = 4, 16 heads, d_K = 16, d_V = 64, L in {4096, 16384}; SDPA runs
causal softmax attention at head dimension 64 (q, k, v all 64 wide) on the same B, L and heads.
Two window settings for screening: "init", 001's initialization (s_w linearly spaced from 0 to
log 256 over the heads: windows 2 .. 257, s_r = 0), and "infinite" (every window expanded: full
causal attention). q, k, v ~ N(0, 1). Times are medians of CUDA-event timings after warm-up;
"vs flash" is SDPA-flash's time over screening's (above 1: screening is faster). SDPA's TFLOP/s
use the causal count 4 B H L^2 D / 2 forward (3.5x that forward+backward).
Writes JSON (--json) and prints a table.
"""

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import winnow  # noqa: E402
from gpu_attention_bench import median_ms, sdpa  # noqa: E402

from torch.nn.attention import SDPBackend  # noqa: E402


def screening_inputs(B, L, H, dk, dv, windows, device, requires_grad):
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=torch.bfloat16).requires_grad_(requires_grad)

    q, k, v = rnd(B, L, H, dk), rnd(B, L, H, dk), rnd(B, L, H, dv)
    s_w = torch.linspace(0.0, math.log(256.0), H, device=device).requires_grad_(requires_grad)
    s_r = torch.zeros(H, device=device).requires_grad_(requires_grad)
    expand = 1.0 if windows == "infinite" else 0.0
    return q, k, v, s_w, s_r, expand


def time_screening(B, L, H, dk, dv, windows, device):
    q, k, v, s_w, s_r, expand = screening_inputs(B, L, H, dk, dv, windows, device, True)
    dout = torch.randn(B, L, H, dv, device=device, dtype=torch.bfloat16)

    def fwd():
        with torch.no_grad():
            winnow.screening_attention(q, k, v, s_w, s_r, expand_windows_above=expand)

    def fwd_bwd():
        out = winnow.screening_attention(q, k, v, s_w, s_r, expand_windows_above=expand)
        torch.autograd.grad(out, (q, k, v, s_w, s_r), dout)

    return median_ms(fwd), median_ms(fwd_bwd)


def profile_screening(B, L, H, dk, dv, windows, device):
    """Per-kernel CUDA time of one screening forward+backward (torch.profiler), printed."""
    q, k, v, s_w, s_r, expand = screening_inputs(B, L, H, dk, dv, windows, device, True)
    dout = torch.randn(B, L, H, dv, device=device, dtype=torch.bfloat16)

    def step():
        out = winnow.screening_attention(q, k, v, s_w, s_r, expand_windows_above=expand)
        torch.autograd.grad(out, (q, k, v, s_w, s_r), dout)

    step()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    print(f"\nkernels of one forward+backward, L={L}, windows {windows}:")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14))


def time_sdpa(backend, B, L, H, D, device):
    g = torch.Generator(device="cpu").manual_seed(1)
    q, k, v = (torch.randn(B, L, H, D, generator=g).to(device=device, dtype=torch.bfloat16).requires_grad_()
               for _ in range(3))
    dout = torch.randn(B, L, H, D, device=device, dtype=torch.bfloat16)
    run = sdpa(backend)

    def fwd():
        with torch.no_grad():
            run(q, k, v)

    def fwd_bwd():
        out = run(q, k, v)
        torch.autograd.grad(out, (q, k, v), dout)

    return median_ms(fwd), median_ms(fwd_bwd)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="4096,16384")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dk", type=int, default=16)
    parser.add_argument("--dv", type=int, default=64)
    parser.add_argument("--windows", default="init,infinite")
    parser.add_argument("--profile", action="store_true", help="per-kernel times of screening at the last length")
    parser.add_argument("--json")
    args = parser.parse_args()
    device = "cuda"
    B, H = args.batch, args.heads
    rows = []
    for L in (int(x) for x in args.lengths.split(",")):
        flops = 4 * B * H * L * L * args.dv / 2
        base = {}
        for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
            try:
                f, fb = time_sdpa(backend, B, L, H, args.dv, device)
            except RuntimeError as e:  # a back end that does not take these shapes
                print(f"{name} L={L}: unavailable ({str(e).splitlines()[0]})")
                continue
            base[name] = (f, fb)
            rows.append({"method": name, "L": L, "windows": "-", "fwd_ms": f, "fwd_bwd_ms": fb,
                         "fwd_tflops": flops / f / 1e9, "fwd_bwd_tflops": 3.5 * flops / fb / 1e9})
        for windows in args.windows.split(","):
            f, fb = time_screening(B, L, H, args.dk, args.dv, windows, device)
            row = {"method": "winnow_screening", "L": L, "windows": windows, "fwd_ms": f, "fwd_bwd_ms": fb}
            if "sdpa_flash" in base:
                row["fwd_vs_flash"] = base["sdpa_flash"][0] / f
                row["fwd_bwd_vs_flash"] = base["sdpa_flash"][1] / fb
            rows.append(row)
    print(f"\nscreening vs SDPA, bf16, B={B}, H={H}, screening d_K={args.dk} d_V={args.dv}, SDPA D={args.dv}, "
          f"{torch.cuda.get_device_name()}")
    print(f"{'method':<18}{'L':>7}{'windows':>10}{'fwd ms':>10}{'f+b ms':>10}{'fwd TF/s':>10}{'f+b TF/s':>10}"
          f"{'fwd vs flash':>14}{'f+b vs flash':>14}")
    for r in rows:
        print(f"{r['method']:<18}{r['L']:>7}{r['windows']:>10}{r['fwd_ms']:>10.3f}{r['fwd_bwd_ms']:>10.3f}"
              f"{r.get('fwd_tflops', float('nan')):>10.1f}{r.get('fwd_bwd_tflops', float('nan')):>10.1f}"
              f"{r.get('fwd_vs_flash', float('nan')):>14.2f}{r.get('fwd_bwd_vs_flash', float('nan')):>14.2f}")
    if args.profile:
        for windows in args.windows.split(","):
            profile_screening(B, L, H, args.dk, args.dv, windows, device)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "batch": B, "heads": H, "dk": args.dk, "dv": args.dv, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
