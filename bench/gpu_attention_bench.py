"""GPU attention benchmark: winnow's kernels beside torch SDPA (FlashAttention-2 and cuDNN back
ends) and, when importable, the stick-breaking paper's Triton kernel and AdaSplash-2 (the
`adasplash` package: 1.5-entmax attention in Triton), on the same inputs in the same run.

The composed PyTorch Sieve (`composed_sieve`: materialized scores, the entmax threshold by
bisection, stick-breaking over the candidates) is the baseline of 000's figure 4 left, which
plots tokens/s against L: the table's tokens/s columns are B L over the forward time
(inference) and over the forward+backward time (training).

Shapes (issue 3): B * L = 16384 tokens, H = 12 at D = 128 and H = 16 at D = 64,
L in {1024, 4096, 16384}, bf16, causal, (B, L, H, D) layout; inputs random (N(0, 1)) or, with
--inputs local, scores peaked at the diagonal (local_inputs). Times are medians of CUDA-event
timings after warm-up; TFLOP/s count causal FLOPs: 4 B H L^2 D / 2 forward, 2.5x that
backward, 3.5x forward+backward. Writes JSON (--json) and prints a table.
"""

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
try:
    import winnow  # noqa: E402
except ImportError as missing:  # a run of the baselines alone (say, on a GPU machine before a build)
    print(f"# winnow not importable, so its rows report this: {missing}")

    class _NotImportable:
        def __init__(self, reason):
            self.reason = reason

        def __getattr__(self, name):
            raise ImportError(f"winnow not importable: {self.reason}")

    winnow = _NotImportable(str(missing))

try:
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:  # older torch
    SDPBackend = sdpa_kernel = None


def median_ms(fn, warmup=3, repeat=15, inner=1):
    """Median milliseconds per call of fn over `repeat` timings, each of `inner` back-to-back
    calls between two CUDA events (inner > 1 lets host dispatch overlap short kernels)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    if time.perf_counter() - start > 0.05:  # slow paths: fewer repeats keep the run bounded
        warmup, repeat = 0, 3
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    times.sort()
    return times[len(times) // 2]


def sdpa(backend):
    def run(q, k, v):
        with sdpa_kernel([backend]):
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2), is_causal=True)
        return o.transpose(1, 2)
    return run


def same_layout(q, k, v):
    return q, k, v


def composed_sieve(q, k, v, alpha=1.5):
    """Sieve as a user would write it in PyTorch (spec/sieve.md, exact filter, keys i < j):
    L x L scores in float32, the alpha-entmax threshold by 30 bisection steps on [max - 1, max]
    (no gradient: the candidate set is discrete), stick-breaking over the candidates."""
    B, L, H, D = q.shape
    group = H // k.shape[2]
    qh = q.transpose(1, 2).float()
    kh = k.repeat_interleave(group, 2).transpose(1, 2).float()
    vh = v.repeat_interleave(group, 2).transpose(1, 2)
    z = qh @ kh.transpose(-1, -2) / math.sqrt(D)
    pos = torch.arange(L, device=q.device)
    visible = pos[None, :] < pos[:, None]
    with torch.no_grad():
        x = ((alpha - 1) * z).masked_fill(~visible, float("-inf"))
        hi = x.max(-1, keepdim=True).values
        lo = hi - 1
        for _ in range(30):
            mid = (lo + hi) / 2
            f = torch.clamp(x - mid, min=0).pow(1 / (alpha - 1)).sum(-1, keepdim=True)
            lo, hi = torch.where(f >= 1, mid, lo), torch.where(f >= 1, hi, mid)
        kept = visible & (x > lo)
    cost = torch.where(kept, F.softplus(z), torch.zeros_like(z))
    suffix = cost.flip(-1).cumsum(-1).flip(-1)
    w = torch.where(kept, torch.exp(z - suffix), torch.zeros_like(z))
    return (w.to(vh.dtype) @ vh).transpose(1, 2)


def local_inputs(B, L, heads, dim, peak=24.0, noise=0.3):
    """Queries and keys whose scores peak at the diagonal and fall off with distance, as in a
    trained model's local heads (the CUDA tests' local problems): q_j . k_i / sqrt(D) =
    peak * mean_f cos(w_f (j - i)) plus noise, w_f up to pi / 16. Entmax's support and Sieve's
    candidates lie within a few keys of the diagonal, so their kernels skip most key tiles;
    softmax and stick-breaking cost what they cost on random inputs."""
    pairs = dim // 2
    pos = torch.arange(L, device="cuda", dtype=torch.float32)
    freq = torch.arange(1, pairs + 1, device="cuda", dtype=torch.float32) * (math.pi / 16 / pairs)
    angle = pos[:, None] * freq[None, :]
    amplitude = math.sqrt(peak * math.sqrt(dim) / pairs)
    rot = torch.stack((angle.cos(), angle.sin()), -1).reshape(L, dim) * amplitude
    out = []
    for _ in range(2):
        x = noise * torch.randn(B, L, heads, dim, device="cuda") + rot[None, :, None, :]
        out.append(x.to(torch.bfloat16).requires_grad_())
    out.append(torch.randn(B, L, heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True))
    return out


def make_inputs(kind, B, L, heads, dim):
    """q, k, v leaves in (B, L, H, D), bf16: `random` N(0, 1), or `local` (local_inputs)."""
    if kind == "local":
        return local_inputs(B, L, heads, dim)
    return [torch.randn(B, L, heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(3)]


def every_key_tile(fn):
    def run(q, k, v):
        os.environ["WINNOW_DENSE_KEY_TILES"] = "1"
        try:
            return fn(q, k, v)
        finally:
            del os.environ["WINNOW_DENSE_KEY_TILES"]
    return run


def methods():
    """name -> (prepare, run): prepare turns (B, L, H, D) leaves into the method's own input
    layout outside the timed region; run computes the attention output from them."""
    m = {}
    if sdpa_kernel is not None:
        m["sdpa_flash"] = (same_layout, sdpa(SDPBackend.FLASH_ATTENTION))
        m["sdpa_cudnn"] = (same_layout, sdpa(SDPBackend.CUDNN_ATTENTION))
        # The score matrix materialized: the "standard softmax" of 000's figure 4 left.
        m["sdpa_math"] = (same_layout, sdpa(SDPBackend.MATH))
    m["winnow_softmax"] = (same_layout, lambda q, k, v: winnow.softmax_attention(q, k, v))
    m["winnow_stick_breaking"] = (same_layout, lambda q, k, v: winnow.stick_breaking_attention(q, k, v)[0])
    m["winnow_stick_breaking_halt40"] = (
        same_layout, lambda q, k, v: winnow.stick_breaking_attention(q, k, v, halt_cutoff=40.0)[0])
    m["winnow_entmax15"] = (same_layout, lambda q, k, v: winnow.entmax_attention(q, k, v, alpha=1.5))
    # A general alpha: its weights take an outlined power where 1.5 and 2 take a square or none.
    m["winnow_entmax13"] = (same_layout, lambda q, k, v: winnow.entmax_attention(q, k, v, alpha=1.3))
    m["winnow_sieve_exact"] = (same_layout, lambda q, k, v: winnow.sieve_attention(q, k, v)[0])
    m["winnow_sieve_bound"] = (
        same_layout, lambda q, k, v: winnow.sieve_attention(q, k, v, filter="bound")[0])
    # The same kernels visiting every key tile (WINNOW_DENSE_KEY_TILES): what skipping saves.
    for name in ("winnow_entmax15", "winnow_sieve_exact", "winnow_sieve_bound"):
        m[name + "_all_tiles"] = (same_layout, every_key_tile(m[name][1]))
    m["composed_sieve"] = (same_layout, composed_sieve)
    try:  # AdaSplash-2 (causal 1.5-entmax), layout (B, H, L, D)
        from adasplash import adasplash

        def to_bhld(q, k, v):
            return tuple(t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))

        m["adasplash2_entmax15"] = (to_bhld, lambda q, k, v: adasplash(q, k, v, alpha=1.5, is_causal=True))
    except Exception as e:  # noqa: BLE001
        print(f"# adasplash not available: {type(e).__name__}: {e}")
    try:  # the stick-breaking paper's public Triton kernels (package stickbreaking_attention)
        # Their softplus reads a module-level string inside a jitted function, which Triton 3.6
        # refuses unless told otherwise (NameError: Cannot access global variable asm_str).
        os.environ.setdefault("TRITON_ALLOW_NON_CONSTEXPR_GLOBALS", "1")
        from stickbreaking_attention.sb_attn import sb_attn
        from stickbreaking_attention.sb_varlen import sb_attn_varlen

        # Triton 3.6 hands a jitted callee's Python defaults through unwrapped, and a str default
        # (their locked_add's EVICTION_POLICY="") then fails to compile the backward ("'str'
        # object has no attribute 'type'"): wrapped as constexprs, they compile as intended.
        import triton
        import triton.language as tl
        for module_name, module in list(sys.modules.items()):
            if not module_name.startswith("stickbreaking_attention"):
                continue
            for obj in vars(module).values():
                fn = getattr(obj, "fn", None) if isinstance(obj, triton.runtime.JITFunction) else None
                if fn is not None and fn.__defaults__:
                    fn.__defaults__ = tuple(tl.constexpr(d) if isinstance(d, str) else d for d in fn.__defaults__)

        def paper(q, k, v):  # layout (B, H, L, D); returns (out, rem)
            return sb_attn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                           inv_temp=1 / math.sqrt(q.shape[-1]))[0].transpose(1, 2)

        def to_varlen(q, k, v):  # layout (H, B L, D), one sequence per batch row
            B, L, H, D = q.shape
            return tuple(t.detach().permute(2, 0, 1, 3).reshape(H, B * L, D).contiguous()
                         .requires_grad_() for t in (q, k, v))

        def paper_varlen(q, k, v):
            T = q.shape[1]
            L = paper_varlen.length
            cu = torch.arange(L, T + 1, L, device=q.device, dtype=torch.int32)
            return sb_attn_varlen(q, k, v, cu_seqlens=cu, max_seqlens=L,
                                  inv_temp=1 / math.sqrt(q.shape[-1]), zero_start=False)[0]
        m["sb_paper_triton"] = (same_layout, paper)
        m["sb_paper_triton_varlen"] = (to_varlen, paper_varlen)
    except Exception as e:  # noqa: BLE001
        print(f"# stick-breaking paper kernels not available: {type(e).__name__}: {e}")
    return m


def measure(name, prepare, fn, q, k, v, flops_fwd, forward_only=False):
    row = {"method": name}
    try:
        inputs = prepare(q, k, v)
        # With inputs that want gradients (what training runs; a forward may keep more for its
        # backward then, as entmax keeps its support lists), and without (inference).
        row["fwd_ms"] = median_ms(lambda: fn(*inputs))
        row["fwd_tflops"] = flops_fwd / row["fwd_ms"] / 1e9
        with torch.no_grad():
            row["fwd_inference_ms"] = median_ms(lambda: fn(*inputs))
        row["fwd_inference_tflops"] = flops_fwd / row["fwd_inference_ms"] / 1e9
        row["inference_tokens_per_s"] = q.shape[0] * q.shape[1] / row["fwd_ms"] * 1e3
        if forward_only:
            return row
        out = fn(*inputs)
        grad = torch.randn_like(out)
        row["bwd_ms"] = median_ms(lambda: torch.autograd.grad(out, inputs, grad, retain_graph=True))
        row["fwd_bwd_ms"] = median_ms(lambda: torch.autograd.grad(fn(*inputs), inputs, grad))
        row["bwd_tflops"] = 2.5 * flops_fwd / row["bwd_ms"] / 1e9
        row["fwd_bwd_tflops"] = 3.5 * flops_fwd / row["fwd_bwd_ms"] / 1e9
        row["training_tokens_per_s"] = q.shape[0] * q.shape[1] / row["fwd_bwd_ms"] * 1e3
    except Exception as e:  # noqa: BLE001
        row["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
    return row


def print_table(results):
    print(f"{'D':>4} {'L':>6} {'method':<30} {'fwd TF/s':>9} {'x flash':>8} {'inf TF/s':>9} {'bwd TF/s':>9} "
          f"{'x flash':>8} {'f+b TF/s':>9} {'x flash':>8} {'inf Mtok/s':>10} {'train Mtok/s':>12}")
    nan = float("nan")
    for r in results:
        if "error" in r:
            print(f"{r['D']:>4} {r['L']:>6} {r['method']:<30} error: {r['error'][:60]}")
            continue
        print(f"{r['D']:>4} {r['L']:>6} {r['method']:<30} {r['fwd_tflops']:9.1f} "
              f"{r.get('fwd_vs_flash', nan):8.2f} {r.get('fwd_inference_tflops', nan):9.1f} "
              f"{r.get('bwd_tflops', nan):9.1f} "
              f"{r.get('bwd_vs_flash', nan):8.2f} {r.get('fwd_bwd_tflops', nan):9.1f} "
              f"{r.get('fwd_bwd_vs_flash', nan):8.2f} "
              f"{r.get('inference_tokens_per_s', nan) / 1e6:10.3f} "
              f"{r.get('training_tokens_per_s', nan) / 1e6:12.3f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--dims", type=int, nargs="+", default=[128, 64])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=None,
                    help="query (= kv) heads; default 12 at D = 128 and 16 at D = 64")
    ap.add_argument("--json", default=None)
    ap.add_argument("--methods", nargs="+", default=None, help="only these methods (sdpa_flash always)")
    ap.add_argument("--forward-only", action="store_true", help="time the forward pass alone")
    ap.add_argument("--inputs", choices=["random", "local"], default="random",
                    help="random: q, k, v ~ N(0, 1); local: scores peaked at the diagonal (local_inputs)")
    args = ap.parse_args()

    torch.manual_seed(0)
    results = []
    props = torch.cuda.get_device_properties(0)
    print(f"# {props.name}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    for dim in args.dims:
        heads = args.heads or (12 if dim == 128 else 16)
        for L in args.lengths:
            B = max(1, args.tokens // L)
            q, k, v = make_inputs(args.inputs, B, L, heads, dim)
            flops = 4 * B * heads * L * L * dim / 2
            rows = {}
            for name, (prepare, fn) in methods().items():
                if args.methods and name != "sdpa_flash" and name not in args.methods:
                    continue
                if hasattr(fn, "__name__") and fn.__name__ == "paper_varlen":
                    fn.length = L
                row = measure(name, prepare, fn, q, k, v, flops, args.forward_only)
                row.update({"B": B, "L": L, "H": heads, "D": dim})
                rows[name] = row
                results.append(row)
                # Progress as it comes: a run cut short by a time limit still reports.
                print(f"# {dim} {L} {name}: " + ", ".join(
                    f"{k} {row[k]:.1f}" if isinstance(row[k], float) else f"{k} {row[k]}"
                    for k in ("fwd_tflops", "fwd_inference_tflops", "fwd_bwd_tflops", "error") if k in row),
                    flush=True)
            base = rows.get("sdpa_flash", {})
            for row in rows.values():
                for mode in ("fwd", "fwd_inference", "bwd", "fwd_bwd"):
                    if f"{mode}_tflops" in row and f"{mode}_tflops" in base:
                        row[f"{mode}_vs_flash"] = row[f"{mode}_tflops"] / base[f"{mode}_tflops"]
            torch.cuda.empty_cache()
            if args.json:  # after every shape, so a cut-short run keeps what it measured
                with open(args.json, "w") as f:
                    json.dump({"device": props.name, "torch": torch.__version__,
                               "inputs": args.inputs, "results": results}, f, indent=2)

    print_table(results)


if __name__ == "__main__":
    main()
