"""Gated Sparse Attention (seed 003, issue 16) on the GPU: winnow's indexer with exact top-k
selection and its sparse attention beside torch SDPA's dense back ends (FlashAttention-2 and
cuDNN) on the same q, k, v, in one run.

Prefill (issue 16's shape): bf16, B = 1, 16 query heads over 4 kv heads, D = 128, causal;
indexer H_I = 4 heads of d_I = 64 over one key head, GSA's sigmoid form, a fixed budget
k (2048 by default), inputs ~ N(0, 1). Rows are timed separately (selection alone, sparse
attention alone on the selection's lists, both together) and against the faster SDPA back end.
SDPA gets the kv heads expanded to 16 (enable_gqa where the back end takes it). Times are medians
of CUDA-event timings after warm-up; TFLOP/s of the sparse attention count its own products,
4 H sum_t min(k, t + 1) D.

--full-lists adds L = 4096 with k = 4096 (every list holds every visible key: nothing to skip).
Random inputs make each row's selection independent of its neighbours': every row gathers its
own k keys, which is the sparse attention's worst case for memory traffic.
Writes JSON (--json) and prints a table.
"""

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import winnow  # noqa: E402
from gpu_attention_bench import median_ms  # noqa: E402


def dense(backend, q, k, v):
    group = q.shape[2] // k.shape[2]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    try:
        with sdpa_kernel([backend]):
            fn = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)  # noqa: E731
            fn()
        label = "gqa"
    except RuntimeError:
        ke, ve = kt.repeat_interleave(group, 1), vt.repeat_interleave(group, 1)
        fn = lambda: F.scaled_dot_product_attention(qt, ke, ve, is_causal=True)  # noqa: E731
        label = "expanded"

    def run():
        with sdpa_kernel([backend]):
            return fn()
    return run, label


def case(L, k_sel, args):
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    B, H, HKV, D, HI, DI = 1, args.heads, args.kv_heads, 128, 4, 64
    q = torch.randn(B, L, H, D, device=dev, dtype=dt)
    k = torch.randn(B, L, HKV, D, device=dev, dtype=dt)
    v = torch.randn(B, L, HKV, D, device=dev, dtype=dt)
    iq = torch.randn(B, L, HI, DI, device=dev, dtype=dt)
    ik = torch.randn(B, L, 1, DI, device=dev, dtype=dt)
    w = torch.randn(B, L, HI, device=dev, dtype=dt)
    bias = torch.zeros(HI, device=dev, dtype=torch.float32)

    def select():
        return winnow.gsa_select_keys(iq, ik, w, bias, k_max=k_sel, budget="fixed", k_fixed=k_sel)

    indices, counts, _ = select()
    torch.cuda.synchronize()

    def sparse():
        return winnow.gsa_sparse_attention(q, k, v, indices, counts, trusted=True)

    def both():
        i, c, _ = select()
        return winnow.gsa_sparse_attention(q, k, v, i, c, trusted=True)

    row = {"L": L, "k": k_sel, "heads": H, "kv_heads": HKV, "D": D}
    row["select_ms"] = median_ms(select)
    row["sparse_ms"] = median_ms(sparse)
    row["gsa_ms"] = median_ms(both)
    pairs = sum(min(k_sel, t + 1) for t in range(L))
    row["sparse_tflops"] = 4 * B * H * pairs * D / row["sparse_ms"] / 1e9
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            fn, label = dense(backend, q, k, v)
            row[f"sdpa_{name}_ms"] = median_ms(fn)
            row[f"sdpa_{name}_layout"] = label
        except RuntimeError as e:
            row[f"sdpa_{name}_ms"] = None
            row[f"sdpa_{name}_error"] = str(e).splitlines()[0][:200]
    dense_times = [row[f"sdpa_{n}_ms"] for n in ("flash", "cudnn") if row.get(f"sdpa_{n}_ms")]
    row["fastest_dense_ms"] = min(dense_times) if dense_times else None
    if row["fastest_dense_ms"]:
        row["gsa_speedup_vs_fastest_dense"] = row["fastest_dense_ms"] / row["gsa_ms"]
    if row.get("sdpa_flash_ms"):
        row["sparse_vs_flash"] = row["sparse_ms"] / row["sdpa_flash_ms"]
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768, 65536, 131072])
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--full-lists", action="store_true", help="add L = 4096 with k = 4096")
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    shapes = [(L, args.k) for L in args.lengths] + ([(4096, 4096)] if args.full_lists else [])
    for L, k_sel in shapes:
        row = case(L, k_sel, args)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print()
    print(f"{'L':>7} {'k':>5} {'select ms':>10} {'sparse ms':>10} {'GSA ms':>9} {'flash ms':>9} "
          f"{'cudnn ms':>9} {'dense/GSA':>9} {'sparse/flash':>12}")
    for r in rows:
        def f(x, fmt="{:9.2f}"):
            return fmt.format(x) if x is not None else "-".rjust(9)
        print(f"{r['L']:>7} {r['k']:>5} {f(r['select_ms'], '{:10.2f}')} {f(r['sparse_ms'], '{:10.2f}')} "
              f"{f(r['gsa_ms'])} {f(r.get('sdpa_flash_ms'))} {f(r.get('sdpa_cudnn_ms'))} "
              f"{f(r.get('gsa_speedup_vs_fastest_dense'))} {f(r.get('sparse_vs_flash'), '{:12.2f}')}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
