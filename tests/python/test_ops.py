"""The Python package: loading, the operators against composed PyTorch expressions written
from the spec, float64 gradcheck (finite differences) through autograd, and error messages."""

import math

import pytest
import torch

import winnow


def composed_stick_breaking(q, k, v, attend_current=False):
    """log A_ij = z_ij - sum_{k >= i visible} softplus(z_kj), on (B, L, H, D) tensors."""
    group = q.shape[2] // k.shape[2]
    qh = q.transpose(1, 2)
    kh = k.repeat_interleave(group, 2).transpose(1, 2)
    vh = v.repeat_interleave(group, 2).transpose(1, 2)
    lq, lk = q.shape[1], k.shape[1]
    z = qh @ kh.transpose(-1, -2) / math.sqrt(q.shape[-1])
    pos_q = torch.arange(lq, device=q.device) + (lk - lq)
    pos_k = torch.arange(lk, device=q.device)
    visible = pos_k[None, :] <= pos_q[:, None] if attend_current else pos_k[None, :] < pos_q[:, None]
    cost = torch.where(visible, torch.nn.functional.softplus(z), torch.zeros_like(z))
    suffix = cost.flip(-1).cumsum(-1).flip(-1)
    w = torch.where(visible, torch.exp(z - suffix), torch.zeros_like(z))
    return (w @ vh).transpose(1, 2), torch.exp(-cost.sum(-1)).transpose(1, 2)


def composed_softmax(q, k, v):
    group = q.shape[2] // k.shape[2]
    qh = q.transpose(1, 2)
    kh = k.repeat_interleave(group, 2).transpose(1, 2)
    vh = v.repeat_interleave(group, 2).transpose(1, 2)
    lq, lk = q.shape[1], k.shape[1]
    z = qh @ kh.transpose(-1, -2) / math.sqrt(q.shape[-1])
    visible = (torch.arange(lk, device=q.device)[None, :]
               <= (torch.arange(lq, device=q.device) + lk - lq)[:, None])
    z = z.masked_fill(~visible, float("-inf"))
    return (torch.softmax(z, -1) @ vh).transpose(1, 2)


def visible_mask(lq, lk, attend_current, device="cpu"):
    pos_q = torch.arange(lq, device=device) + (lk - lq)
    pos_k = torch.arange(lk, device=device)
    return pos_k[None, :] <= pos_q[:, None] if attend_current else pos_k[None, :] < pos_q[:, None]


def scores(q, k):
    group = q.shape[2] // k.shape[2]
    kh = k.repeat_interleave(group, 2).transpose(1, 2)
    return q.transpose(1, 2) @ kh.transpose(-1, -2) / math.sqrt(q.shape[-1])


def entmax_threshold(x, alpha, visible):
    """tau with sum_i max(x_i - tau, 0)^(1 / (alpha - 1)) = 1 over visible keys, by bisection
    on [max - 1, max] (float64, 200 halvings: exact to rounding); x = (alpha - 1) z."""
    x = x.masked_fill(~visible, float("-inf"))
    hi = x.max(-1, keepdim=True).values
    lo = hi - 1
    for _ in range(200):
        mid = (lo + hi) / 2
        f = torch.clamp(x - mid, min=0).pow(1 / (alpha - 1)).sum(-1, keepdim=True)
        lo, hi = torch.where(f >= 1, mid, lo), torch.where(f >= 1, hi, mid)
    return lo


def composed_entmax(q, k, v, alpha=1.5, attend_current=True):
    """alpha-entmax weights p_i = ((alpha - 1) z_i - tau)_+^(1 / (alpha - 1)); differentiable
    for alpha 1.5 and 2 (forward only otherwise)."""
    group = q.shape[2] // k.shape[2]
    vh = v.repeat_interleave(group, 2).transpose(1, 2)
    x = (alpha - 1) * scores(q, k)
    visible = visible_mask(q.shape[1], k.shape[1], attend_current, q.device)
    tau = entmax_threshold(x.detach(), alpha, visible)
    if alpha in (1.5, 2.0):
        # On the support S the threshold has a closed form, which autograd differentiates:
        # alpha = 2: sum_S (x - tau) = 1; alpha = 1.5: sum_S (x - tau)^2 = 1 (the larger x root).
        support = visible & (x.detach() > tau)
        n = support.sum(-1, keepdim=True).to(x.dtype)
        s1 = torch.where(support, x, torch.zeros_like(x)).sum(-1, keepdim=True)
        if alpha == 2.0:
            tau = (s1 - 1) / n.clamp(min=1)
        else:
            s2 = torch.where(support, x * x, torch.zeros_like(x)).sum(-1, keepdim=True)
            disc = (s1 * s1 - n * (s2 - 1)).clamp(min=0)
            tau = (s1 - disc.sqrt()) / n.clamp(min=1)
    w = torch.where(visible, torch.clamp(x - tau, min=0).pow(1 / (alpha - 1)), torch.zeros_like(x))
    return (w @ vh).transpose(1, 2)


def composed_sieve(q, k, v, alpha=1.5, filter="exact", eps=None, attend_current=False):
    """Stick-breaking over the candidates: the entmax support (exact) or the keys within eps of
    the row maximum (bound). Returns (out, rem, count)."""
    group = q.shape[2] // k.shape[2]
    vh = v.repeat_interleave(group, 2).transpose(1, 2)
    z = scores(q, k)
    visible = visible_mask(q.shape[1], k.shape[1], attend_current, q.device)
    if filter == "exact":
        threshold = entmax_threshold((alpha - 1) * z, alpha, visible) / (alpha - 1)
    else:
        eps = 1 / (alpha - 1) if eps is None else eps
        threshold = z.masked_fill(~visible, float("-inf")).max(-1, keepdim=True).values - eps
    kept = visible & (z > threshold)
    cost = torch.where(kept, torch.nn.functional.softplus(z), torch.zeros_like(z))
    suffix = cost.flip(-1).cumsum(-1).flip(-1)
    w = torch.where(kept, torch.exp(z - suffix), torch.zeros_like(z))
    return ((w @ vh).transpose(1, 2), torch.exp(-cost.sum(-1)).transpose(1, 2),
            kept.sum(-1).transpose(1, 2).to(torch.int32))


def test_library_is_loaded():
    assert winnow.library_path.is_file()
    assert hasattr(torch.ops.winnow, "stick_breaking_attention")


@pytest.mark.parametrize("attend_current", [False, True])
def test_stick_breaking_matches_composed(attend_current):
    torch.manual_seed(0)
    q = torch.randn(2, 19, 4, 16, dtype=torch.float64)
    k = torch.randn(2, 50, 2, 16, dtype=torch.float64)  # queries are the last 19 positions
    v = torch.randn(2, 50, 2, 8, dtype=torch.float64)
    out, rem = winnow.stick_breaking_attention(q, k, v, attend_current=attend_current)
    ref_out, ref_rem = composed_stick_breaking(q, k, v, attend_current)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(rem, ref_rem, rtol=1e-12, atol=1e-12)


def test_stick_breaking_float32_close_to_float64():
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 130, 2, 64) for _ in range(3))
    out, rem = winnow.stick_breaking_attention(q, k, v)
    ref_out, ref_rem = composed_stick_breaking(q.double(), k.double(), v.double())
    assert (out.double() - ref_out).norm() / ref_out.norm() < 1e-5
    assert (rem.double() - ref_rem).norm() / ref_rem.norm() < 1e-5


def test_softmax_matches_composed():
    torch.manual_seed(2)
    q = torch.randn(3, 40, 6, 32, dtype=torch.float64)
    k = torch.randn(3, 40, 3, 32, dtype=torch.float64)
    v = torch.randn(3, 40, 3, 16, dtype=torch.float64)
    torch.testing.assert_close(winnow.softmax_attention(q, k, v), composed_softmax(q, k, v),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("attend_current", [False, True])
def test_stick_breaking_gradcheck(attend_current):
    torch.manual_seed(3)
    q = torch.randn(1, 7, 2, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 9, 1, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 9, 1, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda q, k, v: winnow.stick_breaking_attention(q, k, v, attend_current=attend_current),
        (q, k, v))


def test_softmax_gradcheck_varlen():
    torch.manual_seed(4)
    q = torch.randn(9, 2, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(9, 2, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(9, 2, 3, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, 4, 4, 9], dtype=torch.int32)
    assert torch.autograd.gradcheck(
        lambda q, k, v: winnow.softmax_attention(q, k, v, cu_seqlens_q=cu), (q, k, v))


def test_stick_breaking_gradcheck_varlen_suffix_queries():
    torch.manual_seed(5)
    q = torch.randn(12, 1, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(20, 1, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(20, 1, 3, dtype=torch.float64, requires_grad=True)
    cu_q = torch.tensor([0, 5, 12], dtype=torch.int32)
    cu_k = torch.tensor([0, 8, 20], dtype=torch.int32)
    assert torch.autograd.gradcheck(
        lambda q, k, v: winnow.stick_breaking_attention(
            q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, halt_cutoff=3.0),
        (q, k, v))


def test_bad_arguments_raise_value_errors_naming_them():
    q = torch.randn(1, 8, 2, 16)
    k = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match="argument 'v'.*expected"):
        winnow.stick_breaking_attention(q, k, torch.randn(1, 7, 2, 16))
    with pytest.raises(ValueError, match="argument 'halt_cutoff'"):
        winnow.stick_breaking_attention(q, k, k, halt_cutoff=-1.0)
    with pytest.raises(ValueError, match="argument 'cu_seqlens_q'"):
        winnow.softmax_attention(q[0], k[0], k[0], cu_seqlens_q=torch.tensor([0, 3], dtype=torch.int32))


def test_no_visible_key_gives_zero_and_no_nan():
    q = torch.randn(1, 1, 1, 8, requires_grad=True)
    out, rem = winnow.stick_breaking_attention(q, q, q)
    assert torch.equal(out.detach(), torch.zeros_like(out))
    assert rem.item() == 1.0
    (out.sum() + rem.sum()).backward()
    assert torch.isfinite(q.grad).all()


@pytest.mark.parametrize("alpha", [1.5, 2.0, 1.3])
def test_entmax_matches_composed(alpha):
    torch.manual_seed(6)
    q = torch.randn(2, 23, 4, 16, dtype=torch.float64) * 2
    k = torch.randn(2, 41, 2, 16, dtype=torch.float64)
    v = torch.randn(2, 41, 2, 8, dtype=torch.float64)
    out = winnow.entmax_attention(q, k, v, alpha=alpha)
    torch.testing.assert_close(out, composed_entmax(q, k, v, alpha), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("filter,eps", [("exact", None), ("bound", None), ("bound", 0.7)])
def test_sieve_matches_composed(filter, eps):
    torch.manual_seed(7)
    q = torch.randn(2, 23, 4, 16, dtype=torch.float64) * 2
    k = torch.randn(2, 41, 2, 16, dtype=torch.float64)
    v = torch.randn(2, 41, 2, 8, dtype=torch.float64)
    out, rem, count = winnow.sieve_attention(q, k, v, filter=filter, eps=eps)
    ref_out, ref_rem, ref_count = composed_sieve(q, k, v, filter=filter, eps=eps)
    torch.testing.assert_close(out, ref_out, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(rem, ref_rem, rtol=1e-9, atol=1e-9)
    assert torch.equal(count, ref_count)
    assert count.dtype == torch.int32 and 0 < count.max() < 41  # a real selection


@pytest.mark.parametrize("alpha", [1.5, 2.0])
def test_entmax_gradients_match_composed(alpha):
    torch.manual_seed(10)
    q = (torch.randn(1, 30, 2, 8, dtype=torch.float64) * 2).requires_grad_()
    k = torch.randn(1, 30, 1, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 30, 1, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(1, 30, 2, 5, dtype=torch.float64)
    grads = torch.autograd.grad((winnow.entmax_attention(q, k, v, alpha=alpha) * w).sum(), (q, k, v))
    ref = torch.autograd.grad((composed_entmax(q, k, v, alpha) * w).sum(), (q, k, v))
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r, rtol=1e-8, atol=1e-9)


def test_entmax_gradcheck_varlen():
    torch.manual_seed(8)
    q = torch.randn(11, 2, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(11, 1, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(11, 1, 3, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, 5, 11], dtype=torch.int32)
    assert torch.autograd.gradcheck(
        lambda q, k, v: winnow.entmax_attention(q * 3, k, v, cu_seqlens_q=cu, alpha=1.5), (q, k, v))


@pytest.mark.parametrize("filter", ["exact", "bound"])
def test_sieve_gradcheck(filter):
    torch.manual_seed(9)
    q = torch.randn(1, 9, 2, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 12, 1, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 12, 1, 3, dtype=torch.float64, requires_grad=True)
    # (out, rem): the count is an integer output with no gradient.
    assert torch.autograd.gradcheck(
        lambda q, k, v: winnow.sieve_attention(q * 3, k, v, filter=filter)[:2], (q, k, v))


def test_entmax_and_sieve_bad_options_name_the_argument():
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match="argument 'alpha'"):
        winnow.entmax_attention(q, q, q, alpha=1.0)
    with pytest.raises(ValueError, match="argument 'alpha'"):
        winnow.sieve_attention(q, q, q, alpha=float("nan"))
    with pytest.raises(ValueError, match="argument 'filter'"):
        winnow.sieve_attention(q, q, q, filter="top-k")
    with pytest.raises(ValueError, match="argument 'eps'"):
        winnow.sieve_attention(q, q, q, eps=0.5)  # eps belongs to the bound filter
    with pytest.raises(ValueError, match="argument 'eps'"):
        winnow.sieve_attention(q, q, q, filter="bound", eps=-1.0)


def rope_tables(length, half, dtype, scale=1.0):
    angles = torch.arange(length, dtype=torch.float64)[:, None] * torch.pow(
        10000.0, -torch.arange(half, dtype=torch.float64) / half)[None, :]
    return (scale * angles.cos()).to(dtype), (scale * angles.sin()).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rotary_embedding_matches_composed(dtype):
    torch.manual_seed(3)
    x = torch.randn(2, 7, 3, 12, dtype=dtype)
    cos, sin = rope_tables(7, 6, dtype, scale=1.1)
    low, high = x[..., :6], x[..., 6:]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    expected = torch.cat([low * c - high * s, high * c + low * s], -1)
    tol = 1e-14 if dtype == torch.float64 else 1e-6
    assert torch.allclose(winnow.rotary_embedding(x, cos, sin), expected, atol=tol, rtol=tol)
    # The transpose undoes the rotation (unit-scale tables).
    cos1, sin1 = rope_tables(7, 6, dtype)
    y = winnow.rotary_embedding(x, cos1, sin1)
    assert torch.allclose(winnow.rotary_embedding(y, cos1, sin1, transpose=True), x, atol=tol, rtol=tol)


def test_rotary_embedding_gradcheck():
    torch.manual_seed(4)
    x = torch.randn(1, 5, 2, 8, dtype=torch.float64, requires_grad=True)
    cos, sin = rope_tables(5, 4, torch.float64, scale=0.9)
    assert torch.autograd.gradcheck(lambda t: winnow.rotary_embedding(t, cos, sin), (x,))


def test_rotary_embedding_bad_tables_name_the_argument():
    x = torch.randn(1, 5, 2, 8)
    cos, sin = rope_tables(4, 4, torch.float32)
    with pytest.raises(ValueError, match="argument 'cos': expected \\(5, 4\\) float32"):
        winnow.rotary_embedding(x, cos, sin)


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    low, high = x[..., :half], x[..., half:]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat([low * c - high * s, high * c + low * s], -1)


@pytest.mark.parametrize("layout", ["suffix_queries", "one_projection"])
def test_softmax_rotary_inside_equals_rotating_first(layout):
    torch.manual_seed(5)
    d, hq, hkv = 8, 4, 2
    if layout == "suffix_queries":
        lq, lk = 6, 11
        q = torch.randn(2, lq, hq, d, dtype=torch.float64, requires_grad=True)
        k = torch.randn(2, lk, hkv, d, dtype=torch.float64, requires_grad=True)
        v = torch.randn(2, lk, hkv, d, dtype=torch.float64, requires_grad=True)
        leaves = (q, k, v)
    else:
        lq = lk = 9
        qkv = torch.randn(2, lk, (hq + 2 * hkv) * d, dtype=torch.float64, requires_grad=True)
        q, k, v = (t.view(2, lk, -1, d) for t in qkv.split([hq * d, hkv * d, hkv * d], -1))
        leaves = (qkv,)
    cos, sin = rope_tables(lk, d // 2, torch.float64, scale=1.05)
    w = torch.randn(2, lq, hq, d, dtype=torch.float64)
    out = winnow.softmax_attention(q, k, v, rotary=(cos, sin))
    grads = torch.autograd.grad((out * w).sum(), (q, k, v), retain_graph=True)
    expected = winnow.softmax_attention(_rotate(q, cos[lk - lq:], sin[lk - lq:]), _rotate(k, cos, sin), v)
    want = torch.autograd.grad((expected * w).sum(), (q, k, v))
    assert torch.allclose(out, expected, atol=1e-12, rtol=1e-12)
    for got, ref in zip(grads, want):
        assert torch.allclose(got, ref, atol=1e-12, rtol=1e-12)
    if layout == "one_projection":
        # The gradients come back as views of one tensor, laid out as q, k and v were.
        assert all(g.storage().data_ptr() == grads[0].storage().data_ptr() for g in grads)
        assert [g.stride() for g in grads] == [t.stride() for t in (q, k, v)]
        (g_qkv,) = torch.autograd.grad((out * w).sum(), leaves)
        assert torch.allclose(g_qkv, torch.cat([g.flatten(2) for g in want], -1), atol=1e-12, rtol=1e-12)
    if layout == "suffix_queries":
        assert torch.autograd.gradcheck(
            lambda a, b, c: winnow.softmax_attention(a, b, c, rotary=(cos, sin)), leaves)
    else:
        def split(t):
            return (x.view(2, lk, -1, d) for x in t.split([hq * d, hkv * d, hkv * d], -1))
        assert torch.autograd.gradcheck(
            lambda t: winnow.softmax_attention(*split(t), rotary=(cos, sin)), leaves)


def test_softmax_rotary_bad_arguments_name_them():
    q = torch.randn(1, 5, 2, 8)
    cos, sin = rope_tables(5, 4, torch.float32)
    with pytest.raises(ValueError, match="argument 'rotary_sin'"):
        torch.ops.winnow.softmax_attention(q, q, q, rotary_cos=cos)
    with pytest.raises(ValueError, match="argument 'rotary_cos': expected \\(Lk, D/2\\) with Lk = 5 and D = 8"):
        winnow.softmax_attention(q, q, q, rotary=rope_tables(4, 4, torch.float32))
    with pytest.raises(ValueError, match="argument 'rotary_cos': expected \\(Lk, D/2\\)"):
        winnow.softmax_attention(q, q, q, rotary=rope_tables(5, 3, torch.float32))
    with pytest.raises(ValueError, match="argument 'rotary_sin': expected the shape"):
        winnow.softmax_attention(q, q, q, rotary=(cos, sin[:4]))
    with pytest.raises(ValueError, match="argument 'cos': expected \\(5, 4\\) float32"):
        winnow.softmax_attention(q, q, q, rotary=rope_tables(5, 4, torch.float64))
    packed = torch.randn(5, 2, 8)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="argument 'cu_seqlens_q'"):
        winnow.softmax_attention(packed, packed, packed, cu_seqlens_q=cu, rotary=(cos, sin))


def composed_rms_norm(x, weight, eps):
    xf = x.double()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rms_norm_matches_composed(dtype):
    torch.manual_seed(5)
    x = (3 * torch.randn(3, 5, 19, dtype=dtype)).requires_grad_()
    w = torch.randn(19, dtype=dtype, requires_grad=True)
    y = winnow.rms_norm(x, w, 1e-5)
    expected = composed_rms_norm(x, w, 1e-5)
    tol = 1e-13 if dtype == torch.float64 else 2e-6
    assert y.dtype == dtype and y.shape == x.shape
    torch.testing.assert_close(y.double(), expected, rtol=tol, atol=tol)
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, w), dy)
    want = torch.autograd.grad(expected, (x, w), dy.double())
    for g, e in zip(got, want):
        torch.testing.assert_close(g.double(), e.double(), rtol=tol * 5, atol=tol * 5)


def test_rms_norm_gradcheck():
    torch.manual_seed(6)
    x = torch.randn(4, 7, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: winnow.rms_norm(a, b, 1e-3), (x, w))


def test_rms_norm_bad_arguments_name_them():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="argument 'weight': expected float32 \\(8\\)"):
        winnow.rms_norm(x, torch.ones(7))
    with pytest.raises(NotImplementedError, match="argument 'y': expected float32 \\(x's dtype\\) on the CPU"):
        winnow.rms_norm(x, torch.ones(8), out_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="argument 'x': expected a tensor of at least 1 dimension"):
        winnow.rms_norm(torch.tensor(1.0), torch.ones(1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("sum_used", [False, True])
def test_add_rms_norm_matches_composed(dtype, sum_used):
    torch.manual_seed(15)
    x = (3 * torch.randn(3, 5, 19, dtype=dtype)).requires_grad_()
    r = torch.randn(3, 5, 19, dtype=dtype, requires_grad=True)
    w = torch.randn(19, dtype=dtype, requires_grad=True)
    s, y = winnow.add_rms_norm(x, r, w, 1e-5)
    s_want = x.double() + r.double()
    y_want = composed_rms_norm(s_want, w, 1e-5)
    tol = 1e-13 if dtype == torch.float64 else 2e-6
    assert s.dtype == dtype and y.dtype == dtype
    torch.testing.assert_close(s.double(), s_want, rtol=tol, atol=tol)
    torch.testing.assert_close(y.double(), y_want, rtol=tol, atol=tol)
    dy, ds = torch.randn_like(y), torch.randn_like(s)
    got_loss = (y * dy).sum() + ((s * ds).sum() if sum_used else 0)
    want_loss = (y_want * dy.double()).sum() + ((s_want * ds.double()).sum() if sum_used else 0)
    got = torch.autograd.grad(got_loss, (x, r, w))
    want = torch.autograd.grad(want_loss, (x, r, w))
    for g, e in zip(got, want):
        torch.testing.assert_close(g.double(), e.double(), rtol=tol * 5, atol=tol * 5)


def test_add_rms_norm_gradcheck_and_only_the_sum_used():
    torch.manual_seed(16)
    x = torch.randn(4, 7, dtype=torch.float64, requires_grad=True)
    r = torch.randn(4, 7, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c: winnow.add_rms_norm(a, b, c, 1e-3), (x, r, w))
    # Only the sum reaches the loss: x and residual get its gradient, the weight none.
    s, _ = winnow.add_rms_norm(x, r, w)
    gx, gr, gw = torch.autograd.grad(s.sum(), (x, r, w), allow_unused=True)
    torch.testing.assert_close(gx, torch.ones_like(x))
    torch.testing.assert_close(gr, torch.ones_like(r))
    assert gw is None or bool((gw == 0).all())


def test_add_rms_norm_bad_arguments_name_them():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="argument 'residual': expected x's shape"):
        winnow.add_rms_norm(x, torch.randn(4, 7), torch.ones(8))
    with pytest.raises(ValueError, match="argument 'residual': expected float32 \\(4, 8\\)"):
        winnow.add_rms_norm(x, torch.randn(4, 8, dtype=torch.float64), torch.ones(8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_swiglu_matches_composed(dtype):
    torch.manual_seed(8)
    gate = (4 * torch.randn(3, 5, 17, dtype=dtype)).requires_grad_()
    up = torch.randn(3, 5, 17, dtype=dtype, requires_grad=True)
    y = winnow.swiglu(gate, up)
    expected = torch.nn.functional.silu(gate.double()) * up.double()
    tol = 1e-14 if dtype == torch.float64 else 1e-6
    torch.testing.assert_close(y.double(), expected, rtol=tol, atol=tol)
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, (gate, up), dy)
    want = torch.autograd.grad(expected, (gate, up), dy.double())
    for g, e in zip(got, want):
        torch.testing.assert_close(g.double(), e.double(), rtol=tol * 5, atol=tol * 5)


def test_swiglu_gradcheck_and_bad_arguments():
    torch.manual_seed(9)
    gate = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    up = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(winnow.swiglu, (gate, up))
    with pytest.raises(ValueError, match="argument 'up': expected gate's shape"):
        winnow.swiglu(torch.randn(4, 6), torch.randn(4, 5))
    with pytest.raises(ValueError, match="argument 'up': expected float32 \\(4, 6\\)"):
        winnow.swiglu(torch.randn(4, 6), torch.randn(4, 6, dtype=torch.float64))


def test_version_is_the_projects():
    import pathlib
    import re
    cmake = (pathlib.Path(__file__).resolve().parents[2] / "CMakeLists.txt").read_text()
    assert winnow.__version__ == re.search(r"project\(winnow VERSION ([0-9.]+)", cmake).group(1)



def composed_threshold(q, k, v, beta, power=2.0, attend_current=True, eps=1e-6):
    """TRA from spec/threshold.md on (B, L, H, D) tensors: relu(cos - tau)^p, unnormalized."""
    group = q.shape[2] // k.shape[2]
    qh = q / q.norm(dim=-1, keepdim=True).clamp_min(eps)
    kh = k / k.norm(dim=-1, keepdim=True).clamp_min(eps)
    qh = qh.transpose(1, 2)
    kh = kh.repeat_interleave(group, 2).transpose(1, 2)
    vh = v.repeat_interleave(group, 2).transpose(1, 2)
    lq, lk, d = q.shape[1], k.shape[1], q.shape[-1]
    pos_q = torch.arange(lq) + (lk - lq)
    visible = (torch.arange(lk)[None, :] <= pos_q[:, None]) if attend_current else (
        torch.arange(lk)[None, :] < pos_q[:, None])
    n = visible.sum(-1).to(q.dtype)
    unit = torch.where(n > 1, torch.sqrt(2 * torch.log(n.clamp_min(1)) / d), torch.zeros_like(n))
    tau = beta.reshape(1, -1, 1, 1) * unit.reshape(1, 1, -1, 1)
    w = torch.relu(qh @ kh.transpose(-1, -2) - tau).pow(power)
    w = torch.where(visible, w, torch.zeros_like(w))
    return (w @ vh).transpose(1, 2)


@pytest.mark.parametrize("power", [1.0, 2.0])
def test_threshold_matches_composed_with_gradients(power):
    torch.manual_seed(12)
    q = torch.randn(2, 13, 4, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 17, 2, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 17, 2, 5, dtype=torch.float64, requires_grad=True)
    q2 = torch.randn(2, 13, 4, 8, dtype=torch.float64, requires_grad=True)
    k2 = torch.randn(2, 17, 2, 8, dtype=torch.float64, requires_grad=True)
    beta = torch.tensor([0.2, 0.5, 0.0, 0.8], dtype=torch.float64, requires_grad=True)
    lam = torch.tensor([0.3], dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 13, 4, 5, dtype=torch.float64)
    out = winnow.threshold_attention(q, k, v, beta, lam=lam, q2=q2, k2=k2, power=power)
    ref = (composed_threshold(q, k, v, beta, power)
           - lam * composed_threshold(q2, k2, v, beta, power))
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    leaves = (q, k, v, q2, k2, beta, lam)
    grads = torch.autograd.grad((out * w).sum(), leaves)
    ref_grads = torch.autograd.grad((ref * w).sum(), leaves)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-11)
    # float32 on the CPU kernels, the same result to float32 precision.
    out32 = winnow.threshold_attention(*(t.detach().float() for t in (q, k, v, beta)), power=power)
    torch.testing.assert_close(out32.double(), composed_threshold(q, k, v, beta, power).detach(),
                               rtol=1e-4, atol=1e-5)


def test_threshold_high_beta_leaves_exact_zeros_and_gradcheck():
    torch.manual_seed(13)
    q = torch.randn(1, 9, 2, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 9, 1, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 9, 1, 3, dtype=torch.float64, requires_grad=True)
    out = winnow.threshold_attention(q, k, v, torch.tensor([50.0], dtype=torch.float64))
    assert (out[:, 1:] == 0).all() and (out[:, 0] != 0).any()
    # The survivor count per row: at most the first query's own key.
    _, nonzero, _ = torch.ops.winnow.threshold_attention_forward(
        q.detach(), k.detach(), v.detach(), torch.tensor([50.0], dtype=torch.float64),
        count_nonzero=True)
    assert nonzero.dtype == torch.int32 and nonzero.shape == (1, 9, 2)
    assert (nonzero[:, 1:] == 0).all() and nonzero[:, 0].le(1).all()
    _, relu_count, _ = torch.ops.winnow.threshold_attention_forward(
        q.detach(), k.detach(), v.detach(), torch.zeros(1, dtype=torch.float64), power=1.0,
        count_nonzero=True)
    cos = torch.einsum("bjhd,bid->bjhi", torch.nn.functional.normalize(q.detach(), dim=-1),
                       torch.nn.functional.normalize(k.detach()[:, :, 0], dim=-1))
    want = (cos.gt(0) & torch.ones(9, 9, dtype=torch.bool).tril()[None, :, None, :]).sum(-1)
    assert torch.equal(relu_count, want.to(torch.int32))
    # The normalized rows are kept by the CUDA forward only: asked for here, a clear error.
    with pytest.raises(ValueError, match="argument 'saved_rows'"):
        torch.ops.winnow.threshold_attention_forward(
            q.detach(), k.detach(), v.detach(), torch.zeros(1, dtype=torch.float64), keep_rows=True)
    beta = torch.tensor([0.4], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda q, k, v, beta: winnow.threshold_attention(q, k, v, beta), (q, k, v, beta))


def test_threshold_bad_arguments_name_them():
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match="argument 'beta'"):
        winnow.threshold_attention(q, q, q, torch.zeros(3))
    with pytest.raises(ValueError, match="argument 'power'"):
        winnow.threshold_attention(q, q, q, torch.zeros(2), power=0.0)
    with pytest.raises(ValueError, match="argument 'q2'"):
        winnow.threshold_attention(q, q, q, torch.zeros(2), lam=torch.zeros(1))


@pytest.mark.parametrize("expand", [0.0, 10.0])
def test_screening_matches_composed_with_gradients(expand):
    torch.manual_seed(21)
    q = torch.randn(2, 13, 4, 6, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 17, 2, 6, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 17, 2, 5, dtype=torch.float64, requires_grad=True)
    # Windows 2.5, 8, 30 and 400 (past w_th: no MiPE); acceptance widths 0.8 to 0.95.
    s_w = torch.tensor([1.5, 7.0, 29.0, 399.0], dtype=torch.float64).log().requires_grad_()
    s_r = torch.tensor([0.8, 0.9, 0.95, 0.85], dtype=torch.float64).logit().requires_grad_()
    w = torch.randn(2, 13, 4, 5, dtype=torch.float64)
    out = winnow.screening_attention(q, k, v, s_w, s_r, expand_windows_above=expand)
    ref = winnow.composed.screening_attention(q, k, v, s_w, s_r, expand_windows_above=expand)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    leaves = (q, k, v, s_w, s_r)
    grads = torch.autograd.grad((out * w).sum(), leaves)
    ref_grads = torch.autograd.grad((ref * w).sum(), leaves)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-11)
    out32 = winnow.screening_attention(*(t.detach().float() for t in (q, k, v, s_w, s_r)),
                                       expand_windows_above=expand)
    torch.testing.assert_close(out32.double(), ref.detach(), rtol=1e-4, atol=1e-5)


def test_screening_gradcheck_and_bad_arguments():
    torch.manual_seed(22)
    q = torch.randn(1, 9, 2, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 9, 1, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 9, 1, 3, dtype=torch.float64, requires_grad=True)
    s_w = torch.tensor([1.0], dtype=torch.float64, requires_grad=True)
    s_r = torch.tensor([1.5], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(winnow.screening_attention, (q, k, v, s_w, s_r))
    x = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match="argument 's_w'"):
        winnow.screening_attention(x, x, x, torch.zeros(3), torch.zeros(2))
    with pytest.raises(ValueError, match="argument 'mipe_threshold'"):
        winnow.screening_attention(x, x, x, torch.zeros(2), torch.zeros(2), mipe_threshold=0.0)


# ------------------------------------------------------------------ GSA (spec/gsa.md)

def composed_gsa_scores(q, k, w, bias=None, form="sigmoid", scale=None):
    """The indexer's scores I_ts on (B, Lq, H_I, d_I) queries and (B, Lk, 1, d_I) keys:
    (B, Lq, Lk), -inf where the key is not visible (s > t)."""
    lq, lk = q.shape[1], k.shape[1]
    s = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    dot = torch.einsum("bqjd,bkd->bqjk", q.double(), k[:, :, 0].double()) * s
    w = w.double()[..., None]
    if form == "relu":
        terms = w * torch.relu(dot)
    else:
        b = 0.0 if bias is None else bias.double().reshape(1, 1, -1, 1)
        terms = torch.sigmoid(w) * torch.sigmoid(dot + b)
    return terms.sum(2).masked_fill(~visible_mask(lq, lk, True, q.device), float("-inf"))


def gsa_budget(variance, budget, k_fixed=None, k_base=0, k_min=1, k_max=1, mean_variance=1.0):
    """k_t as spec/gsa.md states it: the rule, floored, clamped to [k_min, k_max]."""
    if budget == "fixed":
        return min(k_max if k_fixed is None else k_fixed, k_max)
    if budget == "inverse_variance":
        k = k_base * mean_variance / variance if variance > 0 else math.inf
    elif budget == "eq8":
        k = k_base * variance / mean_variance
    else:
        k = k_base * (0.5 + 1 / (1 + variance / mean_variance))
    if not k >= k_min:
        return k_min
    return k_max if k >= k_max else math.floor(k)


def sort_top_k(scores, counts, k_max):
    """Each row's counts[t] best keys by a full sort (higher score first, ties toward the more
    recent key), in increasing order, -1 padded: (B, Lq, k_max) int32."""
    lk = scores.shape[-1]
    newest_first = torch.arange(lk - 1, -1, -1)
    order = torch.sort(scores[..., newest_first], dim=-1, descending=True, stable=True).indices
    ranked = newest_first[order]
    out = torch.full(scores.shape[:-1] + (k_max,), -1, dtype=torch.int32)
    for b in range(scores.shape[0]):
        for t in range(scores.shape[1]):
            n = int(counts[b, t])
            out[b, t, :n] = ranked[b, t, :n].sort().values.to(torch.int32)
    return out


def list_mask(indices, lk):
    """(B, Lq, k_max) lists, -1 padded -> (B, Lq, Lk): key s is in query t's list."""
    idx = torch.where(indices >= 0, indices, torch.full_like(indices, lk)).long()
    mask = torch.zeros(indices.shape[:-1] + (lk + 1,), dtype=torch.bool, device=indices.device)
    return mask.scatter_(-1, idx, True)[..., :lk]


def composed_list_softmax(q, k, v, indices):
    """Dense softmax attention with every key outside the query's list masked; an empty list
    outputs zero."""
    group = q.shape[2] // k.shape[2]
    vh = v.repeat_interleave(group, 2).transpose(1, 2)
    mask = list_mask(indices, k.shape[1])[:, None]
    z = scores(q, k).masked_fill(~mask, float("-inf"))
    p = torch.where(mask, torch.softmax(z, -1), torch.zeros_like(z))  # NaN rows of empty lists
    return (p @ vh).transpose(1, 2)


def gsa_indexer(b, lq, lk, heads=4, d=8, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)
    stat = torch.float64 if dtype == torch.float64 else torch.float32
    return (rnd(b, lq, heads, d), rnd(b, lk, 1, d), rnd(b, lq, heads),
            (0.5 * torch.randn(heads, generator=gen, dtype=torch.float64)).to(stat))


@pytest.mark.parametrize("form", ["sigmoid", "relu"])
@pytest.mark.parametrize("budget", ["fixed", "inverse_variance", "eq8", "reference"])
def test_gsa_select_keys_matches_sort_based_top_k(form, budget):
    q, k, w, bias = gsa_indexer(2, 23, 41, seed=30)
    bias = bias if form == "sigmoid" else None
    ref_scores = composed_gsa_scores(q, k, w, bias, form)
    finite = torch.where(torch.isfinite(ref_scores), ref_scores, torch.zeros_like(ref_scores))
    n = torch.isfinite(ref_scores).sum(-1)
    mean = finite.sum(-1) / n
    ref_var = torch.where(torch.isfinite(ref_scores), (finite - mean[..., None]) ** 2,
                          torch.zeros_like(finite)).sum(-1) / n
    options = dict(budget=budget, k_max=12, k_base=6, k_min=2,
                   mean_variance=float(ref_var.mean()), k_fixed=5 if budget == "fixed" else None)
    indices, counts, variance = winnow.gsa_select_keys(q, k, w, bias, form=form, **options)
    assert indices.dtype == torch.int32 and counts.dtype == torch.int32
    assert indices.shape == (2, 23, 12) and counts.shape == (2, 23)
    assert variance.dtype == torch.float64 and variance.shape == (2, 23)
    torch.testing.assert_close(variance, ref_var, rtol=1e-12, atol=1e-14)
    t = torch.arange(41 - 23, 41)
    want_counts = torch.tensor([[min(gsa_budget(float(variance[b, r]), **options), int(t[r]) + 1)
                                 for r in range(23)] for b in range(2)], dtype=torch.int32)
    assert torch.equal(counts, want_counts)
    if budget != "fixed":
        assert counts.min() < counts.max() <= 12  # the budget adapts per row
    assert torch.equal(indices, sort_top_k(ref_scores, counts, 12))


def test_gsa_select_keys_ties_go_to_the_most_recent_keys():
    # Zero queries: every key of a row scores the same, so the most recent ones win.
    q, k, w, bias = gsa_indexer(1, 10, 10, seed=31)
    for form, b in (("sigmoid", bias), ("relu", None)):
        indices, counts, _ = winnow.gsa_select_keys(torch.zeros_like(q), k, w, b, form=form,
                                                    budget="fixed", k_fixed=3, k_max=4)
        t = torch.arange(10)
        assert torch.equal(counts[0], torch.clamp(t + 1, max=3).to(torch.int32))
        for r in range(10):
            want = list(range(max(0, r - 2), r + 1)) + [-1] * (4 - min(3, r + 1))
            assert indices[0, r].tolist() == want


def test_gsa_select_keys_packed_equals_each_sequence_alone():
    q, k, w, bias = gsa_indexer(1, 30, 40, seed=32)
    lens_q = [7, 0, 23]
    cu_q = torch.tensor([0, 7, 7, 30], dtype=torch.int32)
    cu_k = torch.tensor([0, 11, 17, 40], dtype=torch.int32)
    options = dict(k_max=6, k_base=3, k_min=1, mean_variance=0.02, budget="reference")
    indices, counts, variance = winnow.gsa_select_keys(q[0], k[0], w[0], bias, cu_seqlens_q=cu_q,
                                                       cu_seqlens_k=cu_k, **options)
    assert indices.shape == (30, 6) and counts.shape == (30,) and variance.shape == (30,)
    for s in range(3):
        if lens_q[s] == 0:
            continue
        rows, keys = slice(int(cu_q[s]), int(cu_q[s + 1])), slice(int(cu_k[s]), int(cu_k[s + 1]))
        i1, c1, v1 = winnow.gsa_select_keys(q[:, rows], k[:, keys], w[:, rows], bias, **options)
        assert torch.equal(indices[rows], i1[0]) and torch.equal(counts[rows], c1[0])
        torch.testing.assert_close(variance[rows], v1[0], rtol=1e-14, atol=1e-15)


def test_gsa_select_keys_outputs_are_not_differentiable():
    q, k, w, bias = (t.requires_grad_() for t in gsa_indexer(1, 9, 9, seed=33))
    for out in winnow.gsa_select_keys(q, k, w, bias, k_max=4, budget="fixed"):
        assert not out.requires_grad and out.grad_fn is None


@pytest.mark.parametrize("lq,lk", [(37, 37), (23, 40)])
def test_gsa_sparse_over_every_visible_key_is_softmax_attention(lq, lk):
    # A fixed budget of at least Lk lists every visible key: causal softmax attention exactly,
    # with grouped-query heads (4 per kv head) and Dv != D.
    iq, ik, iw, ib = gsa_indexer(2, lq, lk, seed=34)
    indices, counts, _ = winnow.gsa_select_keys(iq, ik, iw, ib, budget="fixed", k_max=lk)
    assert torch.equal(counts.long(), (torch.arange(lk - lq, lk) + 1).expand(2, lq))
    torch.manual_seed(34)
    q = torch.randn(2, lq, 8, 16, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, lk, 2, 16, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, lk, 2, 12, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, lq, 8, 12, dtype=torch.float64)
    out = winnow.gsa_sparse_attention(q, k, v, indices, counts)
    ref = winnow.softmax_attention(q, k, v)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-11), (torch.float32, 2e-5)])
def test_gsa_sparse_matches_masked_softmax_with_gradients(dtype, tol):
    iq, ik, iw, ib = gsa_indexer(2, 29, 37, seed=35)
    indices, counts, _ = winnow.gsa_select_keys(iq, ik, iw, ib, k_max=9, k_base=5, k_min=2,
                                                mean_variance=0.01)
    assert counts[:, 9:].min() < counts[:, 9:].max()  # lists of several lengths
    torch.manual_seed(35)
    q = torch.randn(2, 29, 8, 16, dtype=torch.float64) * 2
    k = torch.randn(2, 37, 2, 16, dtype=torch.float64)
    v = torch.randn(2, 37, 2, 12, dtype=torch.float64)
    w = torch.randn(2, 29, 8, 12, dtype=torch.float64)
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    out = winnow.gsa_sparse_attention(*leaves, indices, counts)
    ref = composed_list_softmax(*ref_leaves, indices)
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    grads = torch.autograd.grad((out.double() * w).sum(), leaves)
    ref_grads = torch.autograd.grad((ref * w).sum(), ref_leaves)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.double(), r, rtol=tol, atol=tol)
    # Keys in no list get exactly zero gradient.
    unlisted = ~list_mask(indices, 37).any(1)
    assert unlisted.any()
    assert (grads[1].abs().sum((-1, -2))[unlisted] == 0).all()
    assert (grads[2].abs().sum((-1, -2))[unlisted] == 0).all()
    # Trusted lists (straight from the selection) give the same bits.
    trusted = winnow.gsa_sparse_attention(*leaves, indices, counts, trusted=True)
    assert torch.equal(trusted, out)


def test_gsa_sparse_gradcheck_varlen_with_an_empty_list():
    torch.manual_seed(36)
    q = torch.randn(12, 2, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(20, 1, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(20, 1, 3, dtype=torch.float64, requires_grad=True)
    cu_q = torch.tensor([0, 5, 12], dtype=torch.int32)
    cu_k = torch.tensor([0, 8, 20], dtype=torch.int32)
    iq, ik, iw, ib = gsa_indexer(1, 12, 20, heads=2, d=4, seed=36)
    indices, counts, _ = winnow.gsa_select_keys(iq[0], ik[0], iw[0], ib, cu_seqlens_q=cu_q,
                                                cu_seqlens_k=cu_k, budget="fixed", k_fixed=3,
                                                k_max=4)
    counts[2] = 0  # an empty list: zero output, zero gradient
    out = winnow.gsa_sparse_attention(q, k, v, indices, counts, cu_seqlens_q=cu_q,
                                      cu_seqlens_k=cu_k)
    assert torch.equal(out[2].detach(), torch.zeros_like(out[2]))
    assert torch.autograd.gradcheck(
        lambda q, k, v: winnow.gsa_sparse_attention(q, k, v, indices, counts, cu_seqlens_q=cu_q,
                                                    cu_seqlens_k=cu_k), (q, k, v))


def test_gsa_sparse_packed_equals_each_sequence_alone():
    torch.manual_seed(37)
    cu_q = torch.tensor([0, 7, 7, 30], dtype=torch.int32)
    cu_k = torch.tensor([0, 11, 17, 40], dtype=torch.int32)
    q = torch.randn(30, 4, 8, dtype=torch.float64)
    k = torch.randn(40, 2, 8, dtype=torch.float64)
    v = torch.randn(40, 2, 8, dtype=torch.float64)
    iq, ik, iw, ib = gsa_indexer(1, 30, 40, seed=37)
    options = dict(k_max=6, k_base=3, mean_variance=0.02)
    indices, counts, _ = winnow.gsa_select_keys(iq[0], ik[0], iw[0], ib, cu_seqlens_q=cu_q,
                                                cu_seqlens_k=cu_k, **options)
    out = winnow.gsa_sparse_attention(q, k, v, indices, counts, cu_seqlens_q=cu_q,
                                      cu_seqlens_k=cu_k)
    for s in (0, 2):
        rows, keys = slice(int(cu_q[s]), int(cu_q[s + 1])), slice(int(cu_k[s]), int(cu_k[s + 1]))
        alone = winnow.gsa_sparse_attention(q[None, rows], k[None, keys], v[None, keys],
                                            indices[None, rows], counts[None, rows])
        torch.testing.assert_close(out[rows], alone[0], rtol=1e-14, atol=1e-14)


def composed_indexer_loss(iq, ik, w, bias, q, k, allowed, form="sigmoid"):
    """003 section 6's loss per query row, written directly: KL(p || softmax(I)) over `allowed`
    (B, Lq, Lk), p the heads' mean softmax; an empty row gives 0."""
    z = scores(q, k).masked_fill(~allowed[:, None], float("-inf"))
    p = torch.where(allowed[:, None], torch.softmax(z, -1), torch.zeros_like(z)).mean(1)
    dots = torch.einsum("bljd,bsd->bljs", iq, ik[:, :, 0]) / iq.shape[-1] ** 0.5
    if form == "sigmoid":
        terms = torch.sigmoid(w)[..., None] * torch.sigmoid(dots + bias[None, None, :, None])
    else:
        terms = w[..., None] * torch.relu(dots)
    log_q = torch.log_softmax(terms.sum(2).masked_fill(~allowed, float("-inf")), -1)
    kl = torch.xlogy(p, p) - p * torch.where(allowed, log_q, torch.zeros_like(log_q))
    return torch.where(allowed, kl, torch.zeros_like(kl)).sum(-1)


@pytest.mark.parametrize("form", ["sigmoid", "relu"])
@pytest.mark.parametrize("listed", [False, True])
def test_gsa_indexer_loss_matches_the_kl_written_out(form, listed):
    # Over the selection's lists (sparse phase) or every visible key (warm-up), grouped-query
    # heads (6 over 2), more keys than queries; values and the indexer's gradients in float64.
    iq, ik, iw, ib = gsa_indexer(2, 11, 17, seed=36)
    ib = ib if form == "sigmoid" else None
    torch.manual_seed(36)
    q = torch.randn(2, 11, 6, 8, dtype=torch.float64)
    k = torch.randn(2, 17, 2, 8, dtype=torch.float64)
    lists = ()
    pos = torch.arange(17 - 11, 17)[:, None]
    allowed = (torch.arange(17)[None, :] <= pos).expand(2, 11, 17)
    if listed:
        lists = winnow.gsa_select_keys(iq, ik, iw, ib, k_max=6, budget="fixed", form=form)[:2]
        allowed = list_mask(lists[0], 17)
    leaves = [t.clone().requires_grad_() for t in (iq, ik, iw)] + ([ib.clone().requires_grad_()] if ib is not None else [])
    ref_leaves = [t.detach().clone().requires_grad_() for t in leaves]
    bias, ref_bias = (leaves[3], ref_leaves[3]) if ib is not None else (None, None)
    got = winnow.gsa_indexer_loss(*leaves[:3], bias, q, k, *lists, form=form)
    want = composed_indexer_loss(*ref_leaves[:3], ref_bias, q, k, allowed, form=form)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert (got >= -1e-12).all()
    weights = torch.cos(torch.arange(got.numel(), dtype=torch.float64)).reshape(got.shape)
    grads = torch.autograd.grad((got * weights).sum(), leaves)
    ref_grads = torch.autograd.grad((want * weights).sum(), ref_leaves)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-11)


def test_gsa_indexer_loss_gradcheck_packed_float32_casts_back():
    # Packed sequences (one empty) under gradcheck in float64; in float32 the gradients come
    # back in each input's dtype.
    cu_q = torch.tensor([0, 4, 4, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 6, 8, 14], dtype=torch.int32)
    gen = torch.Generator().manual_seed(37)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)
    iq, ik, iw, ib = rnd(9, 3, 4), rnd(14, 1, 4), rnd(9, 3), rnd(3)
    q, k = rnd(9, 2, 4), rnd(14, 1, 4)

    def fn(iq, ik, iw, ib):
        return winnow.gsa_indexer_loss(iq, ik, iw, ib, q, k, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    leaves = [t.clone().requires_grad_() for t in (iq, ik, iw, ib)]
    assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-7)
    low = [t.float().requires_grad_() for t in (iq, ik, iw, ib)]
    loss = winnow.gsa_indexer_loss(*low[:3], low[3], q.float(), k.float(), cu_seqlens_q=cu_q,
                                   cu_seqlens_k=cu_k)
    assert loss.dtype == torch.float32 and loss.shape == (9,)
    for g, t in zip(torch.autograd.grad(loss.sum(), low), low):
        assert g.dtype == t.dtype and g.shape == t.shape


def test_gsa_indexer_loss_bad_arguments_name_them():
    iq, ik, iw, ib = gsa_indexer(1, 5, 5, seed=38)
    q, k = torch.randn(1, 5, 2, 8, dtype=torch.float64), torch.randn(1, 5, 2, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="attention_q|'q'"):
        winnow.gsa_indexer_loss(iq, ik, iw, ib, q.float(), k.float())
    with pytest.raises(ValueError, match="'bias'"):
        winnow.gsa_indexer_loss(iq, ik, iw, ib, q, k, form="relu")
    with pytest.raises(ValueError, match="'counts'"):
        winnow.gsa_indexer_loss(iq, ik, iw, ib, q, k, torch.zeros(1, 5, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="'form'"):
        winnow.gsa_indexer_loss(iq, ik, iw, ib, q, k, form="tanh")


def test_gsa_bad_arguments_name_them():
    q, k, w, bias = gsa_indexer(1, 8, 8, dtype=torch.float32, seed=38)
    with pytest.raises(ValueError, match="argument 'k_min': expected an integer in \\[1, k_max = 4\\]"):
        winnow.gsa_select_keys(q, k, w, bias, k_max=4, k_base=4, k_min=5)
    with pytest.raises(ValueError, match="argument 'k_max'"):
        winnow.gsa_select_keys(q, k, w, bias, k_max=0, budget="fixed")
    with pytest.raises(ValueError, match="argument 'k_base'"):
        winnow.gsa_select_keys(q, k, w, bias, k_max=4)  # an adaptive budget needs k_base
    with pytest.raises(ValueError, match="argument 'form'"):
        winnow.gsa_select_keys(q, k, w, bias, k_max=4, form="softmax")
    with pytest.raises(ValueError, match="argument 'budget'"):
        winnow.gsa_select_keys(q, k, w, bias, k_max=4, budget="top-k")
    with pytest.raises(ValueError, match="argument 'k_fixed'"):
        winnow.gsa_select_keys(q, k, w, bias, k_max=4, k_base=2, k_fixed=3)
    with pytest.raises(ValueError, match="argument 'bias'"):
        winnow.gsa_select_keys(q, k, w, bias, k_max=4, budget="fixed", form="relu")
    with pytest.raises(ValueError, match="argument 'k'"):
        winnow.gsa_select_keys(q, q, w, bias, k_max=4, budget="fixed")  # 4 key heads
    with pytest.raises(ValueError, match="argument 'head_weights'"):
        winnow.gsa_select_keys(q, k, w.double(), bias, k_max=4, budget="fixed")

    indices, counts, _ = winnow.gsa_select_keys(q, k, w, bias, k_max=4, budget="fixed")
    x, kv = torch.randn(1, 8, 2, 16), torch.randn(1, 8, 1, 16)
    future = indices.clone()
    future[0, 2, 2] = 3  # query 2 cannot see key 3
    with pytest.raises(ValueError, match="argument 'indices': expected strictly increasing "
                                         "positions in \\[0, 2\\] at sequence 0, query row 2"):
        winnow.gsa_sparse_attention(x, kv, kv, future, counts)
    repeated = indices.clone()
    repeated[0, 5, 1] = repeated[0, 5, 0]
    with pytest.raises(ValueError, match="argument 'indices': expected strictly increasing"):
        winnow.gsa_sparse_attention(x, kv, kv, repeated, counts)
    with pytest.raises(ValueError, match="argument 'indices': expected int32"):
        winnow.gsa_sparse_attention(x, kv, kv, indices.long(), counts)
    with pytest.raises(ValueError, match="argument 'counts': expected values in \\[0, k_max = 4\\]"):
        winnow.gsa_sparse_attention(x, kv, kv, indices, counts + 5)
    with pytest.raises(ValueError, match="argument 'counts'"):
        winnow.gsa_sparse_attention(x, kv, kv, indices, counts[:, :7])


def paged_problem(seq_lens, lq, hq, hkv, d, page_size, dtype=torch.float64, seed=0):
    """Random pages handed out in shuffled order, and each sequence's keys gathered by hand."""
    g = torch.Generator().manual_seed(seed)
    b = len(seq_lens)
    used = [(n + page_size - 1) // page_size for n in seq_lens]
    pages = 2 * sum(used) + 1
    k_cache = torch.randn(pages, page_size, hkv, d, generator=g, dtype=dtype)
    v_cache = torch.randn(pages, page_size, hkv, d, generator=g, dtype=dtype)
    order = torch.randperm(pages, generator=g)
    table = torch.full((b, max(used) + 1), -1, dtype=torch.int32)
    nxt = 0
    for i, u in enumerate(used):
        table[i, :u] = order[nxt:nxt + u].to(torch.int32)
        nxt += u
    q = torch.randn(b, lq, hq, d, generator=g, dtype=dtype)
    gathered = []
    for i, n in enumerate(seq_lens):
        idx = torch.arange(n)
        rows = table[i, idx // page_size].long() * page_size + idx % page_size
        gathered.append((k_cache.flatten(0, 1)[rows][None], v_cache.flatten(0, 1)[rows][None]))
    return q, k_cache, v_cache, table, torch.tensor(seq_lens, dtype=torch.int32), gathered


@pytest.mark.parametrize("mechanism", ["softmax", "stick_breaking"])
def test_paged_decode_matches_composed_on_gathered_keys(mechanism):
    q, kc, vc, table, lens, gathered = paged_problem([3, 40, 77], lq=3, hq=4, hkv=2, d=16, page_size=5)
    out, stat = winnow.paged_decode(q, kc, vc, table, lens, mechanism=mechanism)
    for i, (k, v) in enumerate(gathered):
        if mechanism == "softmax":
            want = composed_softmax(q[i:i + 1], k, v)
        else:
            want, rem = composed_stick_breaking(q[i:i + 1], k, v)
            torch.testing.assert_close(stat[i:i + 1].exp(), rem)
        torch.testing.assert_close(out[i:i + 1], want)


def test_paged_decode_refuses_a_page_outside_the_cache():
    q, kc, vc, table, lens, _ = paged_problem([4, 9], lq=1, hq=2, hkv=1, d=8, page_size=4)
    table[1, 0] = kc.shape[0]
    with pytest.raises(ValueError, match="sequence 1's pages"):
        winnow.paged_decode(q, kc, vc, table, lens)
    with pytest.raises(ValueError, match="mechanism"):
        winnow.paged_decode(q, kc, vc, table, lens, mechanism="entmax")
