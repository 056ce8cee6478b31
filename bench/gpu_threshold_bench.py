"""Threshold attention (TRA, TDA) on the GPU: winnow's kernels beside torch SDPA (FlashAttention-2
and cuDNN back ends), winnow's softmax and, when importable, 004's public Triton kernels
(snap-research/TDA's triton_threshold_attention.py, on PYTHONPATH, e.g. copied into .baselines/;
the GPU machine has no network) on the same inputs in the same run.

winnow_*_screen rows run the forward with the int8 screen (WINNOW_THRESHOLD_SCREEN=1); their
"b1 speedup" is against the default (unscreened) forward at beta 0.

Shapes (issue 14): bf16, D = 128, H = 12, B * L = 16384 tokens, L in {4096, 16384}, causal,
q, k, v (and TDA's q2, k2) ~ N(0, 1). beta = 0 keeps about half the weights (no key tile can be
skipped); beta = 1 keeps well under 1% (the zero fraction is measured on the same inputs and
printed). Times are medians of CUDA-event timings after warm-up. TFLOP/s use softmax's causal
count for every method (4 B H L^2 D / 2 forward, 2.5x backward, 3.5x forward+backward), so
they compare times: TDA's extra score products are not credited. The paper's TDA is its own
composition (normalize, two TRA calls, out1 - lambda out2), run as published.
Writes JSON (--json) and prints a table.
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import winnow  # noqa: E402
from gpu_attention_bench import median_ms, sdpa  # noqa: E402

from torch.nn.attention import SDPBackend  # noqa: E402


def zero_fraction(q, k, beta, q2=None, k2=None, rows=1024):
    """Exact zeros of the combined weights over the visible (query, key) pairs of the first
    sequence, every head: a key counts as nonzero when it clears the threshold in some view."""
    L, H, D = q.shape[1], q.shape[2], q.shape[3]
    views = [(q, k)] + ([(q2, k2)] if q2 is not None else [])
    hats = [(F.normalize(a[0].float(), dim=-1), F.normalize(b[0].float(), dim=-1)) for a, b in views]
    kept = 0
    for h in range(H):
        for r0 in range(0, L, rows):
            r = torch.arange(r0, min(L, r0 + rows), device=q.device)
            n = (r + 1).float()
            tau = beta * torch.sqrt(2 * torch.log(n) / D)
            visible = torch.arange(L, device=q.device)[None, :] <= r[:, None]
            alive = torch.zeros(len(r), L, dtype=torch.bool, device=q.device)
            for qh, kh in hats:
                alive |= (qh[r, h] @ kh[:, h].T) > tau[:, None]
            kept += (alive & visible).sum().item()
    total = H * L * (L + 1) / 2
    return 1.0 - kept / total


def screened(fn):
    def run(*args):
        os.environ["WINNOW_THRESHOLD_SCREEN"] = "1"
        try:
            return fn(*args)
        finally:
            del os.environ["WINNOW_THRESHOLD_SCREEN"]
    return run


def methods():
    """name -> fn(q, k, v, q2, k2, beta_scale, lam), inputs in (B, L, H, D)."""
    def qkv_only(fn):
        return lambda q, k, v, *rest: fn(q, k, v)
    m = {
        "sdpa_flash": qkv_only(sdpa(SDPBackend.FLASH_ATTENTION)),
        "sdpa_cudnn": qkv_only(sdpa(SDPBackend.CUDNN_ATTENTION)),
        "winnow_softmax": qkv_only(winnow.softmax_attention),
    }
    for beta in (0.0, 1.0):
        tag = "" if beta == 0 else "_beta1"
        m["winnow_tra" + tag] = (lambda beta: lambda q, k, v, q2, k2, b, lam:
                                 winnow.threshold_attention(q, k, v, b * beta))(beta)
        m["winnow_tda" + tag] = (lambda beta: lambda q, k, v, q2, k2, b, lam:
                                 winnow.threshold_attention(q, k, v, b * beta, lam=lam, q2=q2, k2=k2))(beta)
        # The int8 screen's forward (WINNOW_THRESHOLD_SCREEN, opt-in); its backward is the same.
        for kind in ("tra", "tda"):
            m[f"winnow_{kind}{tag}_screen"] = screened(m[f"winnow_{kind}{tag}"])
    try:
        from triton_threshold_attention import differential_threshold_rela_triton, threshold_rela_triton

        def bhld(t):
            return t.transpose(1, 2)

        for beta in (0.0, 1.0):
            tag = "" if beta == 0 else "_beta1"

            def tra(q, k, v, q2, k2, b, lam, beta=beta):
                out = threshold_rela_triton(F.normalize(bhld(q), dim=-1), F.normalize(bhld(k), dim=-1),
                                            bhld(v), b[0] * beta, 2.0)
                return out.transpose(1, 2)

            def tda(q, k, v, q2, k2, b, lam, beta=beta):
                out = differential_threshold_rela_triton(bhld(q), bhld(q2), bhld(k), bhld(k2), bhld(v),
                                                         b[0] * beta, lam[0], 2.0)
                return out.transpose(1, 2)
            m["paper_triton_tra" + tag] = tra
            m["paper_triton_tda" + tag] = tda
    except Exception as e:  # noqa: BLE001
        print(f"# 004's Triton kernels not available: {type(e).__name__}: {e}")
    return m


STEADY_CALLS = 10  # back-to-back calls per timing of fwd_steady_ms


def measure(fn, leaves, extra, flops_fwd, grads=True):
    row = {}
    try:
        run = lambda: fn(*leaves[:3], leaves[3], leaves[4], *extra)  # noqa: E731
        row["fwd_ms"] = median_ms(run)
        row["fwd_tflops"] = flops_fwd / row["fwd_ms"] / 1e9
        # fwd_ms times each call from an idle GPU, so the host's dispatch until the first kernel
        # and any gap where the host falls behind count; back to back, as in a model whose host
        # runs ahead, they hide behind the calls before (a multi-kernel forward such as the
        # screened one loses 0.1-0.15 ms a call to them at 16K, H200, 2026-12-02).
        row["fwd_steady_ms"] = median_ms(run, inner=STEADY_CALLS)
        if grads:
            out = run()
            grad = torch.randn_like(out)
            inputs = [t for t in leaves + list(extra) if t.requires_grad]
            row["bwd_ms"] = median_ms(lambda: torch.autograd.grad(out, inputs, grad, retain_graph=True,
                                                                  allow_unused=True))
            row["fwd_bwd_ms"] = median_ms(lambda: torch.autograd.grad(run(), inputs, grad, allow_unused=True))
            row["bwd_tflops"] = 2.5 * flops_fwd / row["bwd_ms"] / 1e9
            row["fwd_bwd_tflops"] = 3.5 * flops_fwd / row["fwd_bwd_ms"] / 1e9
    except Exception as e:  # noqa: BLE001
        row["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--methods", nargs="+", default=None, help="only these methods (sdpa_flash always)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    print(f"# {props.name}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    results, zeros = [], []
    D, H = args.dim, args.heads
    for L in args.lengths:
        B = max(1, args.tokens // L)
        leaves = [torch.randn(B, L, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                  for _ in range(5)]  # q, k, v, q2, k2
        extra = (torch.ones(1, device="cuda", requires_grad=True),        # beta scale (x 0 or 1)
                 torch.full((1,), 0.5, device="cuda", requires_grad=True))  # lambda
        for beta in (0.0, 1.0):
            z = {"L": L, "beta": beta,
                 "tra_zero_fraction": zero_fraction(leaves[0], leaves[1], beta),
                 "tda_zero_fraction": zero_fraction(leaves[0], leaves[1], beta, leaves[3], leaves[4])}
            zeros.append(z)
            print(f"# L {L} beta {beta}: exact zeros TRA {z['tra_zero_fraction']:.5f}, "
                  f"TDA {z['tda_zero_fraction']:.5f}", flush=True)
        flops = 4 * B * H * L * L * D / 2
        rows = {}
        for name, fn in methods().items():
            if args.methods and name != "sdpa_flash" and name not in args.methods:
                continue
            row = measure(fn, leaves, extra, flops)
            row.update({"method": name, "B": B, "L": L, "H": H, "D": D})
            rows[name] = row
            results.append(row)
            print(f"# {L} {name}: " + ", ".join(
                f"{k} {row[k]:.2f}" if isinstance(row[k], float) else f"{k} {row[k]}"
                for k in ("fwd_ms", "fwd_tflops", "fwd_bwd_ms", "error") if k in row), flush=True)
        base = rows.get("sdpa_flash", {})
        for row in rows.values():
            for mode in ("fwd", "bwd", "fwd_bwd"):
                if f"{mode}_ms" in row and f"{mode}_ms" in base:
                    row[f"{mode}_time_vs_flash"] = row[f"{mode}_ms"] / base[f"{mode}_ms"]
        for kind, kind1 in (("winnow_tra", "winnow_tra_beta1"), ("winnow_tda", "winnow_tda_beta1"),
                            ("winnow_tra", "winnow_tra_beta1_screen"), ("winnow_tda", "winnow_tda_beta1_screen"),
                            ("paper_triton_tra", "paper_triton_tra_beta1"),
                            ("paper_triton_tda", "paper_triton_tda_beta1")):
            a, b = rows.get(kind, {}), rows.get(kind1, {})
            if "fwd_ms" in a and "fwd_ms" in b:
                b["fwd_speedup_over_beta0"] = a["fwd_ms"] / b["fwd_ms"]
            if "fwd_steady_ms" in a and "fwd_steady_ms" in b:
                b["fwd_steady_speedup_over_beta0"] = a["fwd_steady_ms"] / b["fwd_steady_ms"]
        torch.cuda.empty_cache()
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": props.name, "torch": torch.__version__, "results": results,
                           "zero_fractions": zeros}, f, indent=2)

    nan = float("nan")
    print(f"{'L':>6} {'method':<24} {'fwd ms':>8} {'fwd TF/s':>9} {'t/flash':>8} {'f+b ms':>8} "
          f"{'f+b TF/s':>9} {'t/flash':>8} {'b1 speedup':>10} {'steady ms':>9} {'steady b1':>9}")
    for r in results:
        if "error" in r:
            print(f"{r['L']:>6} {r['method']:<24} error: {r['error'][:70]}")
            continue
        print(f"{r['L']:>6} {r['method']:<24} {r['fwd_ms']:8.2f} {r['fwd_tflops']:9.1f} "
              f"{r.get('fwd_time_vs_flash', nan):8.2f} {r.get('fwd_bwd_ms', nan):8.2f} "
              f"{r.get('fwd_bwd_tflops', nan):9.1f} {r.get('fwd_bwd_time_vs_flash', nan):8.2f} "
              f"{r.get('fwd_speedup_over_beta0', nan):10.2f} {r.get('fwd_steady_ms', nan):9.3f} "
              f"{r.get('fwd_steady_speedup_over_beta0', nan):9.2f}")


if __name__ == "__main__":
    main()
