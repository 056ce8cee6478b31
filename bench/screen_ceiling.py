"""How fast can any exact beta = 1 threshold forward be? Issue 14 asks TRA's and TDA's forward at
beta = 1 to be 3x faster than at beta = 0. An exact forward must still test every visible score
against its row's tau, so it computes every score at some precision; int8 (the H100's and
H200's fastest matrix type beside fp8, whose 3 mantissa bits bound a score too loosely to
certify it at tau) is the cheapest. This bench measures, on the GPU, the smallest screen that
can be exact, written in Triton and tuned by it:

    for each block of query rows, over the causal key tiles: S = Q8 K8^T (int32),
    row_hits += max_i(S_ji) > thr_j

one product and one comparison per score, nothing listed, nothing written but one count per
row. It is optimistic: a real screen also needs a bound that depends on the key, and lists
its candidates. The same kernel in bf16 (fp32 scores) is the product the unscreened forward
computes at beta = 1. Beside them: the matrix rate of a large int8 and bf16 product
(torch._int_mm and torch.mm, 8192^3), the practical ceilings on this machine.

With --bench-json (bench/gpu_threshold_bench.py's JSON from the same machine) it prints what
issue 14's bar leaves: the beta = 1 forward's time budget (a third of the beta = 0 forward's)
against the screen's measured time.

--fixed BLOCK_M BLOCK_N WARPS runs one int8 configuration three times and nothing else, for a
profiler (tools/ncu_summary.sh NAME _screen_kernel -- python3 bench/screen_ceiling.py --lengths
16384 --fixed 128 128 8).

Shapes as the threshold bench: D = 128, 12 heads, B * L = 16384, L in {4096, 16384}; TDA
screens two views, so twice the screen's time. Writes JSON (--json) and prints a table.
"""

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_attention_bench import median_ms  # noqa: E402

# NVIDIA's listed dense peaks for the H100 / H200 SXM (the same chip): int8 1979 TOPS, bf16
# 989 TFLOP/s. Measured rates are printed beside them.
PEAK_INT8_TOPS = 1979.0
PEAK_BF16_TFLOPS = 989.0


# (BLOCK_M, BLOCK_N, warps): one accumulator of at most 128 int32 or fp32 a thread.
TILES = ((64, 64, 4), (64, 128, 4), (128, 64, 4), (128, 64, 8), (128, 128, 8), (128, 256, 8))


@triton.jit
def _screen_kernel(Q, K, THR, HITS, L, H, stride_b, stride_l, stride_h,
                   D: tl.constexpr, IS_INT8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # Heaviest query blocks first, so that the causal triangle's long rows do not run last.
    m_block = tl.cdiv(L, BLOCK_M) - 1 - tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    base = b * stride_b + h * stride_h
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    feats = tl.arange(0, D)
    q = tl.load(Q + base + rows[:, None] * stride_l + feats[None, :], mask=rows[:, None] < L, other=0)
    thr = tl.load(THR + bh * L + rows, mask=rows < L, other=0)
    hits = tl.zeros([BLOCK_M], dtype=tl.int32)
    row_start = m_block * BLOCK_M
    # Key tiles wholly below the diagonal need no mask (BLOCK_N divides BLOCK_M or the reverse;
    # when BLOCK_N > BLOCK_M the first tile that reaches the block's rows is masked).
    unmasked_end = (row_start // BLOCK_N) * BLOCK_N
    for start in range(0, unmasked_end, BLOCK_N):
        k = tl.load(K + base + (start + cols)[:, None] * stride_l + feats[None, :])
        if IS_INT8:
            s = tl.dot(q, tl.trans(k), out_dtype=tl.int32)
        else:
            s = tl.dot(q, tl.trans(k))
        hits += (tl.max(s, axis=1) > thr).to(tl.int32)
    row_end = tl.minimum(row_start + BLOCK_M, L)
    for start in range(unmasked_end, row_end, BLOCK_N):
        keys = start + cols
        k = tl.load(K + base + keys[:, None] * stride_l + feats[None, :], mask=keys[:, None] < L, other=0)
        if IS_INT8:
            s = tl.dot(q, tl.trans(k), out_dtype=tl.int32)
            s = tl.where(keys[None, :] <= rows[:, None], s, -2147483647)
        else:
            s = tl.dot(q, tl.trans(k))
            s = tl.where(keys[None, :] <= rows[:, None], s, float("-inf"))
        hits += (tl.max(s, axis=1) > thr).to(tl.int32)
    tl.store(HITS + bh * L + rows, hits, mask=rows < L)


_screen_tuned = triton.autotune(
    configs=[triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)
             for bm, bn, w in TILES for st in (3, 4)],
    key=["L", "IS_INT8"])(_screen_kernel)


_last_compiled = [None]  # the tuned kernel's last launch, for its registers and shared memory


def kernel_resources():
    """Registers, spills and shared memory of the tuned kernel last launched (Triton's compiled
    kernel; None where this Triton does not say)."""
    try:
        c = _last_compiled[0]
        return {"registers": c.n_regs, "spills": c.n_spills, "shared_bytes": c.metadata.shared}
    except Exception:  # noqa: BLE001
        return None


def screen(q, k, thr, tile=None):
    """q, k: (B, L, H, D) int8 or bf16, the same strides; thr: (B * H, L) int32 or float32.
    Returns (B * H, L) int32: per row, the number of key tiles with a score above thr. With
    tile = (BLOCK_M, BLOCK_N, warps) that configuration, else the tuned one."""
    B, L, H, D = q.shape
    hits = torch.empty(B * H, L, dtype=torch.int32, device=q.device)
    args = (q, k, thr, hits, L, H, q.stride(0), q.stride(1), q.stride(2))
    if tile is None:
        grid = lambda meta: (triton.cdiv(L, meta["BLOCK_M"]), B * H)  # noqa: E731
        compiled = _screen_tuned[grid](*args, D=D, IS_INT8=q.dtype == torch.int8)
        _last_compiled[0] = compiled
    else:
        bm, bn, w = tile
        _screen_kernel[(triton.cdiv(L, bm), B * H)](*args, D=D, IS_INT8=q.dtype == torch.int8,
                                                   BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=3)
    return hits


def reference_rows_hit(q, k, thr, heads=None):
    """Per row of the first `heads` (batch, head) pairs (all by default): whether some visible
    score clears thr (the kernel counts tiles; > 0 agrees)."""
    B, L, H, D = q.shape
    pairs = [(b, h) for b in range(B) for h in range(H)][:heads]
    out = torch.zeros(len(pairs), L, dtype=torch.bool, device=q.device)
    visible = torch.tril(torch.ones(L, L, dtype=torch.bool, device=q.device))
    for i, (b, h) in enumerate(pairs):
        s = q[b, :, h].double() @ k[b, :, h].double().T  # int8 products are exact in float64
        s = torch.where(visible, s, torch.tensor(float("-inf"), device=q.device, dtype=s.dtype))
        out[i] = s.max(dim=1).values > thr[b * H + h].double()
    return out


def compare(got, want, dtype, what):
    """Exact for int8; bf16's fp32 sums may round to the other side of thr on a few rows."""
    bad = (got != want).sum().item()
    limit = 0 if dtype == torch.int8 else max(2, want.numel() // 2000)
    print(f"# check {what}: {want.sum().item()} of {want.numel()} rows hit, {bad} differ (allowed {limit})")
    if bad > limit:
        raise SystemExit(f"screen_ceiling: the Triton screen disagrees with float64 on {bad} rows ({what})")


def quantized_inputs(B, L, H, D, dtype, gen):
    """Unit-normalized N(0, 1) rows (cosine scores, as TRA's), int8 by one scale per tensor or
    bf16; the threshold is beta = 1's tau in the scores' units."""
    q = torch.nn.functional.normalize(torch.randn(B, L, H, D, device="cuda", generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, L, H, D, device="cuda", generator=gen), dim=-1)
    n = torch.arange(1, L + 1, device="cuda", dtype=torch.float32)
    tau = torch.sqrt(2 * torch.log(n) / D).repeat(B * H, 1)
    if dtype == torch.int8:
        sq, sk = 127 / q.abs().max(), 127 / k.abs().max()
        q8 = torch.round(q * sq).to(torch.int8)
        k8 = torch.round(k * sk).to(torch.int8)
        return q8, k8, torch.floor(tau * sq * sk).to(torch.int32)
    return q.to(dtype), k.to(dtype), tau


def check(gen):
    """Every tile configuration against float64 on awkward shapes, int8 and bf16, with a
    threshold that some rows clear and some do not (0.7 tau)."""
    for dtype in (torch.int8, torch.bfloat16):
        for B, L, H in ((1, 1000, 2), (2, 333, 1)):
            q, k, thr = quantized_inputs(B, L, H, 128, dtype, gen)
            thr = (thr * 0.7).to(thr.dtype)
            want = reference_rows_hit(q, k, thr)
            for tile in TILES:
                compare(screen(q, k, thr, tile) > 0, want, dtype, f"{str(dtype):15s} B={B} L={L} H={H} tile {tile}")


def row_name(dtype):
    return str(dtype).replace("torch.", "")


def matrix_rates():
    n = 8192
    a8 = torch.randint(-127, 128, (n, n), dtype=torch.int8, device="cuda")
    b8 = torch.randint(-127, 128, (n, n), dtype=torch.int8, device="cuda")
    a16 = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b16 = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    ops = 2 * n ** 3
    int8_ms = median_ms(lambda: torch._int_mm(a8, b8))
    bf16_ms = median_ms(lambda: torch.mm(a16, b16))
    big = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    copy_ms = median_ms(lambda: big.clone())
    return {"int8_mm_tops": ops / int8_ms / 1e9, "bf16_mm_tflops": ops / bf16_ms / 1e9,
            "copy_tb_per_s": 2 * big.numel() / copy_ms / 1e9}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=16384, help="B * L")
    ap.add_argument("--json")
    ap.add_argument("--bench-json", help="bench/gpu_threshold_bench.py's JSON from the same machine")
    ap.add_argument("--from-json", help="this script's JSON: print the bar's budget from it, measure nothing")
    ap.add_argument("--fixed", type=int, nargs=3, metavar=("BLOCK_M", "BLOCK_N", "WARPS"),
                    help="only run that int8 configuration (3 stages) three times at the first length, "
                         "untuned and unchecked: for a profiler")
    args = ap.parse_args()
    if args.fixed:
        L = args.lengths[0]
        q, k, thr = quantized_inputs(args.tokens // L, L, args.heads, 128, torch.int8,
                                     torch.Generator(device="cuda").manual_seed(14))
        for _ in range(3):
            screen(q, k, thr, tuple(args.fixed))
        torch.cuda.synchronize()
        return
    if args.from_json:
        with open(args.from_json) as f:
            result = json.load(f)
        with open(args.bench_json) as f:
            result["bar"] = bar_budget(json.load(f), result["screens"], result["matrix_rates"])
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        return
    gen = torch.Generator(device="cuda").manual_seed(14)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    check(gen)
    rates = matrix_rates()
    print(f"# 8192^3 products: int8 {rates['int8_mm_tops']:.0f} TOPS ({rates['int8_mm_tops'] / PEAK_INT8_TOPS:.0%} "
          f"of {PEAK_INT8_TOPS:.0f}), bf16 {rates['bf16_mm_tflops']:.0f} TFLOP/s "
          f"({rates['bf16_mm_tflops'] / PEAK_BF16_TFLOPS:.0%} of {PEAK_BF16_TFLOPS:.0f}); a device copy "
          f"{rates['copy_tb_per_s']:.2f} TB/s (read + written)")
    rows = []
    for L in args.lengths:
        B, H, D = args.tokens // L, args.heads, 128
        ops = 2 * B * H * L * L * D / 2  # the causal score product, the spec's convention
        for dtype, peak in ((torch.int8, PEAK_INT8_TOPS), (torch.bfloat16, PEAK_BF16_TFLOPS)):
            q, k, thr = quantized_inputs(B, L, H, D, dtype, gen)
            ms = median_ms(lambda: screen(q, k, thr), repeat=30)
            best = _screen_tuned.best_config
            # The tuned configuration on these shapes, its first two heads against float64.
            low = (thr * 0.7).to(thr.dtype)
            compare(screen(q, k, low)[:2] > 0, reference_rows_hit(q, k, low, heads=2), dtype,
                    f"{row_name(dtype)} L={L}, tuned")
            row = {"L": L, "B": B, "H": H, "D": D, "dtype": row_name(dtype), "ms": ms,
                   "tops": ops / ms / 1e9, "of_peak": ops / ms / 1e9 / peak,
                   "floor_ms": ops / peak / 1e9, "config": str(best), "resources": kernel_resources()}
            rows.append(row)
            print(f"  L {L:6d} {row['dtype']:9s} {ms:7.3f} ms {row['tops']:7.0f} TOPS  {row['of_peak']:5.1%} of peak "
                  f"(peak's time {row['floor_ms']:.3f} ms)  [{best}] {row['resources']}")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "matrix_rates": rates, "screens": rows}
    if args.bench_json:
        with open(args.bench_json) as f:
            bench = json.load(f)
        result["bar"] = bar_budget(bench, rows, rates)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


def bar_budget(bench, rows, rates):
    """Issue 14's bar in time: the beta = 1 forward within a third of the beta = 0 forward. Prints
    that budget beside the measured minimal screen (TRA one view, TDA two), and the int8 rate a
    screen would need in what is left of the budget after the memory traffic no forward avoids:
    reading q and k (each view, 16 bits), writing them in int8 for the screen and writing the
    output (16 bits), at this machine's copy rate; the host's share of the bench's time, the
    candidates and everything else counted as nothing."""
    out = []
    print("# issue 14's bar: beta = 1 forward <= beta = 0 forward / 3 (bench ms, forward)")
    fwd = {(r["L"], r["method"]): r.get("fwd_ms") for r in bench["results"]}
    for L in sorted({r["L"] for r in rows}):
        screen_int8 = next(r for r in rows if r["L"] == L and r["dtype"] == "int8")
        B, H, D = screen_int8["B"], screen_int8["H"], screen_int8["D"]
        for kind, views in (("tra", 1), ("tda", 2)):
            beta0 = fwd.get((L, f"winnow_{kind}"))
            if beta0 is None:
                continue
            beta1 = {name: fwd.get((L, f"winnow_{kind}_beta1{tag}"))
                     for name, tag in (("default", ""), ("screened", "_screen"))}
            budget = beta0 / 3
            screen_ms = views * screen_int8["ms"]
            ops = views * 2 * B * H * L * L * D / 2
            memory_ms = (views * 2 * (2 + 1) + 2) * B * L * H * D / rates["copy_tb_per_s"] / 1e9
            left = budget - memory_ms
            need = ops / left / 1e9 if left > 0 else float("inf")
            row = {"L": L, "kind": kind, "beta0_fwd_ms": beta0, "budget_ms": budget, "beta1_fwd_ms": beta1,
                   "minimal_screen_ms": screen_ms, "memory_floor_ms": memory_ms,
                   "screen_tops_needed": need, "screen_share_of_peak_needed": need / PEAK_INT8_TOPS,
                   "minimal_screen_fwd_ms": screen_ms + memory_ms,
                   "minimal_screen_speedup": beta0 / (screen_ms + memory_ms)}
            out.append(row)
            b1 = ", ".join(f"{k} {v:.3f}" for k, v in beta1.items() if v is not None)
            print(f"  L {L:6d} {kind.upper()}: beta 0 {beta0:.3f} ms, budget {budget:.3f} ms; beta 1 now {b1}. "
                  f"Memory floor {memory_ms:.3f} ms leaves the screen {left:.3f} ms: {need:.0f} TOPS "
                  f"({need / PEAK_INT8_TOPS:.0%} of peak); the minimal screen takes {screen_ms:.3f} ms, "
                  f"so with the floor {screen_ms + memory_ms:.3f} ms, {beta0 / (screen_ms + memory_ms):.2f}x beta 0")
    return out

if __name__ == "__main__":
    main()
