"""winnow.nn's attention modules and winnow.composed: each module with the fused operators
against the same module running the composed expressions (forward and every parameter's
gradient, float64), incremental decoding through the KV cache against the full forward pass,
RoPE and its scalings, argument errors; and the composed expressions against the operators."""

from __future__ import annotations

import math

import pytest
import torch

import winnow
from winnow import composed
from winnow.nn import KVCache, Rope


def module_cases():
    """(name, factory): every mechanism with its options and positions."""
    return [
        ("softmax_rope", lambda: winnow.nn.SoftmaxAttention(48, 4, n_kv_heads=2)),
        ("softmax_nope_yarn_unused", lambda: winnow.nn.SoftmaxAttention(48, 4, positions="nope")),
        ("softmax_yarn", lambda: winnow.nn.SoftmaxAttention(
            48, 4, rope=dict(scaling="yarn", factor=4, context_length=8))),
        ("softmax_dynamic", lambda: winnow.nn.SoftmaxAttention(
            48, 4, rope=dict(scaling="dynamic", factor=2, context_length=6))),
        ("stick_breaking", lambda: winnow.nn.StickBreakingAttention(48, 4, n_kv_heads=1)),
        ("stick_breaking_rb_gn_rope", lambda: winnow.nn.StickBreakingAttention(
            48, 4, remainder_bias=True, head_norm=True, positions="rope", value_dim=8)),
        ("stick_breaking_attend_current", lambda: winnow.nn.StickBreakingAttention(
            48, 3, attend_current=True)),
        ("entmax", lambda: winnow.nn.EntmaxAttention(48, 4, n_kv_heads=2)),
        ("sparsemax_ntk", lambda: winnow.nn.EntmaxAttention(
            48, 4, alpha=2.0, rope=dict(scaling="ntk", factor=3))),
        ("entmax_alpha_1_3_nope", lambda: winnow.nn.EntmaxAttention(
            48, 4, alpha=1.3, positions="nope")),
        ("sieve_exact", lambda: winnow.nn.SieveAttention(48, 4, remainder_bias=True)),
        ("sieve_bound", lambda: winnow.nn.SieveAttention(
            48, 4, filter="bound", eps=0.8, head_norm=True, n_kv_heads=2)),
    ]


def make(factory, seed=0):
    torch.manual_seed(seed)
    module = factory().double()
    # Larger projections than nn.Linear's default: sharper rows, so that entmax and Sieve
    # select a few keys instead of nearly all of them.
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name in ("q.weight", "k.weight"):
                p.mul_(4)
            elif name == "remainder_bias" or name.startswith("head_norm"):
                p.add_(torch.randn_like(p) * 0.5)
    return module


@pytest.mark.parametrize("name,factory", module_cases(), ids=[n for n, _ in module_cases()])
def test_module_kernel_matches_composed(name, factory):
    module = make(factory)
    x = torch.randn(2, 13, 48, dtype=torch.float64)
    weight = torch.randn(2, 13, 48, dtype=torch.float64)
    results = {}
    for implementation in ("kernel", "composed"):
        module.implementation = implementation
        module.zero_grad()
        y = module(x)
        (y * weight).sum().backward()
        results[implementation] = (y.detach(), {n: p.grad.clone() for n, p in module.named_parameters()})
    (y_kernel, g_kernel), (y_comp, g_comp) = results["kernel"], results["composed"]
    torch.testing.assert_close(y_kernel, y_comp, rtol=1e-9, atol=1e-10)
    assert g_kernel.keys() == g_comp.keys()
    for n in g_kernel:
        torch.testing.assert_close(g_kernel[n], g_comp[n], rtol=1e-8, atol=1e-9, msg=n)


@pytest.mark.parametrize("name,factory", module_cases(), ids=[n for n, _ in module_cases()])
@pytest.mark.parametrize("max_length", [None, 16])
def test_decoding_with_the_cache_matches_the_full_forward(name, factory, max_length):
    """A prompt of 5, then one position at a time: each step's output is the full forward's
    over the sequence so far (with dynamic RoPE scaling the base changes with that length, so
    only the newest position of each prefix is comparable)."""
    module = make(factory, seed=1)
    x = torch.randn(2, 11, 48, dtype=torch.float64)
    with torch.no_grad():
        cache = KVCache(max_length)
        prompt = module(x[:, :5], cache)
        torch.testing.assert_close(prompt, module(x[:, :5]), rtol=1e-10, atol=1e-11)
        for t in range(5, 11):
            step = module(x[:, t:t + 1], cache)
            torch.testing.assert_close(step[:, 0], module(x[:, :t + 1])[:, -1], rtol=1e-10, atol=1e-11)
    assert cache.length == 11


def test_cache_errors_name_the_argument():
    cache = KVCache(max_length=4)
    k = torch.randn(1, 3, 2, 8)
    cache.append(k, k)
    with pytest.raises(ValueError, match="argument 'k': expected at most 1 more positions"):
        cache.append(k, k)
    with pytest.raises(ValueError, match="argument 'k': expected batch, heads"):
        cache.append(torch.randn(2, 1, 2, 8), torch.randn(2, 1, 2, 8))
    with pytest.raises(ValueError, match="argument 'max_length'"):
        KVCache(max_length=0)


@pytest.mark.parametrize("kwargs,match", [
    (dict(n_kv_heads=3), "argument 'n_kv_heads': expected a divisor of n_heads \\(4\\)"),
    (dict(positions="alibi"), "argument 'positions'"),
    (dict(implementation="triton"), "argument 'implementation'"),
    (dict(halt_cutoff=-1.0), "argument 'halt_cutoff'"),
    (dict(halt_cutoff=5.0, implementation="composed"), "argument 'halt_cutoff'"),
    (dict(positions="rope", rope=dict(scaling="yarn", factor=4)), "argument 'context_length'"),
    (dict(positions="rope", rope=dict(scaling="log")), "argument 'scaling'"),
])
def test_module_errors_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        winnow.nn.StickBreakingAttention(32, 4, **kwargs)


def test_mechanism_errors_name_the_argument():
    with pytest.raises(ValueError, match="argument 'alpha'"):
        winnow.nn.EntmaxAttention(32, 4, alpha=1.0)
    with pytest.raises(ValueError, match="argument 'filter'"):
        winnow.nn.SieveAttention(32, 4, filter="top-k")
    with pytest.raises(ValueError, match="argument 'eps'"):
        winnow.nn.SieveAttention(32, 4, eps=0.5)
    with pytest.raises(ValueError, match="argument 'positions'"):
        winnow.nn.SieveAttention(32, 4, positions="rope")
    with pytest.raises(ValueError, match="argument 'head_dim'"):
        winnow.nn.SoftmaxAttention(30, 4)
    with pytest.raises(ValueError, match="argument 'mechanism'"):
        winnow.nn.attention("linear", 32, 4)
    assert isinstance(winnow.nn.attention("sieve", 32, 4, filter="bound"), winnow.nn.SieveAttention)


def test_rope_tables():
    rope = Rope(8)
    cos, sin = rope.tables(3, 4, 7, torch.device("cpu"))
    inv_freq = 10000.0 ** (-torch.arange(4, dtype=torch.float64) / 4)
    angles = torch.arange(3, 7, dtype=torch.float64)[:, None] * inv_freq
    torch.testing.assert_close(cos, angles.cos())
    torch.testing.assert_close(sin, angles.sin())
    # Linear interpolation: positions divided by the factor.
    cos_lin, _ = Rope(8, scaling="linear", factor=4).tables(0, 8, 8, torch.device("cpu"))
    torch.testing.assert_close(cos_lin[4], torch.cos(1.0 * inv_freq))
    # YaRN: the fastest dimension keeps its frequency, the slowest is interpolated, and every
    # table carries 0.1 ln(s) + 1.
    cos_y, sin_y = Rope(64, scaling="yarn", factor=8, context_length=64).tables(
        0, 5, 5, torch.device("cpu"))
    m = 0.1 * math.log(8) + 1
    torch.testing.assert_close(cos_y ** 2 + sin_y ** 2, torch.full_like(cos_y, m * m))
    torch.testing.assert_close(cos_y[:, 0] / m, torch.cos(torch.arange(5, dtype=torch.float64)))
    slowest = 10000.0 ** (-31 / 32) / 8
    torch.testing.assert_close(cos_y[:, 31] / m, torch.cos(torch.arange(5, dtype=torch.float64) * slowest))


def test_rope_module_rotates_like_the_composed_rotation():
    torch.manual_seed(2)
    x = torch.randn(2, 6, 3, 8, dtype=torch.float64)
    rope = Rope(8)
    cos, sin = rope.tables(2, 6, 8, x.device)
    torch.testing.assert_close(rope(x, offset=2), composed.rotary_embedding(x, cos, sin))
    torch.testing.assert_close(winnow.rotary_embedding(x, cos, sin, transpose=True),
                               composed.rotary_embedding(x, cos, sin, transpose=True))


# ---------------------------------------------------------------- winnow.composed

def qkv(seed, lq=17, lk=29, hq=4, hkv=2, d=8, dv=5, sharp=2.5):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(2, lq, hq, d, generator=g, dtype=torch.float64) * sharp).requires_grad_()
    k = torch.randn(2, lk, hkv, d, generator=g, dtype=torch.float64).requires_grad_()
    v = torch.randn(2, lk, hkv, dv, generator=g, dtype=torch.float64).requires_grad_()
    return q, k, v


def compare(fn_op, fn_comp, q, k, v, rtol=1e-9, atol=1e-10):
    outs_op = fn_op(q, k, v)
    outs_comp = fn_comp(q, k, v)
    outs_op = outs_op if isinstance(outs_op, tuple) else (outs_op,)
    outs_comp = outs_comp if isinstance(outs_comp, tuple) else (outs_comp,)
    floats = [i for i, o in enumerate(outs_op) if o.is_floating_point()]
    for a, b in zip(outs_op, outs_comp):
        if a.is_floating_point():
            torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
        else:
            assert torch.equal(a, b)
    weights = [torch.randn_like(outs_op[i]) for i in floats]
    g_op = torch.autograd.grad(sum((outs_op[i] * w).sum() for i, w in zip(floats, weights)), (q, k, v))
    g_comp = torch.autograd.grad(sum((outs_comp[i] * w).sum() for i, w in zip(floats, weights)), (q, k, v))
    for a, b in zip(g_op, g_comp):
        torch.testing.assert_close(a, b, rtol=rtol * 10, atol=atol * 10)


@pytest.mark.parametrize("attend_current", [False, True])
def test_composed_softmax_and_stick_breaking(attend_current):
    q, k, v = qkv(3)
    compare(lambda *a: winnow.softmax_attention(*a, attend_current=attend_current),
            lambda *a: composed.softmax_attention(*a, attend_current=attend_current), q, k, v)
    compare(lambda *a: winnow.stick_breaking_attention(*a, attend_current=attend_current),
            lambda *a: composed.stick_breaking_attention(*a, attend_current=attend_current), q, k, v)


@pytest.mark.parametrize("alpha", [1.25, 1.5, 2.0, 3.0])
def test_composed_entmax_and_its_implicit_gradient(alpha):
    q, k, v = qkv(4)
    compare(lambda *a: winnow.entmax_attention(*a, alpha=alpha),
            lambda *a: composed.entmax_attention(*a, alpha=alpha), q, k, v)


@pytest.mark.parametrize("filter,eps", [("exact", None), ("bound", None), ("bound", 0.6)])
def test_composed_sieve(filter, eps):
    q, k, v = qkv(5)
    compare(lambda *a: winnow.sieve_attention(*a, filter=filter, eps=eps),
            lambda *a: composed.sieve_attention(*a, filter=filter, eps=eps), q, k, v)


def test_composed_stick_breaking_survives_huge_logits():
    q, k, v = qkv(6, sharp=300.0)
    out, rem = composed.stick_breaking_attention(q, k, v)
    (out.sum() + rem.sum()).backward()
    assert torch.isfinite(out).all() and torch.isfinite(q.grad).all()
    ref_out, ref_rem = winnow.stick_breaking_attention(q.detach(), k.detach(), v.detach())
    torch.testing.assert_close(out.detach(), ref_out, rtol=1e-9, atol=1e-9)
