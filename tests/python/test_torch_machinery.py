"""winnow's operators under PyTorch's machinery: the meta device, fake tensors with symbolic
shapes, torch.library.opcheck and torch.compile(fullgraph=True, dynamic=True), forward and
backward, against eager results. The CUDA tests (tests/python_cuda) run the same checks on
CUDA tensors.

opcheck and torch.compile need PyTorch >= 2.4; with an older torch (Debian's 1.13 on the CI
machine) those tests are skipped and say so, and the meta-device tests still run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import winnow
from operator_samples import DIFFERENTIABLE, FUNCTIONS, KERNELS, operator, samples

TORCH_VERSION = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
needs_modern_torch = pytest.mark.skipif(
    TORCH_VERSION < (2, 4),
    reason=f"torch.library.opcheck and traceable custom operators need torch >= 2.4; "
           f"this is torch {torch.__version__}")


def tensors_of(outputs):
    return list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]


def to_device(x, device):
    return x.to(device) if isinstance(x, torch.Tensor) else x


def meta_copy(x):
    if isinstance(x, torch.Tensor):
        return x.detach().to("meta").requires_grad_(x.requires_grad)
    return x


def test_every_operator_has_samples():
    # The schemas defined in the binding (torch 1.13 cannot list a namespace's operators).
    source = (Path(__file__).resolve().parents[2] / "src" / "torch" / "ops.cpp").read_text()
    registered = set(re.findall(r'm\.def\(\s*"(\w+)\(', source))
    assert registered == set(DIFFERENTIABLE) | set(KERNELS)
    for name in registered:
        assert hasattr(torch.ops.winnow, name)
    sampled = {s.op for s in samples()}
    assert sampled == registered


def test_every_differentiable_operator_has_its_package_function():
    # The compile checks call operators through FUNCTIONS; one missing there fails only where
    # torch.compile runs (torch >= 2.4), so check the table here too.
    assert set(FUNCTIONS) == set(DIFFERENTIABLE)
    for name, fn in FUNCTIONS.items():
        assert fn is getattr(winnow, name)


@pytest.mark.parametrize("sample", samples(requires_grad=False), ids=str)
def test_meta_outputs_match_real_outputs(sample):
    real = tensors_of(operator(sample)(*sample.args, **sample.kwargs))
    meta = tensors_of(operator(sample)(*(meta_copy(a) for a in sample.args),
                                       **{k: meta_copy(v) for k, v in sample.kwargs.items()}))
    assert len(meta) == len(real)
    for m, r in zip(meta, real):
        assert m.device.type == "meta"
        assert (m.shape, m.dtype, m.stride()) == (r.shape, r.dtype, r.stride())


@pytest.mark.parametrize("name", DIFFERENTIABLE)
def test_meta_backward_gives_gradients_of_the_inputs_shapes(name):
    sample = next(s for s in samples() if s.op == name)
    args = [meta_copy(a) for a in sample.args]
    kwargs = {k: meta_copy(v) for k, v in sample.kwargs.items()}
    outputs = tensors_of(operator(sample)(*args, **kwargs))
    differentiable = [o for o in outputs if o.is_floating_point()]
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    grads = torch.autograd.grad(differentiable, leaves, [torch.ones_like(o) for o in differentiable])
    for g, a in zip(grads, leaves):
        assert g.device.type == "meta" and g.shape == a.shape and g.dtype == a.dtype


def test_meta_kernels_name_a_wrong_rank():
    q = torch.empty(8, 16, device="meta")
    with pytest.raises(ValueError, match="argument 'q': expected a tensor of 3 or 4 dimensions"):
        torch.ops.winnow.stick_breaking_attention(q, q, q)


@needs_modern_torch
@pytest.mark.parametrize("sample", samples(), ids=str)
def test_opcheck(sample):
    torch.library.opcheck(operator(sample), sample.args, sample.kwargs)


def weighted_loss(outputs, weights):
    return sum((o.double() * w).sum() for o, w in zip(outputs, weights))


def call_with_loss(name, tensors, options):
    """The package function `name` on tensors (q, k, v[, cu_q, cu_k]), (x, cos, sin) or
    (x, weight), and a
    scalar of its floating outputs with fixed weights, so every output carries a gradient."""
    fn = FUNCTIONS[name]
    if "rotary_cos" in options:  # the operator's table arguments are the package's rotary pair
        options = dict(options)
        options["rotary"] = (options.pop("rotary_cos"), options.pop("rotary_sin"))
    if name in ("rotary_embedding", "rms_norm", "add_rms_norm", "swiglu"):
        outputs = tensors_of(fn(*tensors, **options))
    elif name == "threshold_attention":  # (q, k, v, beta[, cu_q, cu_k])
        q, k, v, beta, *cu = tensors
        extra = dict(cu_seqlens_q=cu[0], cu_seqlens_k=cu[1]) if cu else {}
        outputs = tensors_of(fn(q, k, v, beta, **extra, **options))
    elif name == "gsa_sparse_attention":  # (q, k, v, indices, counts[, cu_q, cu_k])
        q, k, v, indices, counts, *cu = tensors
        extra = dict(cu_seqlens_q=cu[0], cu_seqlens_k=cu[1]) if cu else {}
        outputs = tensors_of(fn(q, k, v, indices, counts, **extra, **options))
    elif name == "gsa_indexer_loss":  # (iq, ik, iw, ib, attention_q, attention_k[, indices, counts])
        outputs = tensors_of(fn(*tensors, **options))  # batched samples only
    elif name == "screening_attention":  # (q, k, v, s_w, s_r[, cu_q, cu_k])
        q, k, v, s_w, s_r, *cu = tensors
        extra = dict(cu_seqlens_q=cu[0], cu_seqlens_k=cu[1]) if cu else {}
        outputs = tensors_of(fn(q, k, v, s_w, s_r, **extra, **options))
    else:
        q, k, v, *cu = tensors
        extra = dict(cu_seqlens_q=cu[0], cu_seqlens_k=cu[1]) if cu else {}
        outputs = tensors_of(fn(q, k, v, **extra, **options))
    floats = [o for o in outputs if o.is_floating_point()]
    weights = [torch.cos(torch.arange(o.numel(), device=o.device, dtype=torch.float64)
                         ).reshape(o.shape) for o in floats]
    return outputs, weighted_loss(floats, weights)


def longer(tensors):
    """The same batched call with every sequence twice as long (q, k, v along dim 1; rotary's
    x and tables along their length; RMSNorm's x and SwiGLU's gate and up along their rows)."""
    if len(tensors) == 2 and tensors[1].dim() == 1:  # rms_norm: x (B, L, C), weight (C)
        x, w = tensors
        return [torch.cat([x.detach()] * 2, 1).requires_grad_(x.requires_grad), w]
    if len(tensors) == 3 and tensors[2].dim() == 1:  # add_rms_norm: x, residual, weight
        x, r, w = tensors
        return [torch.cat([t.detach()] * 2, 1).requires_grad_(t.requires_grad) for t in (x, r)] + [w]
    if len(tensors) == 3 and tensors[1].dim() == 2:  # rotary: x (B, L, H, D), cos, sin (L, D/2)
        x, cos, sin = tensors
        return [torch.cat([x.detach()] * 2, 1).requires_grad_(x.requires_grad),
                torch.cat([cos] * 2), torch.cat([sin] * 2)]
    # Attention: q, k, v along their length; per-head scalars (1-D) as they are.
    return [torch.cat([t.detach()] * 2, 1).requires_grad_(t.requires_grad) if t.dim() > 1 else t
            for t in tensors]


def compile_check(name, device, dtype, d, backend, rtol, atol):
    """Compiles the package function (fullgraph, dynamic shapes) and runs it on every sample
    call of `name`, with and without gradients: outputs and gradients must match eager. A
    batched call run again at twice its length must not compile again."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)

    def run(tensors, options):
        return call_with_loss(name, tensors, options)

    compiled = torch.compile(run, fullgraph=True, dynamic=True, backend=counter)

    def check(tensors, options):
        leaves = [t for t in tensors if t.requires_grad]
        eager_out, eager_loss = run(tensors, options)
        eager_grads = torch.autograd.grad(eager_loss, leaves)
        comp_out, comp_loss = compiled(tensors, options)
        comp_grads = torch.autograd.grad(comp_loss, leaves)
        for a, b in zip(comp_out, eager_out):
            torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
        for a, b in zip(comp_grads, eager_grads):
            torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
        with torch.no_grad():
            inference_out, _ = compiled(tensors, options)
        for a, b in zip(inference_out, eager_out):
            torch.testing.assert_close(a, b, rtol=rtol, atol=atol)

    for sample in (s for s in samples(device, dtype, d=d) if s.op == name):
        tensors = list(sample.args)
        if "cu_seqlens_q" in sample.kwargs:
            tensors += [sample.kwargs["cu_seqlens_q"], sample.kwargs["cu_seqlens_k"]]
        options = {k: v for k, v in sample.kwargs.items() if not k.startswith("cu_seqlens")}
        check(tensors, options)
        if sample.label in ("batched", "rotate", "same"):
            frames = counter.frame_count
            check(longer(tensors), options)
            assert counter.frame_count == frames, f"{sample}: compiled again for a longer input"
    assert counter.frame_count > 0


@needs_modern_torch
@pytest.mark.parametrize("name", DIFFERENTIABLE)
def test_compile_fullgraph_dynamic_matches_eager(name):
    compile_check(name, "cpu", torch.float64, 16, "aot_eager", 1e-10, 1e-10)


@needs_modern_torch
def test_gsa_selection_and_attention_compile_as_one_graph():
    """GSA's two operators the way a layer calls them (the selection's lists, trusted, into the
    sparse attention) compiled with fullgraph and dynamic shapes: outputs and gradients match
    eager, and a sequence twice as long does not compile again."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")

    def layer(q, k, v, iq, ik, iw, ib):
        indices, counts, variance = winnow.gsa_select_keys(iq, ik, iw, ib, k_max=6, k_base=3,
                                                           k_min=2, mean_variance=0.02)
        return winnow.gsa_sparse_attention(q, k, v, indices, counts, trusted=True), counts, variance

    compiled = torch.compile(layer, fullgraph=True, dynamic=True, backend=counter)
    gen = torch.Generator().manual_seed(0)
    for length in (13, 26):
        def rnd(*shape, grad=False):
            t = torch.randn(*shape, generator=gen, dtype=torch.float64)
            return t.requires_grad_(grad)
        q = rnd(2, length, 4, 8, grad=True)
        k, v = rnd(2, length, 2, 8, grad=True), rnd(2, length, 2, 8, grad=True)
        indexer = (rnd(2, length, 3, 8), rnd(2, length, 1, 8), rnd(2, length, 3), rnd(3))
        eager = layer(q, k, v, *indexer)
        got = compiled(q, k, v, *indexer)
        assert torch.equal(got[1], eager[1])
        for a, b in ((got[0], eager[0]), (got[2], eager[2])):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        w = torch.randn(eager[0].shape, generator=gen, dtype=torch.float64)
        for a, b in zip(torch.autograd.grad((got[0] * w).sum(), (q, k, v)),
                        torch.autograd.grad((eager[0] * w).sum(), (q, k, v))):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert counter.frame_count == 1

