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
--decode adds one decoding step at each length (a new token's query over a cache of L keys,
batch --decode-batch): the indexer over the cache, the selection of k keys and the sparse
attention of the one query, against SDPA's flash back end and winnow's softmax paged_decode on
the same cache.
--backward adds the sparse attention's forward + backward on the selection's lists (and SDPA's
forward + backward on the same q, k, v) at each length.
--indexer-loss adds the indexer's training loss (003 section 6) at the LM study's layer (B = 64,
L = 512, 8 heads of 64, H_I = 4 of d_I = 64, lists of k = 256 from the selection), forward and
backward: winnow.gsa_indexer_loss against the same KL written in PyTorch (float32, the whole
(B, H, L, L) weights at once), over the lists and dense.
Random inputs make each row's selection independent of its neighbours': every row gathers its
own k keys, which is the sparse attention's worst case for memory traffic. The "gather floor"
column measures that traffic alone: a Triton kernel that reads every listed K and V row of every
(query row, kv head), exactly the bytes any sparse attention over these lists must load, and
only sums them. No kernel on these lists can be faster than it; dense / floor is the most any
GSA prefill could gain over dense attention here, with a free selection.
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


try:  # Triton is only for the gather floor; the other rows run without it
    import triton
    import triton.language as tl

    @triton.jit
    def gather_kernel(K, V, IDX, CNT, OUT, k_max, kv_heads, D: tl.constexpr, CHUNK: tl.constexpr):
        row = tl.program_id(0)
        head = tl.program_id(1)
        count = tl.load(CNT + row)
        d = tl.arange(0, D)
        acc = tl.zeros([D], dtype=tl.float32)
        for start in range(0, count, CHUNK):
            slot = start + tl.arange(0, CHUNK)
            live = slot < count
            key = tl.load(IDX + row * k_max + slot, mask=live, other=0)
            at = (key[:, None] * kv_heads + head) * D + d[None, :]
            kk = tl.load(K + at, mask=live[:, None], other=0.0).to(tl.float32)
            vv = tl.load(V + at, mask=live[:, None], other=0.0).to(tl.float32)
            acc += tl.sum(kk + vv, axis=0)
        tl.store(OUT + (row * kv_heads + head) * D + d, acc)
except ImportError:
    gather_kernel = None


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


def gather_floor(k, v, indices, counts):
    """Milliseconds of reading every listed K and V row once per (query row, kv head), and None
    where Triton is missing. B = 1 only (the prefill rows)."""
    if gather_kernel is None:
        return None
    assert k.shape[0] == 1 and k.shape[-1] == v.shape[-1]
    L, kv_heads, D = k.shape[1], k.shape[2], k.shape[3]
    idx, cnt = indices[0].contiguous(), counts[0].contiguous()
    out = torch.empty(L, kv_heads, D, device=k.device, dtype=torch.float32)
    kc, vc = k[0].contiguous(), v[0].contiguous()

    def run():
        gather_kernel[(L, kv_heads)](kc, vc, idx, cnt, out, idx.shape[1], kv_heads, D=D, CHUNK=64)
    return median_ms(run)


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
    if args.backward:
        # Forward and backward of the sparse attention on the selection's lists, beside SDPA's.
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        dout = torch.randn_like(q)

        def sparse_fb():
            out = winnow.gsa_sparse_attention(qg, kg, vg, indices, counts, trusted=True)
            out.backward(dout)
        row["sparse_fb_ms"] = median_ms(sparse_fb)
        for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            try:
                fn, _ = dense(backend, qg, kg, vg)

                def dense_fb(fn=fn):
                    fn().backward(dout.transpose(1, 2))
                row[f"sdpa_{name}_fb_ms"] = median_ms(dense_fb)
            except RuntimeError as e:
                row[f"sdpa_{name}_fb_ms"] = None
                row[f"sdpa_{name}_fb_error"] = str(e).splitlines()[0][:200]
    row["select_ms"] = median_ms(select)
    row["sparse_ms"] = median_ms(sparse)
    row["gsa_ms"] = median_ms(both)
    pairs = sum(min(k_sel, t + 1) for t in range(L))
    row["sparse_tflops"] = 4 * B * H * pairs * D / row["sparse_ms"] / 1e9
    row["gather_floor_ms"] = gather_floor(k, v, indices, counts)
    row["gathered_gb"] = 2 * B * HKV * pairs * D * k.element_size() / 1e9
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
    if row["fastest_dense_ms"] and row["gather_floor_ms"]:
        row["dense_over_gather_floor"] = row["fastest_dense_ms"] / row["gather_floor_ms"]
    if row.get("sdpa_flash_ms"):
        row["sparse_vs_flash"] = row["sparse_ms"] / row["sdpa_flash_ms"]
    return row


def composed_indexer_loss(iq, ik, w, bias, q, k, allowed):
    """The indexer loss in PyTorch, float32: (B, L) per-row KL over `allowed` (B, L, L)."""
    f = [t.float() for t in (iq, ik, w, q, k)]
    iq, ik, w, q, k = f
    group = q.shape[2] // k.shape[2]
    logits = torch.einsum("blhd,bshd->bhls", q, k.repeat_interleave(group, 2)) / q.shape[-1] ** 0.5
    p = torch.softmax(logits.masked_fill(~allowed[:, None], float("-inf")), -1).nan_to_num(0).mean(1)
    dots = torch.einsum("bljd,bsd->bljs", iq, ik[:, :, 0]) / iq.shape[-1] ** 0.5
    scores = (torch.sigmoid(w)[..., None] * torch.sigmoid(dots + bias[None, None, :, None])).sum(2)
    log_q = torch.log_softmax(scores.masked_fill(~allowed, float("-inf")), -1)
    terms = torch.xlogy(p, p) - p * log_q.masked_fill(~allowed, 0)
    return terms.masked_fill(~allowed, 0).sum(-1)


def indexer_loss_rows():
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    B, L, H, D, HI, DI, K = 64, 512, 8, 64, 4, 64, 256
    q = torch.randn(B, L, H, D, device=dev, dtype=dt)
    k = torch.randn(B, L, H, D, device=dev, dtype=dt)
    iq = torch.randn(B, L, HI, DI, device=dev, dtype=dt, requires_grad=True)
    ik = torch.randn(B, L, 1, DI, device=dev, dtype=dt, requires_grad=True)
    w = torch.randn(B, L, HI, device=dev, dtype=dt, requires_grad=True)
    bias = torch.zeros(HI, device=dev, dtype=torch.float32, requires_grad=True)
    with torch.no_grad():
        indices, counts, _ = winnow.gsa_select_keys(iq, ik, w, bias, k_max=K, budget="fixed", k_fixed=K)
        slots = torch.arange(K, device=dev)
        allowed_lists = torch.zeros(B, L, L + 1, dtype=torch.bool, device=dev)
        allowed_lists.scatter_(2, torch.where(slots < counts[..., None], indices.long(), L), True)
        allowed_lists = allowed_lists[..., :L]
        pos = torch.arange(L, device=dev)
        causal = (pos[None, :] <= pos[:, None]).expand(B, L, L)
    rows = []
    for label, lists, allowed in (("lists of 256", (indices, counts), allowed_lists), ("dense", (), causal)):
        def ours():
            loss = winnow.gsa_indexer_loss(iq, ik, w, bias, q, k, *lists).mean()
            return torch.autograd.grad(loss, (iq, ik, w, bias))

        def composed():
            loss = composed_indexer_loss(iq, ik, w, bias, q, k, allowed).mean()
            return torch.autograd.grad(loss, (iq, ik, w, bias))
        a = winnow.gsa_indexer_loss(iq, ik, w, bias, q, k, *lists).mean().item()
        b = composed_indexer_loss(iq, ik, w, bias, q, k, allowed).mean().item()
        row = {"set": label, "B": B, "L": L, "heads": H, "D": D, "indexer_heads": HI, "d_I": DI,
               "winnow_ms": median_ms(ours), "composed_ms": median_ms(composed),
               "loss_winnow": a, "loss_composed": b}
        row["speedup"] = row["composed_ms"] / row["winnow_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def decode_row(L, k_sel, batch, args):
    """One decoding step at cache length L: GSA (select, then attend) against dense decoding."""
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    B, H, HKV, D, HI, DI = batch, args.heads, args.kv_heads, 128, 4, 64
    q = torch.randn(B, 1, H, D, device=dev, dtype=dt)
    k = torch.randn(B, L, HKV, D, device=dev, dtype=dt)
    v = torch.randn(B, L, HKV, D, device=dev, dtype=dt)
    iq = torch.randn(B, 1, HI, DI, device=dev, dtype=dt)
    ik = torch.randn(B, L, 1, DI, device=dev, dtype=dt)
    w = torch.randn(B, 1, HI, device=dev, dtype=dt)
    bias = torch.zeros(HI, device=dev, dtype=torch.float32)

    def select():
        return winnow.gsa_select_keys(iq, ik, w, bias, k_max=k_sel, budget="fixed", k_fixed=k_sel)

    def step():
        i, c, _ = select()
        return winnow.gsa_sparse_attention(q, k, v, i, c, trusted=True)

    row = {"L": L, "k": k_sel, "batch": B, "heads": H, "kv_heads": HKV, "D": D}
    row["select_ms"] = median_ms(select)
    row["gsa_step_ms"] = median_ms(step)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    try:
        def flash():
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
        row["sdpa_flash_ms"] = median_ms(flash)
    except RuntimeError as e:
        row["sdpa_flash_ms"], row["sdpa_flash_error"] = None, str(e).splitlines()[0][:200]
    # winnow's split-KV decoding over the same cache as pages of 256 rows.
    page = 256
    pages = (L + page - 1) // page
    kc = torch.zeros(B * pages * page, HKV, D, device=dev, dtype=dt)
    vc = torch.zeros_like(kc)
    kc.view(B, pages * page, HKV, D)[:, :L] = k
    vc.view(B, pages * page, HKV, D)[:, :L] = v
    kc, vc = kc.view(B * pages, page, HKV, D), vc.view(B * pages, page, HKV, D)
    table = torch.arange(B * pages, device=dev, dtype=torch.int32).view(B, pages)
    lens = torch.full((B,), L, device=dev, dtype=torch.int32)
    row["paged_decode_ms"] = median_ms(lambda: winnow.paged_decode(q, kc, vc, table, lens, trusted=True))
    dense = [row[n] for n in ("sdpa_flash_ms", "paged_decode_ms") if row.get(n)]
    row["fastest_dense_over_gsa"] = min(dense) / row["gsa_step_ms"]
    print(json.dumps(row), flush=True)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="*", default=[16384, 32768, 65536, 131072])
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--full-lists", action="store_true", help="add L = 4096 with k = 4096")
    ap.add_argument("--decode", action="store_true", help="add one decoding step at each length")
    ap.add_argument("--decode-batch", type=int, default=1)
    ap.add_argument("--indexer-loss", action="store_true",
                    help="add the indexer loss (forward + backward) at the LM study's layer")
    ap.add_argument("--backward", action="store_true",
                    help="also time the sparse attention's forward + backward (and SDPA's) at each length")
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    loss_rows = indexer_loss_rows() if args.indexer_loss else []
    decode_rows = [decode_row(L, args.k, args.decode_batch, args) for L in args.lengths] if args.decode else []
    shapes = [(L, args.k) for L in args.lengths] + ([(4096, 4096)] if args.full_lists else [])
    for L, k_sel in shapes:
        row = case(L, k_sel, args)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print()
    print(f"{'L':>7} {'k':>5} {'select ms':>10} {'sparse ms':>10} {'GSA ms':>9} {'flash ms':>9} "
          f"{'cudnn ms':>9} {'dense/GSA':>9} {'sparse/flash':>12} {'floor ms':>9} {'dense/floor':>11}")
    for r in rows:
        def f(x, fmt="{:9.2f}"):
            return fmt.format(x) if x is not None else "-".rjust(9)
        print(f"{r['L']:>7} {r['k']:>5} {f(r['select_ms'], '{:10.2f}')} {f(r['sparse_ms'], '{:10.2f}')} "
              f"{f(r['gsa_ms'])} {f(r.get('sdpa_flash_ms'))} {f(r.get('sdpa_cudnn_ms'))} "
              f"{f(r.get('gsa_speedup_vs_fastest_dense'))} {f(r.get('sparse_vs_flash'), '{:12.2f}')} "
              f"{f(r.get('gather_floor_ms'))} {f(r.get('dense_over_gather_floor'), '{:11.2f}')}")
    if args.backward:
        print()
        print(f"{'L':>7} {'sparse f+b ms':>14} {'flash f+b ms':>13} {'cudnn f+b ms':>13}")
        for r in rows:
            def f(x):
                return f"{x:13.2f}" if x is not None else "-".rjust(13)
            print(f"{r['L']:>7} {r['sparse_fb_ms']:14.2f} {f(r.get('sdpa_flash_fb_ms'))} {f(r.get('sdpa_cudnn_fb_ms'))}")
    if decode_rows:
        print()
        print(f"{'decode L':>9} {'batch':>5} {'select ms':>10} {'GSA step ms':>12} {'flash ms':>9} "
              f"{'paged ms':>9} {'dense/GSA':>9}")
        for r in decode_rows:
            flash = f"{r['sdpa_flash_ms']:9.3f}" if r.get("sdpa_flash_ms") else "-".rjust(9)
            print(f"{r['L']:>9} {r['batch']:>5} {r['select_ms']:10.3f} {r['gsa_step_ms']:12.3f} {flash} "
                  f"{r['paged_decode_ms']:9.3f} {r['fastest_dense_over_gsa']:9.2f}")
    if loss_rows:
        print()
        print(f"{'indexer loss, f+b':>20} {'winnow ms':>10} {'PyTorch ms':>11} {'speed-up':>9}")
        for r in loss_rows:
            print(f"{r['set']:>20} {r['winnow_ms']:10.2f} {r['composed_ms']:11.2f} {r['speedup']:9.1f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows,
                       "indexer_loss": loss_rows, "decode": decode_rows}, fh, indent=1)


if __name__ == "__main__":
    main()
