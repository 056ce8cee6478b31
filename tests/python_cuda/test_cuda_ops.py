"""The operators on CUDA tensors from Python: autograd against composed float64 expressions,
SDPA agreement for softmax, deterministic mode, halting, and GSA's selection and sparse
attention against the CPU kernels. Label `cuda` (GPU machines)."""

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
import winnow  # noqa: E402
from test_ops import (composed_entmax, composed_gsa_scores, composed_sieve,  # noqa: E402
                      composed_softmax, composed_stick_breaking, list_mask)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def grads_of(fn, *inputs, seed=0):
    out = fn(*inputs)
    out = out[0] if isinstance(out, tuple) else out
    # The same weights whatever the output's dtype and device.
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return out, torch.autograd.grad(out, inputs, w.to(out))


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 5e-3), (torch.float32, 1e-5)])
@pytest.mark.parametrize("dim", [64, 128])
def test_stick_breaking_cuda_matches_composed(dtype, tol, dim):
    torch.manual_seed(1)
    q = torch.randn(2, 300, 8, dim, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(2, 300, 2, dim, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(2, 300, 2, dim, device="cuda", dtype=dtype, requires_grad=True)
    out, grads = grads_of(winnow.stick_breaking_attention, q, k, v)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, ref_grads = grads_of(composed_stick_breaking, *ref_in)
    assert rel(out, ref) < tol
    for g, r in zip(grads, ref_grads):
        assert rel(g, r) < tol


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 5e-3)])
def test_softmax_cuda_matches_composed(dtype, tol):
    torch.manual_seed(2)
    q = torch.randn(1, 513, 4, 128, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(1, 513, 4, 128, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(1, 513, 4, 128, device="cuda", dtype=dtype, requires_grad=True)
    out, grads = grads_of(winnow.softmax_attention, q, k, v)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, ref_grads = grads_of(composed_softmax, *ref_in)
    assert rel(out, ref) < tol
    for g, r in zip(grads, ref_grads):
        assert rel(g, r) < tol


def test_deterministic_mode_repeats_bitwise():
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, 1000, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    torch.use_deterministic_algorithms(True)
    try:
        runs = [grads_of(winnow.stick_breaking_attention, q, k, v)[1] for _ in range(2)]
    finally:
        torch.use_deterministic_algorithms(False)
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_halting_on_cuda_is_negligible_at_40():
    torch.manual_seed(4)
    q, k, v = (torch.randn(1, 2048, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    full, _ = winnow.stick_breaking_attention(q, k, v)
    halted, _ = winnow.stick_breaking_attention(q, k, v, halt_cutoff=40.0)
    assert rel(halted, full) < 1e-2


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 3e-2), (torch.float16, 1e-2)])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("alpha", [1.5, 2.0])
def test_entmax_cuda_matches_composed(dtype, tol, dim, alpha):
    torch.manual_seed(5)
    q = (torch.randn(2, 300, 8, dim, device="cuda") * 2).to(dtype).requires_grad_()
    k = torch.randn(2, 300, 2, dim, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(2, 300, 2, dim, device="cuda", dtype=dtype, requires_grad=True)
    out, grads = grads_of(lambda q, k, v: winnow.entmax_attention(q, k, v, alpha=alpha), q, k, v)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, ref_grads = grads_of(lambda q, k, v: composed_entmax(q, k, v, alpha), *ref_in)
    assert rel(out, ref) < tol
    for g, r in zip(grads, ref_grads):
        assert rel(g, r) < tol


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 3e-2), (torch.float16, 1e-2)])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("filter", ["exact", "bound"])
def test_sieve_cuda_matches_composed(dtype, tol, dim, filter):
    torch.manual_seed(6)
    q = (torch.randn(2, 300, 8, dim, device="cuda") * 2).to(dtype).requires_grad_()
    k = torch.randn(2, 300, 2, dim, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(2, 300, 2, dim, device="cuda", dtype=dtype, requires_grad=True)
    fn = lambda q, k, v: winnow.sieve_attention(q, k, v, filter=filter)[:2]  # noqa: E731
    (out, rem), _ = fn(q, k, v), None
    _, grads = grads_of(fn, q, k, v)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_fn = lambda q, k, v: composed_sieve(q, k, v, filter=filter)[:2]  # noqa: E731
    ref_out, ref_rem = ref_fn(*ref_in)
    _, ref_grads = grads_of(ref_fn, *ref_in)
    assert rel(out, ref_out) < tol
    assert rel(rem, ref_rem) < tol
    count = winnow.sieve_attention(q, k, v, filter=filter)[2]
    ref_count = composed_sieve(*ref_in, filter=filter)[2]
    # Keys within rounding of the threshold may fall either way in bf16 / fp16.
    diff = (count.cpu() - ref_count.cpu()).abs().float()
    assert diff.mean() < 0.05 * ref_count.float().mean()
    for g, r in zip(grads, ref_grads):
        assert rel(g, r) < tol


# A short suffix of queries against a long cache: on CUDA the forward calls hand it to the
# split-KV decoding kernels (at most 8 queries a sequence, batched, no gradient wanted), every
# mechanism with its threshold found on them too; the same calls on the CPU kernels in float64
# on the same (bf16-rounded) inputs are the reference.
def _suffix_call(mechanism, q, k, v, q2, k2):
    f64 = q.dtype == torch.float64
    if mechanism == "softmax":
        return winnow.softmax_attention(q, k, v)
    if mechanism == "stick_breaking":
        return winnow.stick_breaking_attention(q, k, v)[:2]
    if mechanism in ("sieve_exact", "sieve_bound"):
        return winnow.sieve_attention(q, k, v, filter=mechanism.split("_")[1])[:2]
    if mechanism == "entmax15":
        return winnow.entmax_attention(q, k, v, alpha=1.5)
    beta = torch.full((q.shape[2],), 0.5, dtype=torch.float64 if f64 else torch.float32, device=q.device)
    if mechanism == "tra":
        return winnow.threshold_attention(q, k, v, beta)
    lam = torch.full((1,), 0.3, dtype=beta.dtype, device=q.device)
    return winnow.threshold_attention(q, k, v, beta, lam=lam, q2=q2, k2=k2)


@pytest.mark.parametrize("mechanism", ["softmax", "stick_breaking", "sieve_exact", "sieve_bound", "entmax15",
                                       "tra", "tda"])
@pytest.mark.parametrize("q_len", [1, 3])
def test_short_suffix_decoding_matches_cpu(mechanism, q_len):
    torch.manual_seed(12)
    b, lk, hq, hkv, d = 2, 1500, 8, 2, 128
    q, q2 = ((torch.randn(b, q_len, hq, d) * 2).to(torch.bfloat16) for _ in range(2))
    k, k2, v = (torch.randn(b, lk, hkv, d).to(torch.bfloat16) for _ in range(3))
    with torch.no_grad():
        got = _suffix_call(mechanism, *(t.cuda() for t in (q, k, v, q2, k2)))
        want = _suffix_call(mechanism, *(t.double() for t in (q, k, v, q2, k2)))
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    for g in got:
        assert g.is_cuda and torch.isfinite(g.float()).all()
    assert got[0].shape == want[0].shape and rel(got[0].cpu(), want[0]) < 3e-2
    if len(got) > 1:  # the remainder, in [0, 1], here mostly near 0: an absolute bound
        assert got[1].shape == want[1].shape
        assert (got[1].cpu().double() - want[1]).abs().max().item() < 1e-2


# The int8 screen's forward (WINNOW_THRESHOLD_SCREEN, Hopper): its own normalization and
# quantization kernels, the screen, the candidate pass and the dense tiles' forward. At beta 1
# most warps' tiles hold a few candidates, at 0.7 some tiles are dense, at 0.2 nearly all. Out
# and every gradient (the backward from the rows the screen's normalization saved) match the
# unscreened forward's, and the output the CPU kernels' in float64. Awkward shapes: a batched
# 1100-row sequence with 4 query heads on 2 kv heads, and packed sequences of 700, 0 and 390
# queries on 520 keys.
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 5e-3)])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("tda", [False, True])
@pytest.mark.parametrize("beta", [1.0, 0.7, 0.2])
@pytest.mark.parametrize("packed", [False, True])
def test_screened_threshold_forward_matches_unscreened(dtype, tol, dim, tda, beta, packed, capfd):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the int8 screen runs on Hopper only")
    gen = torch.Generator().manual_seed(31)
    if packed:
        seqs = [(700, 700), (0, 0), (390, 520)]
        cu_q = torch.tensor([0, 700, 700, 1090], dtype=torch.int32)
        cu_k = torch.tensor([0, 700, 700, 1220], dtype=torch.int32)
        shape_q, shape_k = (sum(s[0] for s in seqs), 4, dim), (sum(s[1] for s in seqs), 2, dim)
        offsets = {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}
    else:
        shape_q, shape_k = (1, 1100, 4, dim), (1, 1100, 2, dim)
        offsets = {}
    q, q2 = (torch.randn(shape_q, generator=gen).to(dtype) for _ in range(2))
    k, k2, v = (torch.randn(shape_k, generator=gen).to(dtype) for _ in range(3))
    beta_t = torch.full((4,), beta)
    lam = torch.full((1,), 0.4)

    def call(inputs, extra, offs):
        q, k, v, q2, k2 = inputs
        b, lm = extra
        if tda:
            return winnow.threshold_attention(q, k, v, b, lam=lm, q2=q2, k2=k2, **offs)
        return winnow.threshold_attention(q, k, v, b, **offs)

    def run(screen):
        inputs = [t.cuda().requires_grad_() for t in (q, k, v, q2, k2)]
        extra = [t.cuda().requires_grad_() for t in (beta_t, lam)]
        offs = {name: o.cuda() for name, o in offsets.items()}
        os.environ["WINNOW_SCREEN_STATS"] = "1"
        if screen:
            os.environ["WINNOW_THRESHOLD_SCREEN"] = "1"
        try:
            out = call(inputs, extra, offs)
        finally:
            os.environ.pop("WINNOW_THRESHOLD_SCREEN", None)
            del os.environ["WINNOW_SCREEN_STATS"]
        used = inputs[:3] + (inputs[3:] if tda else []) + extra[:1] + (extra[1:] if tda else [])
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out)
        return out, torch.autograd.grad(out, used, w)

    out, grads = run(screen=True)
    assert "winnow screen:" in capfd.readouterr().err  # the screen ran
    dense_out, dense_grads = run(screen=False)
    assert "winnow screen:" not in capfd.readouterr().err
    assert torch.isfinite(out.float()).all()
    assert rel(out, dense_out) < tol
    for g, d in zip(grads, dense_grads):
        assert rel(g, d) < tol
    with torch.no_grad():
        want = call([t.double() for t in (q, k, v, q2, k2)], [beta_t.double(), lam.double()], offsets)
    assert rel(out.cpu(), want) < tol


def test_rms_norm_cuda_into_bfloat16_matches_composed():
    torch.manual_seed(7)
    x = (3 * torch.randn(4, 33, 256, device="cuda")).requires_grad_()
    w = torch.randn(256, device="cuda", requires_grad=True)
    y = winnow.rms_norm(x, w, 1e-6, out_dtype=torch.bfloat16)
    xf, wf = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    expected = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * wf
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), expected, rtol=1e-2, atol=1e-2)
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, w), dy)
    want = torch.autograd.grad(expected, (xf, wf), dy.double())
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32
    for g, e in zip(got, want):
        torch.testing.assert_close(g.double(), e, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ GSA

# Awkward lengths: batched, two sequences of 37 queries (a suffix) over 129 keys; packed, 37 over
# 37, an empty sequence (0 over 5) and 129 over 160.
GSA_BATCHED = (2, 37, 129)
GSA_PACKED = [(37, 37), (0, 5), (129, 160)]


def gsa_offsets(seqs, device):
    cu_q, cu_k = [0], [0]
    for lq, lk in seqs:
        cu_q.append(cu_q[-1] + lq)
        cu_k.append(cu_k[-1] + lk)
    return (torch.tensor(cu_q, dtype=torch.int32, device=device),
            torch.tensor(cu_k, dtype=torch.int32, device=device))


def gsa_indexer_inputs(layout, dtype, gen, heads=4, d=64):
    """Indexer inputs rounded to dtype (q, k, head weights) and a float32 bias."""
    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)
    if layout == "batched":
        b, lq, lk = GSA_BATCHED
        rows_q, rows_k = (b, lq), (b, lk)
    else:
        rows_q, rows_k = (sum(s[0] for s in GSA_PACKED),), (sum(s[1] for s in GSA_PACKED),)
    return (rnd(*rows_q, heads, d), rnd(*rows_k, 1, d), rnd(*rows_q, heads),
            0.5 * torch.randn(heads, generator=gen))


def gsa_sequences(layout):
    """Each sequence's (query rows, key rows) as index pairs into the batch (batched) or into
    the packed rows: x[qs] is (1, Lq, ...) either way."""
    if layout == "batched":
        return [((slice(b, b + 1),), (slice(b, b + 1),)) for b in range(GSA_BATCHED[0])]
    out, q0, k0 = [], 0, 0
    for lq, lk in GSA_PACKED:
        out.append(((None, slice(q0, q0 + lq)), (None, slice(k0, k0 + lk))))
        q0, k0 = q0 + lq, k0 + lk
    return out


def check_top_k(indices, counts, scores, slack):
    """Rows of a valid selection: counts[t] strictly increasing visible positions, -1 after
    them, and no left-out visible key scoring more than `slack` above a selected one."""
    k_max, lk = indices.shape[-1], scores.shape[-1]
    slots = torch.arange(k_max)
    live = slots[None, :] < counts[:, None].long()
    assert (indices[~live] == -1).all()
    visible = torch.isfinite(scores)
    t = visible.sum(-1) - 1
    assert ((indices <= t[:, None]) | ~live).all() and ((indices >= 0) | ~live).all()
    steps = indices[:, 1:] - indices[:, :-1]
    assert ((steps > 0) | ~live[:, 1:]).all()
    chosen = list_mask(indices[None], lk)[0]
    assert torch.equal(chosen.sum(-1), counts.long())
    lowest = torch.where(chosen, scores, torch.full_like(scores, math.inf)).min(-1).values
    left = torch.where(visible & ~chosen, scores, torch.full_like(scores, -math.inf)).max(-1).values
    assert (lowest >= left - slack).all(), float((left - lowest).max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", ["batched", "packed"])
@pytest.mark.parametrize("budget", ["fixed", "inverse_variance"])
@pytest.mark.parametrize("form", ["sigmoid", "relu"])
def test_gsa_select_keys_cuda_matches_cpu(dtype, layout, budget, form):
    """The indexer on CUDA against the CPU kernels run in float32 on the same dtype-rounded
    values: the variance to float32 rounding, the same list lengths (all of them with a fixed
    budget; with the adaptive one all but rows whose budget sits on a rounding boundary), the
    same lists in nearly every row, and on CUDA a valid top-k of the float64 scores."""
    gen = torch.Generator().manual_seed(40)
    q, k, w, bias = gsa_indexer_inputs(layout, dtype, gen)
    bias = bias if form == "sigmoid" else None

    def select(device, **options):
        extra = {}
        if layout == "packed":
            extra = dict(zip(("cu_seqlens_q", "cu_seqlens_k"), gsa_offsets(GSA_PACKED, device)))
        cast = (lambda t: t.float()) if device == "cpu" else (lambda t: t)
        out = winnow.gsa_select_keys(cast(q).to(device), cast(k).to(device), cast(w).to(device),
                                     None if bias is None else bias.to(device), form=form,
                                     **extra, **options)
        assert out[0].device.type == device and out[0].dtype == torch.int32
        assert out[2].dtype == torch.float32
        return [t.cpu() for t in out]

    options = dict(k_max=24, budget="fixed", k_fixed=16)
    if budget != "fixed":  # budgets around k_base = 8 at the rows' median variance
        median = float(select("cpu", **options)[2].median())
        options = dict(k_max=24, k_base=8, k_min=4, mean_variance=median, budget=budget)
    (ci, cc, cv), (gi, gc, gv) = select("cpu", **options), select("cuda", **options)
    assert gi.shape == ci.shape and gc.shape == cc.shape and gv.shape == cv.shape
    torch.testing.assert_close(gv, cv, rtol=1e-4, atol=1e-7)
    if budget == "fixed":
        assert torch.equal(gc, cc)
    else:
        assert (gc == cc).float().mean() > 0.99 and (gc - cc).abs().max() <= 1
        assert cc.min() < cc.max()  # the budget adapts
    same_rows = (gi == ci).all(-1)
    assert same_rows.float().mean() > 0.98, f"{int((~same_rows).sum())} rows differ"
    # The CUDA lists against float64 scores of the same values.
    flat_i, flat_c = gi.reshape(-1, gi.shape[-1]), gc.reshape(-1)
    row = 0
    for qs, ks in gsa_sequences(layout):
        qq, kk, ww = q[qs].double(), k[ks].double(), w[qs].double()
        lq, lk = qq.shape[1], kk.shape[1]
        if lq == 0:
            continue
        scores = composed_gsa_scores(qq, kk, ww, bias, form)[0]
        scores = torch.cat([scores, torch.full((lq, 160 - lk), -math.inf, dtype=scores.dtype)], -1)
        check_top_k(flat_i[row:row + lq], flat_c[row:row + lq], scores, slack=1e-4)
        row += lq
    assert row == flat_c.numel()


def gsa_sparse_problem(layout, gen, k_max=24):
    """q, k, v (8 query heads over 2 kv heads: 4 per kv head) in float64, the offsets (packed),
    and lists selected on the CPU in float64 with an adaptive budget, one of them emptied."""
    iq, ik, iw, ib = (t.double() for t in gsa_indexer_inputs(layout, torch.float64, gen, d=16))
    extra = {}
    if layout == "batched":
        b, lq, lk = GSA_BATCHED
        shape_q, shape_k = (b, lq), (b, lk)
    else:
        extra = dict(zip(("cu_seqlens_q", "cu_seqlens_k"), gsa_offsets(GSA_PACKED, "cpu")))
        shape_q, shape_k = (iq.shape[0],), (ik.shape[0],)
    median = float(winnow.gsa_select_keys(iq, ik, iw, ib, k_max=k_max, budget="fixed",
                                          **extra)[2].median())
    indices, counts, _ = winnow.gsa_select_keys(iq, ik, iw, ib, k_max=k_max, k_base=k_max // 2,
                                                k_min=4, mean_variance=median, **extra)
    counts.view(-1)[5] = 0  # an empty list: zero output
    q = torch.randn(*shape_q, 8, 64, generator=gen, dtype=torch.float64)
    k = torch.randn(*shape_k, 2, 64, generator=gen, dtype=torch.float64)
    v = torch.randn(*shape_k, 2, 64, generator=gen, dtype=torch.float64)
    return q, k, v, indices, counts, extra


@pytest.mark.parametrize("dtype,d,tol", [(torch.bfloat16, 64, 3e-2), (torch.float32, 16, 1e-4)])
@pytest.mark.parametrize("layout", ["batched", "packed"])
def test_gsa_sparse_attention_cuda_matches_cpu(dtype, d, tol, layout):
    """Output and every gradient on CUDA against the CPU kernels in float32 on the same
    dtype-rounded values, with the same lists: grouped-query heads, queries a suffix of their
    keys (batched) or packed sequences with an empty one, an empty list; head dimension 64 in
    bf16 and 16 in float32. Trusted lists give the same output."""
    gen = torch.Generator().manual_seed(41)
    q, k, v, indices, counts, extra = gsa_sparse_problem(layout, gen)
    q, k, v = (t[..., :d].to(dtype) for t in (q, k, v))
    dout = torch.randn(q.shape, generator=gen).to(dtype)
    results = []
    for device in ("cpu", "cuda"):
        leaves = [t.to(device).float().detach().clone().requires_grad_() for t in (q, k, v)]
        inputs = [t.to(dtype) if device == "cuda" else t for t in leaves]
        lists = (indices.to(device), counts.to(device))
        offsets = {name: t.to(device) for name, t in extra.items()}
        out = winnow.gsa_sparse_attention(*inputs, *lists, **offsets)
        assert out.dtype == inputs[0].dtype and out.shape == q.shape
        out.backward(dout.to(device=device, dtype=out.dtype))
        if device == "cuda":
            trusted = winnow.gsa_sparse_attention(*(t.detach() for t in inputs), *lists, **offsets,
                                                  trusted=True)
            assert torch.equal(trusted, out.detach())
        results.append([out.detach().float().cpu()] + [t.grad.float().cpu() for t in leaves])
    assert (results[1][0].reshape(-1, *q.shape[-2:])[5] == 0).all()  # the empty list
    for name, got, want in zip(["out", "dq", "dk", "dv"], results[1], results[0]):
        scale = want.abs().max().clamp_min(1e-6)
        error = ((got - want).abs().max() / scale).item()
        assert error < tol, f"{name}: {error}"


def test_gsa_sparse_deterministic_backward_repeats_bitwise():
    gen = torch.Generator().manual_seed(42)
    q, k, v, indices, counts, _ = gsa_sparse_problem("batched", gen, k_max=32)
    q, k, v = (t.to("cuda", torch.bfloat16).requires_grad_() for t in (q, k, v))
    indices, counts = indices.cuda(), counts.cuda()
    torch.use_deterministic_algorithms(True)
    try:
        runs = [grads_of(lambda q, k, v: winnow.gsa_sparse_attention(q, k, v, indices, counts),
                         q, k, v)[1] for _ in range(2)]
    finally:
        torch.use_deterministic_algorithms(False)
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_gsa_sparse_cuda_refuses_bad_lists_naming_the_argument():
    gen = torch.Generator().manual_seed(43)
    q, k, v, indices, counts, _ = gsa_sparse_problem("batched", gen)
    q, k, v = (t.to("cuda", torch.float32) for t in (q, k, v))
    future = indices.clone()
    future[1, 3, 0] = 129 - 37 + 4  # query 3 of the second sequence sits at position 95
    with pytest.raises(ValueError, match="argument 'indices'"):
        winnow.gsa_sparse_attention(q, k, v, future.cuda(), counts.cuda())
    with pytest.raises(ValueError, match="argument 'counts'"):
        winnow.gsa_sparse_attention(q, k, v, indices.cuda(), (counts + 100).cuda())


@pytest.mark.parametrize("mechanism", ["softmax", "stick_breaking"])
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-5)])
def test_paged_decode_cuda_matches_cpu(mechanism, dtype, tol):
    from test_ops import paged_problem
    q, kc, vc, table, lens, _ = paged_problem([1, 700, 3000], lq=1, hq=8, hkv=2, d=128, page_size=16,
                                              dtype=torch.float32)
    q, kc, vc = (t.to(dtype) for t in (q, kc, vc))
    want, want_stat = winnow.paged_decode(q.double(), kc.double(), vc.double(), table, lens, mechanism=mechanism)
    out, stat = winnow.paged_decode(q.cuda(), kc.cuda(), vc.cuda(), table.cuda(), lens.cuda(), mechanism=mechanism)
    assert (out.double().cpu() - want).norm() / want.norm() < tol
    assert (stat.double().cpu() - want_stat).norm() / want_stat.norm() < tol
    compiled = torch.compile(lambda *a: winnow.paged_decode(*a, mechanism=mechanism, trusted=True), fullgraph=True)
    again, _ = compiled(q.cuda(), kc.cuda(), vc.cuda(), table.cuda(), lens.cuda())
    assert torch.equal(again, out)
