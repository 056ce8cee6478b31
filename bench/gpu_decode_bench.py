"""Decoding at memory speed (issue 17): one query per sequence against a long key/value cache,
winnow's split-KV kernels beside torch SDPA (FlashAttention-2 and cuDNN back ends) and the
device's own copy bandwidth, in one run.

Shape (issue 17): bf16, B = 8 sequences, 32 query heads over 8 kv heads, D = 128, keys ~ N(0, 1).
Rows: winnow softmax and stick-breaking through the forward operators on contiguous caches
(B, L, Hkv, D), which take the decoding kernels for short query suffixes; Sieve (exact and bound
filters) and entmax-1.5 likewise, each its threshold search over the cache first (the forward
kernel's value-free sweeps), then the decoding kernel; TRA and TDA (beta 0.5, p 2; TDA reads a
second key cache, which GB/s does not count) through their forward operator; the same through
winnow.paged_decode on a paged cache (page size 16, pages in shuffled order, trusted table); the
fused forward kernels that served decoding before (a subprocess with WINNOW_NO_DECODE_KERNELS=1,
same inputs); SDPA with enable_gqa (kv heads not expanded), is_causal=False since the one query
sees every key. GB/s counts the cache once (K and V, B L Hkv D 2 bytes each) over the time of
one call; the copy row is dst.copy_(src) of a 1 GiB tensor counting read and write. Times are
medians over repeats of 20 back-to-back calls between two CUDA events (so host dispatch
overlaps the kernels, as in a decoding loop that runs ahead of the GPU).
Writes JSON (--json) and prints a table.
"""

import argparse
import json
import os
import subprocess
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import winnow  # noqa: E402
import gpu_attention_bench as attention_bench  # noqa: E402

INNER = 20


def median_ms(fn, repeat=11):
    return attention_bench.median_ms(fn, repeat=repeat, inner=INNER)


def copy_gbps():
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), repeat=5)
    return 2 * src.numel() / ms / 1e6


def paged(k, v, page_size, gen):
    """The same keys in shuffled pages of page_size rows, and the block table."""
    B, L, H, D = k.shape
    per_seq = (L + page_size - 1) // page_size
    pages = B * per_seq
    order = torch.randperm(pages, generator=gen).to(k.device)
    kc = torch.empty(pages, page_size, H, D, dtype=k.dtype, device=k.device)
    vc = torch.empty_like(kc)
    pad = per_seq * page_size - L
    kp = F.pad(k, (0, 0, 0, 0, 0, pad)).reshape(B * per_seq, page_size, H, D)
    vp = F.pad(v, (0, 0, 0, 0, 0, pad)).reshape(B * per_seq, page_size, H, D)
    kc[order] = kp
    vc[order] = vp
    table = order.view(B, per_seq).to(torch.int32)
    lens = torch.full((B,), L, dtype=torch.int32, device=k.device)
    return kc, vc, table, lens


def sdpa(backend, q, k, v):
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def run():
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
    run()
    return run


def inputs(L, args):
    gen = torch.Generator(device="cuda").manual_seed(L)
    shape_q = (args.batch, 1, args.heads, args.dim)
    shape_k = (args.batch, L, args.kv_heads, args.dim)
    q = torch.randn(shape_q, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(shape_k, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(shape_k, device="cuda", dtype=torch.bfloat16, generator=gen)
    return q, k, v


def case(L, args, fused_only):
    q, k, v = inputs(L, args)
    cache_bytes = 2 * k.numel() * k.element_size()
    ops = torch.ops.winnow
    rows = {}

    def add(name, fn):
        try:
            ms = median_ms(fn)
            rows[name] = {"ms": ms, "gbps": cache_bytes / ms / 1e6}
        except RuntimeError as e:
            rows[name] = {"ms": None, "error": str(e).splitlines()[0][:200]}

    prefix = "fused " if fused_only else ""
    add(prefix + "winnow softmax", lambda: ops.softmax_attention_forward(q, k, v))
    add(prefix + "winnow stick-breaking", lambda: ops.stick_breaking_attention_forward(q, k, v))
    # Sieve and entmax: their threshold search over the cache, then the decoding kernel (or the
    # fused forward's output sweep); no gradient is wanted, so entmax lists no supports.
    add(prefix + "winnow sieve exact", lambda: winnow.sieve_attention(q, k, v))
    add(prefix + "winnow sieve bound", lambda: winnow.sieve_attention(q, k, v, filter="bound"))
    add(prefix + "winnow entmax-1.5", lambda: winnow.entmax_attention(q, k, v, alpha=1.5))
    # Threshold attention at beta 0.5 (004's p = 2): TRA, and TDA with a second view of queries
    # and keys (its cache counted as extra bytes: GB/s here counts K and V once, as for the rest).
    beta = torch.full((args.heads,), 0.5, device="cuda")
    lam = torch.full((args.heads,), 0.5, device="cuda")
    q2, k2 = torch.randn_like(q), torch.randn_like(k)
    add(prefix + "winnow tra", lambda: winnow.threshold_attention(q, k, v, beta))
    add(prefix + "winnow tda", lambda: winnow.threshold_attention(q, k, v, beta, lam=lam, q2=q2, k2=k2))
    if fused_only:
        return rows
    gen = torch.Generator().manual_seed(1)
    kc, vc, table, lens = paged(k, v, args.page_size, gen)
    for mech in ("softmax", "stick_breaking"):
        add(f"winnow {mech.replace('_', '-')} paged",
            lambda m=mech: winnow.paged_decode(q, kc, vc, table, lens, mechanism=m, trusted=True))
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            add(f"sdpa {name}", sdpa(backend, q, k, v))
        except RuntimeError as e:
            rows[f"sdpa {name}"] = {"ms": None, "error": str(e).splitlines()[0][:200]}
    # Exactness of what is timed: contiguous and paged give the same bits' worth of answer.
    out_c, _ = ops.softmax_attention_forward(q, k, v)
    out_p, _ = winnow.paged_decode(q, kc, vc, table, lens, trusted=True)
    rows["paged_vs_contiguous_max_abs"] = float((out_c.float() - out_p.float()).abs().max())
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--fused-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.fused_only:
        print(json.dumps({str(L): case(L, args, True) for L in args.lengths}))
        return
    env = dict(os.environ, WINNOW_NO_DECODE_KERNELS="1")
    cmd = [sys.executable, __file__, "--fused-only", "--lengths", *map(str, args.lengths), "--batch",
           str(args.batch), "--heads", str(args.heads), "--kv-heads", str(args.kv_heads), "--dim", str(args.dim)]
    fused = json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
    copy = copy_gbps()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_gbps": copy,
              "shape": {"batch": args.batch, "heads": args.heads, "kv_heads": args.kv_heads, "dim": args.dim,
                        "page_size": args.page_size, "dtype": "bfloat16"}, "lengths": {}}
    for L in args.lengths:
        rows = case(L, args, False)
        rows.update(fused[str(L)])
        result["lengths"][str(L)] = rows
        print(json.dumps({L: rows}), flush=True)
    print(f"\ncopy bandwidth (read + write): {copy:.0f} GB/s")
    names = [n for n in result["lengths"][str(args.lengths[0])] if isinstance(result["lengths"][str(args.lengths[0])][n], dict)]
    print(f"{'method':<30}" + "".join(f"{'L=' + str(L) + ' ms':>12}{'GB/s':>8}{'x copy':>8}" for L in args.lengths))
    for n in names:
        line = f"{n:<30}"
        for L in args.lengths:
            r = result["lengths"][str(L)][n]
            line += (f"{r['ms']:12.4f}{r['gbps']:8.0f}{r['gbps'] / copy:8.2f}" if r.get("ms") else f"{'-':>12}{'-':>8}{'-':>8}")
        print(line)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
