"""The operators under PyTorch's machinery on CUDA tensors: torch.library.opcheck (float32 and
bfloat16, the simple and the fused kernels) and torch.compile(fullgraph=True, dynamic=True)
(AOTAutograd tracing) against eager, forward and backward; and winnow.nn modules compiled with
inductor under bf16 autocast. The CPU versions are tests/python/test_torch_machinery.py. Label `cuda`."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
import winnow  # noqa: E402
from operator_samples import DIFFERENTIABLE, operator, samples  # noqa: E402
from test_torch_machinery import compile_check, needs_modern_torch  # noqa: E402

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              needs_modern_torch]


@pytest.mark.parametrize("sample", samples("cuda", torch.float32), ids=str)
def test_opcheck_float32(sample):
    torch.library.opcheck(operator(sample), sample.args, sample.kwargs)


# Head dimension 64 in bfloat16 reaches the fused (Hopper / mma.sync) kernels. Only the schema,
# fake-tensor and autograd-registration checks: opcheck's eager-vs-compiled comparison uses
# bfloat16's default absolute tolerance (1e-5), tighter than two runs of a kernel whose
# gradients sum in a different order; test_compile_matches_eager_on_cuda checks that part.
@pytest.mark.parametrize("sample", samples("cuda", torch.bfloat16, d=64), ids=str)
def test_opcheck_bfloat16_fused(sample):
    torch.library.opcheck(operator(sample), sample.args, sample.kwargs,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


# Tracing (AOTAutograd, dynamic shapes) of every operator on CUDA tensors; inductor's code
# generation around them is what the module tests below and the GPT example exercise (each
# inductor compilation costs tens of seconds).
@pytest.mark.parametrize("name", DIFFERENTIABLE)
@pytest.mark.parametrize("dtype,d,tol", [(torch.float32, 16, 1e-5), (torch.bfloat16, 64, 3e-2)])
def test_compile_matches_eager_on_cuda(name, dtype, d, tol):
    compile_check(name, "cuda", dtype, d, "aot_eager", tol, tol)


# Threshold attention on CUDA against the CPU kernels, with every gradient (beta's and lam's
# included): TRA and TDA, the fused kernels (bf16, D = 64) and the simple path (float32).
@pytest.mark.parametrize("dtype,d,tol", [(torch.bfloat16, 64, 3e-2), (torch.float32, 16, 1e-4)])
@pytest.mark.parametrize("tda", [False, True])
def test_threshold_attention_cuda_matches_cpu(dtype, d, tol, tda):
    gen = torch.Generator().manual_seed(3)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)
    q, k, v, dout = rand(2, 200, 4, d), rand(2, 200, 2, d), rand(2, 200, 2, d), rand(2, 200, 4, d)
    q2, k2 = rand(2, 200, 4, d), rand(2, 200, 2, d)
    beta, lam = torch.tensor([0.2, 0.3, 0.4, 0.5]), torch.tensor([0.5])
    results = []
    for device in ("cpu", "cuda"):
        leaves = [t.to(device).float().detach().clone().requires_grad_() for t in (q, k, v, q2, k2)]
        scalars = [t.to(device).detach().clone().requires_grad_() for t in (beta, lam)]
        # The CPU side runs in float32 on the same (dtype-rounded) values.
        qq, kk, vv, qq2, kk2 = (t.to(dtype) if device == "cuda" else t for t in leaves)
        extra = {"lam": scalars[1], "q2": qq2, "k2": kk2} if tda else {}
        out = winnow.threshold_attention(qq, kk, vv, scalars[0], **extra)
        out.backward(dout.to(device=device, dtype=out.dtype))
        grads = [t.grad for t in leaves[:3] + (leaves[3:] if tda else [])]
        grads += [scalars[0].grad] + ([scalars[1].grad] if tda else [])
        results.append([out.detach().float().cpu()] + [g.float().cpu() for g in grads])
    names = ["out", "dq", "dk", "dv"] + (["dq2", "dk2"] if tda else []) + ["dbeta"] + (["dlam"] if tda else [])
    for name, got, want in zip(names, results[1], results[0]):
        scale = want.abs().max().clamp_min(1e-6)
        error = ((got - want).abs().max() / scale).item()
        assert error < tol, f"{name}: {error} (cuda {got.flatten()[:4].tolist()}, cpu {want.flatten()[:4].tolist()})"


@pytest.mark.parametrize("mechanism", ["stick_breaking", "entmax"])
def test_compiled_module_under_autocast(mechanism):
    torch.manual_seed(0)
    module = winnow.nn.attention(mechanism, 256, 4, n_kv_heads=2).cuda()
    x = torch.randn(2, 300, 256, device="cuda", requires_grad=True)
    compiled = torch.compile(module, fullgraph=True, dynamic=True)
    results = []
    for fn in (module, compiled):
        x.grad = None
        module.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = fn(x)
        y.float().square().sum().backward()
        results.append((y.float(), x.grad.clone(), module.q.weight.grad.clone()))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=3e-2, atol=3e-2)
