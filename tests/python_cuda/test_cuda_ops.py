"""The operators on CUDA tensors from Python: autograd against composed float64 expressions,
SDPA agreement for softmax, deterministic mode, and halting. Label `cuda` (GPU machines)."""

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
import winnow  # noqa: E402
from test_ops import (composed_entmax, composed_sieve, composed_softmax,  # noqa: E402
                      composed_stick_breaking)

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
