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
from operator_samples import CPU_ONLY, DIFFERENTIABLE, operator, samples  # noqa: E402
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
@pytest.mark.parametrize("name", [n for n in DIFFERENTIABLE if n not in CPU_ONLY])
@pytest.mark.parametrize("dtype,d,tol", [(torch.float32, 16, 1e-5), (torch.bfloat16, 64, 3e-2)])
def test_compile_matches_eager_on_cuda(name, dtype, d, tol):
    compile_check(name, "cuda", dtype, d, "aot_eager", tol, tol)


def test_operators_without_cuda_kernels_say_so():
    q = torch.randn(1, 8, 2, 16, device="cuda")
    beta = torch.zeros(2, device="cuda")
    with pytest.raises(NotImplementedError, match="no CUDA kernels yet"):
        winnow.threshold_attention(q, q[:, :, :1], q[:, :, :1], beta)


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
