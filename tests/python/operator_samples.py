"""Sample calls of every winnow operator, for the tests that check how the operators behave
under PyTorch's machinery (the meta device, fake tensors, torch.library.opcheck,
torch.compile) rather than what they compute. Shared by the CPU tests and the CUDA tests."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Tuple

import torch

import winnow

# The operators a user calls (each with its autograd formula) and the forward / backward
# operators those call. Every registered operator must appear here: test_every_operator_has_samples
# compares this list with torch.ops.winnow.
DIFFERENTIABLE = ["softmax_attention", "stick_breaking_attention", "entmax_attention",
                  "sieve_attention", "threshold_attention", "screening_attention",
                  "gsa_sparse_attention", "gsa_indexer_loss", "rotary_embedding", "rms_norm", "add_rms_norm", "swiglu"]
KERNELS = ["softmax_attention_forward", "softmax_attention_backward",
           "stick_breaking_attention_forward", "stick_breaking_attention_backward",
           "entmax_attention_forward", "entmax_attention_backward",
           "sieve_attention_forward", "sieve_attention_backward",
           "threshold_attention_forward", "threshold_attention_backward",
           "screening_attention_forward", "screening_attention_backward",
           # GSA's selection has no gradient: one operator, sampled with the kernels.
           "gsa_select_keys", "gsa_sparse_attention_forward", "gsa_sparse_attention_backward",
           "gsa_indexer_loss_forward", "gsa_indexer_loss_backward",
           # Decoding against a paged cache: inference only, no gradient.
           "paged_decode",
           "rotary_embedding_apply",
           "rms_norm_forward", "rms_norm_backward", "add_rms_norm_forward",
           "add_rms_norm_backward", "swiglu_forward", "swiglu_backward"]
# Operators without CUDA kernels yet: their samples exist on the CPU only, and the CUDA tests
# check that CUDA tensors get a clear error instead (tests/python_cuda).


@dataclass
class Sample:
    op: str
    args: Tuple
    kwargs: Dict = field(default_factory=dict)
    label: str = ""

    def __str__(self):
        return f"{self.op}[{self.label}]"


def _qkv(b, lq, lk, hq, hkv, d, dv, dtype, device, requires_grad, gen):
    def rnd(*shape, scale=1.0):
        t = torch.randn(*shape, generator=gen, dtype=torch.float64) * scale
        return t.to(device=device, dtype=dtype).requires_grad_(requires_grad)
    # Scaled queries: entmax and Sieve then select a handful of keys rather than nearly all.
    return rnd(b, lq, hq, d, scale=2.0), rnd(b, lk, hkv, d), rnd(b, lk, hkv, dv)


def _packed(d, dtype, device, requires_grad, gen):
    """Packed (T, H, D) sequences of lengths 5, 0 and 7 queries against 8, 3 and 9 keys."""
    def rnd(*shape, scale=1.0):
        t = torch.randn(*shape, generator=gen, dtype=torch.float64) * scale
        return t.to(device=device, dtype=dtype).requires_grad_(requires_grad)
    cu_q = torch.tensor([0, 5, 5, 12], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 8, 11, 20], dtype=torch.int32, device=device)
    return rnd(12, 4, d, scale=2.0), rnd(20, 2, d), rnd(20, 2, d // 2), cu_q, cu_k


def samples(device="cpu", dtype=torch.float64, requires_grad=True, d=16) -> List[Sample]:
    """One or two calls of each operator: batched with grouped-query heads and more keys than
    queries, and packed sequences (varlen) with an empty one. d: the head dimension (64 or 128
    reach the fused CUDA kernels for 16-bit inputs)."""
    gen = torch.Generator().manual_seed(0)
    out: List[Sample] = []
    attention = {
        "softmax_attention": {},
        "stick_breaking_attention": {"halt_cutoff": 0.0},
        "entmax_attention": {"alpha": 1.5},
        "sieve_attention": {"filter": "bound"},
    }
    for name, options in attention.items():
        q, k, v = _qkv(2, 9, 13, 4, 2, d, d // 2, dtype, device, requires_grad, gen)
        out.append(Sample(name, (q, k, v), dict(options), "batched"))
        q, k, v, cu_q, cu_k = _packed(d, dtype, device, requires_grad, gen)
        out.append(Sample(name, (q, k, v), dict(options, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k),
                          "packed"))
    out.append(Sample("sieve_attention", _qkv(1, 11, 11, 2, 1, d, d, dtype, device,
                                              requires_grad, gen),
                      {"filter": "exact", "alpha": 2.0}, "exact"))
    # Rotary embedding inside softmax attention: suffix queries of their own, and q, k and v as
    # heads of one tensor (one launch rotates q and k; the gradients come back as one buffer).
    table_dtype = torch.float64 if dtype == torch.float64 else torch.float32

    def tables(n):
        angles = torch.rand(n, d // 2, generator=gen, dtype=torch.float64) * 6.0
        return tuple(t.to(device=device, dtype=table_dtype) for t in (angles.cos(), angles.sin()))
    q, k, v = _qkv(2, 9, 13, 4, 2, d, d // 2, dtype, device, requires_grad, gen)
    cos, sin = tables(13)
    out.append(Sample("softmax_attention", (q, k, v), {"rotary_cos": cos, "rotary_sin": sin}, "rotary"))
    qkv = torch.randn(2, 11, 8 * d, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)
    heads = (qkv[..., :4 * d].view(2, 11, 4, d), qkv[..., 4 * d:6 * d].view(2, 11, 2, d),
             qkv[..., 6 * d:].view(2, 11, 2, d))
    cos, sin = tables(11)
    out.append(Sample("softmax_attention", tuple(t.detach().requires_grad_(requires_grad) for t in heads),
                      {"rotary_cos": cos, "rotary_sin": sin}, "rotary_one_tensor"))

    # The forward and backward operators, each with what its forward returned.
    with torch.no_grad():
        q, k, v = (t.detach() for t in _qkv(2, 9, 13, 4, 2, d, d // 2, dtype, device, False, gen))
        dout = torch.randn(q.shape[:-1] + (v.shape[-1],), generator=gen,
                           dtype=torch.float64).to(device=device, dtype=dtype)
        ops = torch.ops.winnow
        o, lse = ops.softmax_attention_forward(q, k, v)
        out.append(Sample("softmax_attention_forward", (q, k, v), {}, "batched"))
        out.append(Sample("softmax_attention_backward", (q, k, v, o, lse, dout), {}, "batched"))
        o, log_rem, kept = ops.stick_breaking_attention_forward(q, k, v)
        out.append(Sample("stick_breaking_attention_forward", (q, k, v), {}, "batched"))
        out.append(Sample("stick_breaking_attention_backward",
                          (q, k, v, o, log_rem, kept, dout, torch.randn_like(log_rem)), {},
                          "batched"))
        o, tau, _ = ops.entmax_attention_forward(q, k, v, alpha=1.5)
        out.append(Sample("entmax_attention_forward", (q, k, v), {"alpha": 1.5}, "batched"))
        out.append(Sample("entmax_attention_backward", (q, k, v, o, tau, dout), {"alpha": 1.5},
                          "batched"))
        o, log_rem, threshold, count = ops.sieve_attention_forward(q, k, v, filter="bound")
        out.append(Sample("sieve_attention_forward", (q, k, v), {"filter": "bound"}, "batched"))
        out.append(Sample("sieve_attention_backward",
                          (q, k, v, o, log_rem, threshold, dout, torch.randn_like(log_rem)),
                          {"filter": "bound"}, "batched"))

    # Threshold attention (TRA; TDA with lam, q2, k2): beta and lam per query head or one for
    # the layer, in float32 (float64 for float64 inputs).
    stat = torch.float64 if dtype == torch.float64 else torch.float32

    def scalars(n, value):
        return torch.full((n,), value, dtype=stat, device=device).requires_grad_(requires_grad)
    q, k, v = _qkv(2, 9, 13, 4, 2, d, d // 2, dtype, device, requires_grad, gen)
    out.append(Sample("threshold_attention", (q, k, v, scalars(4, 0.3)), {}, "tra batched"))
    q, k, v, cu_q, cu_k = _packed(d, dtype, device, requires_grad, gen)
    q2, k2, _, _, _ = _packed(d, dtype, device, requires_grad, gen)
    out.append(Sample("threshold_attention", (q, k, v, scalars(1, 0.3)),
                      {"lam": scalars(1, 0.5), "q2": q2, "k2": k2, "cu_seqlens_q": cu_q,
                       "cu_seqlens_k": cu_k, "power": 1.0}, "tda packed"))
    with torch.no_grad():
        q, k, v = (t.detach() for t in _qkv(2, 9, 13, 4, 2, d, d // 2, dtype, device, False, gen))
        q2, k2, _ = (t.detach() for t in _qkv(2, 9, 13, 4, 2, d, d // 2, dtype, device, False, gen))
        beta = torch.full((4,), 0.3, dtype=stat, device=device)
        lam = torch.full((4,), 0.5, dtype=stat, device=device)
        dout = torch.randn(q.shape[:-1] + (v.shape[-1],), generator=gen,
                           dtype=torch.float64).to(device=device, dtype=dtype)
        out.append(Sample("threshold_attention_forward", (q, k, v, beta),
                          {"lam": lam, "q2": q2, "k2": k2, "count_nonzero": True}, "tda"))
        out.append(Sample("threshold_attention_forward", (q, k, v, beta), {}, "tra"))
        out.append(Sample("threshold_attention_backward", (q, k, v, beta, None, None, None, dout),
                          {}, "tra"))
        out.append(Sample("threshold_attention_backward", (q, k, v, beta, lam, q2, k2, dout),
                          {}, "tda"))
        if torch.device(device).type == "cuda":
            # The normalized rows kept from the forward for the backward (CUDA only).
            rows = torch.ops.winnow.threshold_attention_forward(
                q, k, v, beta, lam=lam, q2=q2, k2=k2, keep_rows=True)[2]
            out.append(Sample("threshold_attention_forward", (q, k, v, beta),
                              {"lam": lam, "q2": q2, "k2": k2, "keep_rows": True}, "tda keep_rows"))
            out.append(Sample("threshold_attention_backward", (q, k, v, beta, lam, q2, k2, dout),
                              {"saved_rows": rows}, "tda saved_rows"))
            # Packed: the record's support map takes its row tiles from cu_seqlens_q's length.
            pq, pk, pv, cu_q, cu_k = (t.detach() for t in _packed(d, dtype, device, False, gen))
            out.append(Sample("threshold_attention_forward", (pq, pk, pv, beta),
                              {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "keep_rows": True},
                              "tra packed keep_rows"))

    # Screening (Multiscreen): s_w and s_r per query head or one for the layer, float32 (float64
    # for float64 inputs); d_K may differ from d_V.
    q, k, v = _qkv(2, 9, 13, 4, 2, d, d // 2, dtype, device, requires_grad, gen)
    out.append(Sample("screening_attention", (q, k, v, scalars(4, 1.0), scalars(4, 1.5)), {}, "batched"))
    q, k, v, cu_q, cu_k = _packed(d, dtype, device, requires_grad, gen)
    out.append(Sample("screening_attention", (q, k, v, scalars(1, 2.0), scalars(1, 1.0)),
                      {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "expand_windows_above": 5.0}, "packed"))
    with torch.no_grad():
        q, k, v = (t.detach() for t in _qkv(2, 9, 13, 4, 2, d, d // 2, dtype, device, False, gen))
        s_w = torch.full((4,), 1.0, dtype=stat, device=device)
        s_r = torch.full((4,), 1.5, dtype=stat, device=device)
        o, h_norm = torch.ops.winnow.screening_attention_forward(q, k, v, s_w, s_r)
        dout = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)
        out.append(Sample("screening_attention_forward", (q, k, v, s_w, s_r), {}, "batched"))
        out.append(Sample("screening_attention_backward", (q, k, v, s_w, s_r, o, h_norm, dout), {},
                          "batched"))

    # GSA: the indexer with selection (H_I = 4 indexer heads over one key head, head weights in
    # q's dtype, the bias in float32, float64 for float64 inputs), batched with an adaptive
    # budget and packed with a fixed one; then the sparse attention over lists it selected,
    # selected on the CPU in float64 and moved (valid lists whatever the dtype and device).
    def indexer(*rows_q, rows_k, requires=requires_grad):
        def rnd(*shape):
            t = torch.randn(*shape, generator=gen, dtype=torch.float64)
            return t.to(device=device, dtype=dtype).requires_grad_(requires)
        return (rnd(*rows_q, 4, d), rnd(*rows_k, 1, d), rnd(*rows_q, 4),
                torch.randn(4, generator=gen, dtype=torch.float64).to(device=device, dtype=stat))

    def lists(iq, ik, iw, ib, **options):
        f64 = [t.detach().to("cpu", torch.float64) for t in (iq, ik, iw, ib)]
        options = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in options.items()}
        indices, counts, _ = torch.ops.winnow.gsa_select_keys(*f64, **options)
        return indices.to(device), counts.to(device)

    adaptive = {"k_max": 6, "k_base": 3, "k_min": 2, "mean_variance": 0.02}
    iq, ik, iw, ib = indexer(2, 9, rows_k=(2, 13))
    out.append(Sample("gsa_select_keys", (iq, ik, iw, ib), dict(adaptive), "batched"))
    batched_lists = lists(iq, ik, iw, ib, **adaptive)
    cu_q = torch.tensor([0, 5, 5, 12], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 8, 11, 20], dtype=torch.int32, device=device)
    fixed = {"k_max": 4, "budget": "fixed", "k_fixed": 3, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}
    iq, ik, iw, ib = indexer(12, rows_k=(20,))
    out.append(Sample("gsa_select_keys", (iq, ik, iw), dict(fixed, form="relu"), "packed relu"))
    packed_lists = lists(iq, ik, iw, ib, **fixed)
    q, k, v = _qkv(2, 9, 13, 4, 2, d, d // 2, dtype, device, requires_grad, gen)
    out.append(Sample("gsa_sparse_attention", (q, k, v) + batched_lists, {}, "batched"))
    q, k, v, cu_q, cu_k = _packed(d, dtype, device, requires_grad, gen)
    out.append(Sample("gsa_sparse_attention", (q, k, v) + packed_lists,
                      {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}, "packed"))
    with torch.no_grad():
        q, k, v = (t.detach() for t in _qkv(2, 9, 13, 4, 2, d, d // 2, dtype, device, False, gen))
        o, lse = torch.ops.winnow.gsa_sparse_attention_forward(q, k, v, *batched_lists)
        dout = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)
        out.append(Sample("gsa_sparse_attention_forward", (q, k, v) + batched_lists, {}, "batched"))
        out.append(Sample("gsa_sparse_attention_backward",
                          (q, k, v) + batched_lists + (o, lse, dout), {}, "batched"))

    # The indexer's loss over those lists and, without lists, over every visible key; the
    # attention's q and k (4 heads over 2) are its target and carry no gradient. The kernels'
    # samples add the relu form over packed sequences.
    iq, ik, iw, ib = indexer(2, 9, rows_k=(2, 13))
    aq, ak, _ = (t.detach() for t in _qkv(2, 9, 13, 4, 2, d, d, dtype, device, False, gen))
    out.append(Sample("gsa_indexer_loss", (iq, ik, iw, ib, aq, ak) + batched_lists, {}, "batched lists"))
    out.append(Sample("gsa_indexer_loss", (iq, ik, iw, ib, aq, ak), {}, "batched dense"))
    with torch.no_grad():
        iq, ik, iw, ib = indexer(2, 9, rows_k=(2, 13), requires=False)
        loss, lse = torch.ops.winnow.gsa_indexer_loss_forward(iq, ik, iw, ib, aq, ak, *batched_lists)
        dloss = torch.randn(loss.shape, generator=gen, dtype=torch.float64).to(device=device, dtype=loss.dtype)
        out.append(Sample("gsa_indexer_loss_forward", (iq, ik, iw, ib, aq, ak) + batched_lists, {}, "batched"))
        out.append(Sample("gsa_indexer_loss_backward",
                          (iq, ik, iw, ib, aq, ak) + batched_lists + (loss, lse, dloss), {}, "batched"))
        iq, ik, iw, _ = indexer(12, rows_k=(20,), requires=False)
        pq, pk, _, cu_q, cu_k = _packed(d, dtype, device, False, gen)
        out.append(Sample("gsa_indexer_loss_forward", (iq, ik, iw, None, pq, pk),
                          {"form": "relu", "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}, "packed dense relu"))

    # Paged decoding: 2 queries per sequence, GQA 4:2, pages of 4 rows handed out out of order,
    # sequences of 5 and 11 keys, unused table entries -1.
    def cache(dim):
        t = torch.randn(7, 4, 2, dim, generator=gen, dtype=torch.float64)
        return t.to(device=device, dtype=dtype)
    q = torch.randn(2, 2, 4, d, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)
    table = torch.tensor([[5, 2, -1, -1], [0, 6, 3, -1]], dtype=torch.int32, device=device)
    lens = torch.tensor([5, 11], dtype=torch.int32, device=device)
    for mechanism in ("softmax", "stick_breaking"):
        out.append(Sample("paged_decode", (q, cache(d), cache(d // 2), table, lens),
                          {"mechanism": mechanism}, mechanism))

    # Rotary embedding: x (B, L, H, D), tables (L, D/2) in float32 (float64 for float64 x).
    table_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    angles = torch.arange(9, dtype=torch.float64)[:, None] * torch.pow(
        10000.0, -torch.arange(8, dtype=torch.float64) / 8)[None, :]
    cos, sin = (t.to(device=device, dtype=table_dtype) for t in (angles.cos(), angles.sin()))
    x = torch.randn(2, 9, 3, 16, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)
    out.append(Sample("rotary_embedding", (x.clone().requires_grad_(requires_grad), cos, sin), {},
                      "rotate"))
    out.append(Sample("rotary_embedding", (x.clone().requires_grad_(requires_grad), cos, sin),
                      {"transpose": True}, "transpose"))
    out.append(Sample("rotary_embedding_apply", (x, cos, sin), {}, "rotate"))

    # RMSNorm: x (..., C) in dtype, the weight in float32 (float64 for float64 x); on CUDA a
    # float32 x also normalized straight into bfloat16, as the trainer does under autocast.
    x = torch.randn(2, 9, 24, generator=gen, dtype=torch.float64).mul(3).to(device=device, dtype=dtype)
    w = torch.randn(24, generator=gen, dtype=torch.float64).to(device=device, dtype=table_dtype)
    out.append(Sample("rms_norm", (x.clone().requires_grad_(requires_grad),
                                   w.clone().requires_grad_(requires_grad)), {"eps": 1e-5}, "same"))
    narrow = torch.device(device).type == "cuda" and dtype == torch.float32
    out_dtype = torch.bfloat16 if narrow else dtype
    if narrow:
        out.append(Sample("rms_norm", (x.clone().requires_grad_(requires_grad),
                                       w.clone().requires_grad_(requires_grad)),
                          {"out_dtype": torch.bfloat16}, "to bf16"))
    with torch.no_grad():
        y, rstd = torch.ops.winnow.rms_norm_forward(x, w, 1e-5, out_dtype)
        out.append(Sample("rms_norm_forward", (x, w), {"eps": 1e-5, "out_dtype": out_dtype},
                          "narrow" if narrow else "same"))
        dy = torch.randn(y.shape, generator=gen, dtype=torch.float64).to(device=device, dtype=out_dtype)
        out.append(Sample("rms_norm_backward", (dy, x, w, rstd), {}, "narrow" if narrow else "same"))

    # The residual form: the residual (and the gradient reaching it) in the output's dtype.
    r = torch.randn(2, 9, 24, generator=gen, dtype=torch.float64).to(device=device, dtype=out_dtype)
    out.append(Sample("add_rms_norm", (x.clone().requires_grad_(requires_grad),
                                       r.clone().requires_grad_(requires_grad),
                                       w.clone().requires_grad_(requires_grad)),
                      {"eps": 1e-5, "out_dtype": out_dtype}, "narrow" if narrow else "same"))
    with torch.no_grad():
        s, y, rstd = torch.ops.winnow.add_rms_norm_forward(x, r, w, 1e-5, out_dtype)
        out.append(Sample("add_rms_norm_forward", (x, r, w), {"eps": 1e-5, "out_dtype": out_dtype},
                          "narrow" if narrow else "same"))
        ds = torch.randn(s.shape, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)
        out.append(Sample("add_rms_norm_backward", (dy, ds, s, w, rstd), {}, "with dsum"))
        out.append(Sample("add_rms_norm_backward", (dy, None, s, w, rstd), {}, "without dsum"))

    # SwiGLU's gate: gate and up (B, L, H) of one dtype.
    gate = torch.randn(2, 9, 20, generator=gen, dtype=torch.float64).mul(3).to(device=device, dtype=dtype)
    up = torch.randn(2, 9, 20, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)
    out.append(Sample("swiglu", (gate.clone().requires_grad_(requires_grad),
                                 up.clone().requires_grad_(requires_grad)), {}, "same"))
    out.append(Sample("swiglu_forward", (gate, up), {}, "same"))
    out.append(Sample("swiglu_backward", (torch.randn_like(gate), gate, up), {}, "same"))
    return out


def operator(sample: Sample):
    return getattr(torch.ops.winnow, sample.op).default


# Python-level functions of the package, with the operator each wraps: a model calls these.
FUNCTIONS: Dict[str, Callable] = {
    "softmax_attention": winnow.softmax_attention,
    "stick_breaking_attention": winnow.stick_breaking_attention,
    "entmax_attention": winnow.entmax_attention,
    "sieve_attention": winnow.sieve_attention,
    "threshold_attention": winnow.threshold_attention,
    "screening_attention": winnow.screening_attention,
    "gsa_sparse_attention": winnow.gsa_sparse_attention,
    "gsa_indexer_loss": winnow.gsa_indexer_loss,
    "rotary_embedding": winnow.rotary_embedding,
    "rms_norm": winnow.rms_norm,
    "add_rms_norm": winnow.add_rms_norm,
    "swiglu": winnow.swiglu,
}
