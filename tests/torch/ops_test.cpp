// The LibTorch operators from C++: dispatch through torch.ops.winnow.*, autograd against the
// float64 reference reached through the same binding, and against an independent composed
// LibTorch expression; strided inputs; errors surfacing as c10 exceptions.
#include <ATen/core/dispatch/Dispatcher.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>

#include "winnow/entmax.h"
#include "winnow/gsa.h"
#include "winnow/torch/bridge.h"
#include "winnow/torch/ops.h"
#include "support/expect_value_error.h"

namespace {

using torch::Tensor;

c10::OperatorHandle op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

// Calls an operator with positional IValues, returns its outputs.
std::vector<c10::IValue> call(const char* name, std::vector<c10::IValue> args) {
  auto handle = op(name);
  const auto& schema = handle.schema();
  // Fill defaults for trailing arguments not given.
  for (std::size_t i = args.size(); i < schema.arguments().size(); ++i) {
    args.push_back(*schema.arguments()[i].default_value());
  }
  torch::jit::Stack stack(args.begin(), args.end());
  handle.callBoxed(&stack);
  return std::vector<c10::IValue>(stack.begin(), stack.end());
}

// Stick-breaking written with plain LibTorch operations on (B, L, H, D) inputs, as the spec
// states it: log A_ij = z_ij - sum_{k >= i, visible} softplus(z_kj). Autograd differentiates it.
std::pair<Tensor, Tensor> composed_stick_breaking(const Tensor& q, const Tensor& k,
                                                  const Tensor& v, bool attend_current) {
  const int64_t L = q.size(1), D = q.size(3);
  const int64_t group = q.size(2) / k.size(2);
  Tensor qh = q.transpose(1, 2);                                     // B H L D
  Tensor kh = k.repeat_interleave(group, 2).transpose(1, 2);
  Tensor vh = v.repeat_interleave(group, 2).transpose(1, 2);
  Tensor z = torch::matmul(qh, kh.transpose(-1, -2)) / std::sqrt(static_cast<double>(D));
  Tensor visible = torch::ones({L, L}, torch::kBool).tril(attend_current ? 0 : -1);
  Tensor cost = torch::where(visible, torch::nn::functional::softplus(z), torch::zeros_like(z));
  Tensor suffix = cost.flip(-1).cumsum(-1).flip(-1);
  Tensor w = torch::where(visible, torch::exp(z - suffix), torch::zeros_like(z));
  Tensor out = torch::matmul(w, vh).transpose(1, 2);
  Tensor log_rem = -cost.sum(-1).transpose(1, 2);
  return {out, log_rem};
}

Tensor composed_softmax(const Tensor& q, const Tensor& k, const Tensor& v) {
  const int64_t L = q.size(1), D = q.size(3);
  const int64_t group = q.size(2) / k.size(2);
  Tensor qh = q.transpose(1, 2);
  Tensor kh = k.repeat_interleave(group, 2).transpose(1, 2);
  Tensor vh = v.repeat_interleave(group, 2).transpose(1, 2);
  Tensor z = torch::matmul(qh, kh.transpose(-1, -2)) / std::sqrt(static_cast<double>(D));
  Tensor mask = torch::ones({L, L}, torch::kBool).tril();
  z = z.masked_fill(mask.logical_not(), -std::numeric_limits<double>::infinity());
  return torch::matmul(torch::softmax(z, -1), vh).transpose(1, 2);
}

double rel(const Tensor& a, const Tensor& b) {
  return (a.to(torch::kDouble) - b.to(torch::kDouble)).norm().item<double>() /
         b.to(torch::kDouble).norm().item<double>();
}

TEST(TorchOps, AreRegistered) {
  for (const char* name :
       {"winnow::softmax_attention", "winnow::softmax_attention_forward",
        "winnow::softmax_attention_backward", "winnow::stick_breaking_attention",
        "winnow::stick_breaking_attention_forward", "winnow::stick_breaking_attention_backward",
        "winnow::entmax_attention", "winnow::entmax_attention_forward",
        "winnow::entmax_attention_backward", "winnow::sieve_attention",
        "winnow::sieve_attention_forward", "winnow::sieve_attention_backward",
        "winnow::gsa_select_keys", "winnow::gsa_sparse_attention",
        "winnow::gsa_sparse_attention_forward", "winnow::gsa_sparse_attention_backward"}) {
    EXPECT_NO_THROW(op(name)) << name;
  }
}

TEST(TorchOps, StickBreakingAutogradMatchesComposedExpression) {
  torch::manual_seed(0);
  auto opts = torch::dtype(torch::kDouble);
  // (B, L, H, D) views of (B, H, L, D) storage: strided inputs.
  Tensor q = torch::randn({2, 4, 37, 16}, opts).transpose(1, 2).requires_grad_();
  Tensor k = torch::randn({2, 2, 37, 16}, opts).transpose(1, 2).requires_grad_();
  Tensor v = torch::randn({2, 37, 2, 24}, opts).requires_grad_();
  Tensor w_out = torch::randn({2, 37, 4, 24}, opts), w_rem = torch::randn({2, 37, 4}, opts);

  auto outs = call("winnow::stick_breaking_attention", {q, k, v});
  Tensor out = outs[0].toTensor(), rem = outs[1].toTensor();
  ((out * w_out).sum() + (rem * w_rem).sum()).backward();
  Tensor dq = q.grad().clone(), dk = k.grad().clone(), dv = v.grad().clone();

  Tensor q2 = q.detach().clone().requires_grad_(), k2 = k.detach().clone().requires_grad_(),
         v2 = v.detach().clone().requires_grad_();
  auto [cout, clog_rem] = composed_stick_breaking(q2, k2, v2, false);
  ((cout * w_out).sum() + (clog_rem.exp() * w_rem).sum()).backward();

  EXPECT_LT(rel(out, cout), 1e-12);
  EXPECT_LT(rel(rem, clog_rem.exp()), 1e-12);
  EXPECT_LT(rel(dq, q2.grad()), 1e-10);
  EXPECT_LT(rel(dk, k2.grad()), 1e-10);
  EXPECT_LT(rel(dv, v2.grad()), 1e-10);
}

TEST(TorchOps, SoftmaxAutogradMatchesComposedExpressionInFloat32) {
  torch::manual_seed(1);
  Tensor q = torch::randn({1, 100, 4, 64}).requires_grad_();
  Tensor k = torch::randn({1, 100, 1, 64}).requires_grad_();
  Tensor v = torch::randn({1, 100, 1, 64}).requires_grad_();
  Tensor w = torch::randn({1, 100, 4, 64});
  Tensor out = call("winnow::softmax_attention", {q, k, v})[0].toTensor();
  (out * w).sum().backward();

  Tensor q2 = q.detach().to(torch::kDouble).requires_grad_();
  Tensor k2 = k.detach().to(torch::kDouble).requires_grad_();
  Tensor v2 = v.detach().to(torch::kDouble).requires_grad_();
  Tensor ref = composed_softmax(q2, k2, v2);
  (ref * w.to(torch::kDouble)).sum().backward();
  EXPECT_LT(rel(out, ref), 1e-5);
  EXPECT_LT(rel(q.grad(), q2.grad()), 1e-5);
  EXPECT_LT(rel(k.grad(), k2.grad()), 1e-5);
  EXPECT_LT(rel(v.grad(), v2.grad()), 1e-5);
}

// q, k and v split from one projection (nn::project): their gradients come back as views of
// one tensor with the same layout (no concatenation in the projection's backward), equal to
// those of separate tensors.
TEST(TorchOps, HeadsOfOneProjectionGetGradientsInOneBuffer) {
  torch::manual_seed(7);
  const int64_t B = 2, L = 19, Hq = 4, Hkv = 2, D = 16;
  Tensor qkv = torch::randn({B, L, (Hq + 2 * Hkv) * D}, torch::kDouble).requires_grad_();
  auto parts = qkv.split_with_sizes({Hq * D, Hkv * D, Hkv * D}, -1);
  Tensor q = parts[0].view({B, L, Hq, D}), k = parts[1].view({B, L, Hkv, D}), v = parts[2].view({B, L, Hkv, D});
  ASSERT_TRUE(winnow::torch_ops::heads_side_by_side({q, k, v}).defined());
  Tensor w = torch::randn({B, L, Hq, D}, torch::kDouble);
  Tensor qs = q.detach().clone().requires_grad_(), ks = k.detach().clone().requires_grad_(),
         vs = v.detach().clone().requires_grad_();
  for (const char* name : {"winnow::softmax_attention", "winnow::stick_breaking_attention",
                           "winnow::entmax_attention", "winnow::sieve_attention"}) {
    SCOPED_TRACE(name);
    Tensor out = call(name, {q, k, v})[0].toTensor();
    auto grads = torch::autograd::grad({(out * w).sum()}, {q, k, v});
    Tensor ref = call(name, {qs, ks, vs})[0].toTensor();
    auto want = torch::autograd::grad({(ref * w).sum()}, {qs, ks, vs});
    EXPECT_LT(rel(out, ref), 1e-14);
    ASSERT_TRUE(winnow::torch_ops::heads_side_by_side({grads[0], grads[1], grads[2]}).defined());
    EXPECT_EQ(grads[0].strides(), q.strides());
    for (int i = 0; i < 3; ++i) EXPECT_LT(rel(grads[i], want[i]), 1e-14) << i;
    EXPECT_FALSE(winnow::torch_ops::heads_side_by_side({want[0], want[1], want[2]}).defined());
  }
}

// Rotary embedding inside softmax attention equals rotating q and k first, for suffix queries
// (their own tensors) and for heads of one projection (one launch, gradients rotated back in
// place in one buffer).
TEST(TorchOps, SoftmaxRotaryInsideEqualsRotatingFirst) {
  torch::manual_seed(8);
  const int64_t B = 2, Hq = 4, Hkv = 1, D = 16;
  for (const bool one_projection : {false, true}) {
    SCOPED_TRACE(one_projection ? "one projection" : "suffix queries");
    const int64_t Lk = 23, Lq = one_projection ? Lk : 10;
    Tensor q, k, v;
    if (one_projection) {
      Tensor qkv = torch::randn({B, Lk, (Hq + 2 * Hkv) * D}, torch::kDouble);
      auto parts = qkv.split_with_sizes({Hq * D, Hkv * D, Hkv * D}, -1);
      q = parts[0].view({B, Lq, Hq, D});
      k = parts[1].view({B, Lk, Hkv, D});
      v = parts[2].view({B, Lk, Hkv, D});
    } else {
      q = torch::randn({B, Lq, Hq, D}, torch::kDouble);
      k = torch::randn({B, Hkv, Lk, D}, torch::kDouble).transpose(1, 2);  // strided
      v = torch::randn({B, Lk, Hkv, D}, torch::kDouble);
    }
    q.requires_grad_();
    k.requires_grad_();
    v.requires_grad_();
    Tensor angles = torch::rand({Lk, D / 2}, torch::kDouble) * 7.0;
    Tensor cos = angles.cos() * 1.1, sin = angles.sin() * 1.1;
    Tensor w = torch::randn({B, Lq, Hq, D}, torch::kDouble);
    winnow::torch_ops::AttentionCall with;
    with.rotary_cos = cos;
    with.rotary_sin = sin;
    Tensor out = winnow::torch_ops::softmax_attention(q, k, v, with);
    auto grads = torch::autograd::grad({(out * w).sum()}, {q, k, v});

    Tensor qr = winnow::torch_ops::rotary_embedding(q, cos.narrow(0, Lk - Lq, Lq), sin.narrow(0, Lk - Lq, Lq));
    Tensor kr = winnow::torch_ops::rotary_embedding(k, cos, sin);
    Tensor ref = winnow::torch_ops::softmax_attention(qr, kr, v, {});
    auto want = torch::autograd::grad({(ref * w).sum()}, {q, k, v});
    EXPECT_LT(rel(out, ref), 1e-13);
    for (int i = 0; i < 3; ++i) EXPECT_LT(rel(grads[i], want[i]), 1e-13) << i;
    EXPECT_EQ(winnow::torch_ops::heads_side_by_side({grads[0], grads[1], grads[2]}).defined(), one_projection);
  }
}

TEST(TorchOps, ForwardAndBackwardOpsAgreeWithTheReferenceBackend) {
  torch::manual_seed(2);
  Tensor q = torch::randn({21, 2, 32}), k = torch::randn({30, 2, 32}), v = torch::randn({30, 2, 16});
  Tensor cu_q = torch::tensor({0, 6, 6, 21}, torch::kInt), cu_k = torch::tensor({0, 9, 15, 30}, torch::kInt);
  Tensor dout = torch::randn({21, 2, 16}), dlog_rem = torch::randn({21, 2});
  auto fast = call("winnow::stick_breaking_attention_forward", {q, k, v, cu_q, cu_k});
  auto fast_grads = call("winnow::stick_breaking_attention_backward",
                         {q, k, v, fast[0], fast[1], fast[2], dout, dlog_rem, cu_q, cu_k});
  auto d = [](const Tensor& t) { return t.to(torch::kDouble); };
  auto ref = call("winnow::stick_breaking_attention_forward",
                  {d(q), d(k), d(v), cu_q, cu_k, c10::IValue(), false, 0.0, true});
  auto ref_grads = call("winnow::stick_breaking_attention_backward",
                        {d(q), d(k), d(v), ref[0], ref[1], ref[2], d(dout), d(dlog_rem), cu_q, cu_k,
                         c10::IValue(), false, 0.0, false, true});
  EXPECT_LT(rel(fast[0].toTensor(), ref[0].toTensor()), 1e-5);
  EXPECT_LT(rel(fast[1].toTensor(), ref[1].toTensor()), 1e-5);
  for (int i = 0; i < 3; ++i) {
    EXPECT_LT(rel(fast_grads[i].toTensor(), ref_grads[i].toTensor()), 1e-5) << "grad " << i;
  }
}

// The float32 CPU kernels against the float64 reference through the same operators, on varlen
// input with an empty sequence and queries that are a suffix of their keys.
TEST(TorchOps, EntmaxForwardAndBackwardOpsAgreeWithTheReferenceBackend) {
  torch::manual_seed(3);
  Tensor q = torch::randn({21, 4, 32}) * 2, k = torch::randn({30, 2, 32}), v = torch::randn({30, 2, 16});
  Tensor cu_q = torch::tensor({0, 6, 6, 21}, torch::kInt), cu_k = torch::tensor({0, 9, 15, 30}, torch::kInt);
  Tensor dout = torch::randn({21, 4, 16});
  auto d = [](const Tensor& t) { return t.to(torch::kDouble); };
  for (const double alpha : {1.5, 2.0, 1.25}) {
    auto fast = call("winnow::entmax_attention_forward",
                     {q, k, v, cu_q, cu_k, c10::IValue(), true, alpha});
    auto fast_grads = call("winnow::entmax_attention_backward",
                           {q, k, v, fast[0], fast[1], dout, cu_q, cu_k, c10::IValue(), true, alpha});
    auto ref = call("winnow::entmax_attention_forward",
                    {d(q), d(k), d(v), cu_q, cu_k, c10::IValue(), true, alpha, c10::IValue(), true});
    auto ref_grads = call("winnow::entmax_attention_backward",
                          {d(q), d(k), d(v), ref[0], ref[1], d(dout), cu_q, cu_k, c10::IValue(),
                           true, alpha, false, true});
    EXPECT_LT(rel(fast[0].toTensor(), ref[0].toTensor()), 1e-5) << "alpha " << alpha;
    EXPECT_LT(rel(fast[1].toTensor(), ref[1].toTensor()), 1e-5) << "alpha " << alpha;
    for (int i = 0; i < 3; ++i) {
      EXPECT_LT(rel(fast_grads[i].toTensor(), ref_grads[i].toTensor()), 1e-5)
          << "alpha " << alpha << " grad " << i;
    }
  }
}

// The support record (winnow/entmax.h) has its documented length, and a forward whose path
// does not list (the CPU kernels) says so in its first element: a backward handed that record
// then finds the supports itself and gives the gradients it gives without one. A record of
// the wrong length is refused, naming the argument.
TEST(TorchOps, EntmaxSupportRecordOnTheCpuIsMarkedUnlisted) {
  torch::manual_seed(5);
  Tensor q = torch::randn({2, 13, 4, 16}), k = torch::randn({2, 13, 2, 16}), v = torch::randn({2, 13, 2, 8});
  Tensor dout = torch::randn({2, 13, 4, 8});
  auto fwd = call("winnow::entmax_attention_forward",
                  {q, k, v, c10::IValue(), c10::IValue(), c10::IValue(), true, 1.5, c10::IValue(), false, true});
  const Tensor record = fwd[2].toTensor();
  ASSERT_EQ(record.numel(), winnow::entmax::support_record_size<std::int64_t>(2 * 13 * 4, 2 * 13 * 2));
  EXPECT_EQ(record.scalar_type(), torch::kInt);
  EXPECT_EQ(record[0].item<int>(), 0);
  auto no_record = call("winnow::entmax_attention_forward", {q, k, v});
  EXPECT_EQ(no_record[2].toTensor().numel(), 0);
  auto with = call("winnow::entmax_attention_backward",
                   {q, k, v, fwd[0], fwd[1], dout, c10::IValue(), c10::IValue(), c10::IValue(), true, 1.5,
                    false, false, record});
  auto without = call("winnow::entmax_attention_backward",
                      {q, k, v, fwd[0], fwd[1], dout, c10::IValue(), c10::IValue(), c10::IValue(), true, 1.5});
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(torch::equal(with[i].toTensor(), without[i].toTensor())) << "grad " << i;
  try {
    call("winnow::entmax_attention_backward",
         {q, k, v, fwd[0], fwd[1], dout, c10::IValue(), c10::IValue(), c10::IValue(), true, 1.5, false, false,
          record.narrow(0, 0, record.numel() - 1)});
    FAIL() << "a short record passed";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("support"), std::string::npos) << e.what();
  }
}

// Autograd through the public op (out, rem) against the reference's own backward, for both
// filters; the count is the same integer tensor from both backends.
TEST(TorchOps, SieveAutogradAgreesWithTheReferenceBackend) {
  torch::manual_seed(4);
  auto opts = torch::dtype(torch::kDouble);
  for (const char* filter : {"exact", "bound"}) {
    Tensor q = (torch::randn({2, 4, 29, 16}, opts) * 2).transpose(1, 2).requires_grad_();
    Tensor k = torch::randn({2, 40, 2, 16}, opts).requires_grad_();
    Tensor v = torch::randn({2, 40, 2, 8}, opts).requires_grad_();
    Tensor w_out = torch::randn({2, 29, 4, 8}, opts), w_rem = torch::randn({2, 29, 4}, opts);
    auto outs = call("winnow::sieve_attention",
                     {q, k, v, c10::IValue(), c10::IValue(), c10::IValue(), false, 1.5, filter});
    Tensor out = outs[0].toTensor(), rem = outs[1].toTensor(), count = outs[2].toTensor();
    ((out * w_out).sum() + (rem * w_rem).sum()).backward();

    auto ref = call("winnow::sieve_attention_forward",
                    {q.detach(), k.detach(), v.detach(), c10::IValue(), c10::IValue(),
                     c10::IValue(), false, 1.5, filter, c10::IValue(), c10::IValue(), true});
    Tensor ref_log_rem = ref[1].toTensor();
    auto ref_grads = call("winnow::sieve_attention_backward",
                          {q.detach(), k.detach(), v.detach(), ref[0], ref_log_rem, ref[2], w_out,
                           w_rem * ref_log_rem.exp(), c10::IValue(), c10::IValue(), c10::IValue(),
                           false, 1.5, filter, c10::IValue(), false, true});
    EXPECT_LT(rel(out, ref[0].toTensor()), 1e-12) << filter;
    EXPECT_LT(rel(rem, ref_log_rem.exp()), 1e-12) << filter;
    EXPECT_TRUE(torch::equal(count, ref[3].toTensor())) << filter;
    EXPECT_GT(count.max().item<int>(), 0) << filter;
    EXPECT_LT(count.min().item<int>(), 39) << filter;  // the filter removed keys
    EXPECT_LT(rel(q.grad(), ref_grads[0].toTensor()), 1e-10) << filter;
    EXPECT_LT(rel(k.grad(), ref_grads[1].toTensor()), 1e-10) << filter;
    EXPECT_LT(rel(v.grad(), ref_grads[2].toTensor()), 1e-10) << filter;
  }
}

TEST(TorchOps, BadArgumentsRaiseValueErrorsNamingTheArgument) {
  Tensor q = torch::randn({1, 8, 2, 16}), k = torch::randn({1, 8, 2, 16});
  Tensor v = torch::randn({1, 7, 2, 16});
  try {
    call("winnow::stick_breaking_attention", {q, k, v});
    ADD_FAILURE() << "no error";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("argument 'v'"), std::string::npos) << e.what();
  }
  try {
    call("winnow::softmax_attention", {q.to(torch::kInt), k, v});
    ADD_FAILURE() << "no error";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("argument 'q'"), std::string::npos) << e.what();
  }
  try {
    call("winnow::sieve_attention", {q, k, k, c10::IValue(), c10::IValue(), c10::IValue(), false,
                                     1.5, "exact", 0.5});
    ADD_FAILURE() << "no error";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("argument 'eps'"), std::string::npos) << e.what();
  }
  try {
    call("winnow::entmax_attention", {q, k, k, c10::IValue(), c10::IValue(), c10::IValue(), true, 0.5});
    ADD_FAILURE() << "no error";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("argument 'alpha'"), std::string::npos) << e.what();
  }
}

// ------------------------------------------------------------------ GSA

// An indexer problem: q (B, Lq, H_I, d_I) as a view of (B, H_I, Lq, d_I) storage, k (B, Lk, 1,
// d_I), head weights (B, Lq, H_I), bias (H_I) in the statistics' dtype.
struct Indexer {
  Tensor q, k, w, bias;
};
Indexer make_indexer(int64_t b, int64_t lq, int64_t lk, torch::Dtype dtype) {
  auto opts = torch::dtype(dtype);
  const auto stats = dtype == torch::kDouble ? torch::kDouble : torch::kFloat;
  return {torch::randn({b, 3, lq, 8}, opts).transpose(1, 2), torch::randn({b, lk, 1, 8}, opts),
          torch::randn({b, lq, 3}, opts), torch::randn({3}, torch::dtype(stats)) * 0.5};
}

// winnow.gsa_select_keys with its arguments in schema order.
std::vector<c10::IValue> select_keys(const Indexer& in, c10::IValue bias, int64_t k_max, const std::string& form,
                                     const std::string& budget, c10::IValue k_fixed = c10::IValue(),
                                     int64_t k_base = 0, int64_t k_min = 1, double mean_variance = 1.0,
                                     c10::IValue cu_q = c10::IValue(), c10::IValue cu_k = c10::IValue(),
                                     bool reference = false) {
  return call("winnow::gsa_select_keys", {in.q, in.k, in.w, std::move(bias), k_max, std::move(cu_q), std::move(cu_k),
                                          form, c10::IValue(), budget, std::move(k_fixed), k_base, k_min,
                                          mean_variance, reference});
}

winnow::gsa::Budget budget_of(const std::string& name) {
  if (name == "fixed") return winnow::gsa::Budget::fixed;
  if (name == "eq8") return winnow::gsa::Budget::eq8;
  if (name == "reference") return winnow::gsa::Budget::reference;
  return winnow::gsa::Budget::inverse_variance;
}

// (B, Lq, k_max) lists, -1 padded -> (B, Lq, Lk): key s is in query t's list.
Tensor list_mask(const Tensor& indices, int64_t lk) {
  Tensor idx = torch::where(indices >= 0, indices, torch::full_like(indices, lk)).to(torch::kLong);
  Tensor mask = torch::zeros({indices.size(0), indices.size(1), lk + 1}, torch::kBool);
  mask.scatter_(2, idx, true);
  return mask.slice(2, 0, lk);
}

// Dense softmax attention with every key outside the query's list masked out.
Tensor composed_list_softmax(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask) {
  const int64_t group = q.size(2) / k.size(2);
  Tensor qh = q.transpose(1, 2);
  Tensor kh = k.repeat_interleave(group, 2).transpose(1, 2);
  Tensor vh = v.repeat_interleave(group, 2).transpose(1, 2);
  Tensor z = torch::matmul(qh, kh.transpose(-1, -2)) / std::sqrt(static_cast<double>(q.size(3)));
  z = z.masked_fill(mask.unsqueeze(1).logical_not(), -std::numeric_limits<double>::infinity());
  return torch::matmul(torch::softmax(z, -1), vh).transpose(1, 2);
}

// The operator is the C++ API behind a binding: the same bits as winnow::gsa::select_keys on
// views of the same tensors, for every budget rule and both score forms, batched with strided
// queries and packed; and the C++ entry point (torch/ops.h) agrees.
TEST(TorchOps, GsaSelectKeysOperatorIsTheCApi) {
  torch::manual_seed(11);
  using winnow::torch_ops::view_of;
  for (const auto dtype : {torch::kFloat, torch::kDouble}) {
    for (const bool packed : {false, true}) {
      Indexer in = make_indexer(2, 19, 27, dtype);
      c10::IValue cu_q, cu_k;
      Tensor cu_q_t, cu_k_t;
      if (packed) {  // lengths (4 of 11 keys, 0 of 5, 15 of 27)
        in = {torch::randn({19, 3, 8}, torch::dtype(dtype)), torch::randn({43, 1, 8}, torch::dtype(dtype)),
              torch::randn({19, 3}, torch::dtype(dtype)), in.bias};
        cu_q_t = torch::tensor({0, 4, 4, 19}, torch::kInt);
        cu_k_t = torch::tensor({0, 11, 16, 43}, torch::kInt);
        cu_q = cu_q_t;
        cu_k = cu_k_t;
      }
      for (const std::string form : {"sigmoid", "relu"}) {
        for (const std::string budget : {"fixed", "inverse_variance", "eq8", "reference"}) {
          const std::string label = form + " " + budget + (packed ? " packed" : " batched");
          const bool sigmoid = form == "sigmoid";
          c10::IValue bias = sigmoid ? c10::IValue(in.bias) : c10::IValue();
          c10::IValue k_fixed = budget == "fixed" ? c10::IValue(int64_t{5}) : c10::IValue();
          auto got = select_keys(in, bias, 7, form, budget, k_fixed, 4, 2, 0.01, cu_q, cu_k);
          Tensor indices = got[0].toTensor(), counts = got[1].toTensor(), variance = got[2].toTensor();

          winnow::gsa::IndexerInputs api_in;
          api_in.q = view_of(in.q, "test", "q");
          api_in.k = view_of(in.k, "test", "k");
          api_in.head_weights = view_of(in.w, "test", "head_weights");
          if (sigmoid) api_in.bias = view_of(in.bias, "test", "bias");
          if (packed) {
            api_in.cu_seqlens_q = view_of(cu_q_t, "test", "cu_seqlens_q");
            api_in.cu_seqlens_k = view_of(cu_k_t, "test", "cu_seqlens_k");
          }
          winnow::gsa::IndexerOptions o;
          o.form = sigmoid ? winnow::gsa::ScoreForm::sigmoid : winnow::gsa::ScoreForm::relu;
          o.budget = budget_of(budget);
          o.k = 5;
          o.k_base = 4;
          o.k_min = 2;
          o.k_max = 7;
          o.mean_variance = 0.01;
          Tensor want_indices = torch::full_like(indices, -7), want_counts = torch::full_like(counts, -7),
                 want_variance = torch::full_like(variance, -7);
          winnow::gsa::select_keys(api_in, o,
                                   {view_of(want_indices, "test", "indices"), view_of(want_counts, "test", "counts"),
                                    view_of(want_variance, "test", "variance")});
          EXPECT_EQ(indices.sizes(), want_indices.sizes()) << label;
          EXPECT_EQ(indices.scalar_type(), torch::kInt) << label;
          EXPECT_EQ(variance.scalar_type(), dtype) << label;
          EXPECT_TRUE(torch::equal(indices, want_indices)) << label;
          EXPECT_TRUE(torch::equal(counts, want_counts)) << label;
          EXPECT_TRUE(torch::equal(variance, want_variance)) << label;

          auto [e_indices, e_counts, e_variance] = winnow::torch_ops::gsa_select_keys(
              in.q, in.k, in.w, sigmoid ? winnow::torch_ops::Opt<Tensor>(in.bias) : winnow::torch_ops::Opt<Tensor>(),
              o, packed ? winnow::torch_ops::Opt<Tensor>(cu_q_t) : winnow::torch_ops::Opt<Tensor>(),
              packed ? winnow::torch_ops::Opt<Tensor>(cu_k_t) : winnow::torch_ops::Opt<Tensor>());
          EXPECT_TRUE(torch::equal(e_indices, indices)) << label;
          EXPECT_TRUE(torch::equal(e_counts, counts)) << label;
          EXPECT_TRUE(torch::equal(e_variance, variance)) << label;
        }
      }
    }
  }
}

// With lists of every visible key (a fixed budget of at least Lk) the sparse attention is
// causal softmax attention: output and every gradient, GQA (4 query heads per kv head), Dv != D,
// queries a suffix of the keys, strided inputs.
TEST(TorchOps, GsaSparseAttentionOverEveryVisibleKeyIsSoftmaxAttention) {
  torch::manual_seed(12);
  auto opts = torch::dtype(torch::kDouble);
  const int64_t lq = 29, lk = 40;
  Indexer in = make_indexer(2, lq, lk, torch::kDouble);
  auto sel = select_keys(in, in.bias, lk, "sigmoid", "fixed", int64_t{lk});
  Tensor indices = sel[0].toTensor(), counts = sel[1].toTensor();
  Tensor t = torch::arange(lk - lq, lk, torch::kInt);
  EXPECT_TRUE(torch::equal(counts, (t + 1).expand({2, lq})));
  Tensor slots = torch::arange(lk, torch::kInt);
  EXPECT_TRUE(torch::equal(indices, torch::where(slots.view({1, lk}) <= t.view({lq, 1}), slots.view({1, lk}),
                                                 torch::full({lq, lk}, -1, torch::kInt))
                                        .expand({2, lq, lk})));

  Tensor q = torch::randn({2, 8, lq, 16}, opts).transpose(1, 2).requires_grad_();
  Tensor k = torch::randn({2, lk, 2, 16}, opts).requires_grad_();
  Tensor v = torch::randn({2, 2, lk, 24}, opts).transpose(1, 2).requires_grad_();
  Tensor w = torch::randn({2, lq, 8, 24}, opts);
  Tensor out = call("winnow::gsa_sparse_attention", {q, k, v, indices, counts})[0].toTensor();
  auto grads = torch::autograd::grad({(out * w).sum()}, {q, k, v});
  Tensor ref = call("winnow::softmax_attention", {q, k, v})[0].toTensor();
  auto ref_grads = torch::autograd::grad({(ref * w).sum()}, {q, k, v});
  EXPECT_LT(rel(out, ref), 1e-12);
  for (int i = 0; i < 3; ++i) EXPECT_LT(rel(grads[i], ref_grads[i]), 1e-11) << "grad " << i;
}

// Lists from the adaptive budget: autograd through the operator against dense softmax with every
// unlisted key masked, in float64; keys in no list get exactly zero gradient; the C++ entry
// point and trusted lists give the same result.
TEST(TorchOps, GsaSparseAutogradMatchesAMaskedSoftmax) {
  torch::manual_seed(13);
  auto opts = torch::dtype(torch::kDouble);
  const int64_t lq = 37, lk = 37;
  Indexer in = make_indexer(2, lq, lk, torch::kDouble);
  auto sel = select_keys(in, in.bias, 9, "sigmoid", "inverse_variance", c10::IValue(), 6, 2, 0.01);
  Tensor indices = sel[0].toTensor(), counts = sel[1].toTensor();
  // A real adaptive budget: rows that see more than k_max keys keep lists of several lengths.
  Tensor long_rows = counts.slice(1, 9);
  EXPECT_GT(long_rows.max().item<int>(), long_rows.min().item<int>());

  Tensor q = torch::randn({2, lq, 8, 16}, opts).requires_grad_();
  Tensor k = torch::randn({2, lk, 2, 16}, opts).requires_grad_();
  Tensor v = torch::randn({2, lk, 2, 12}, opts).requires_grad_();
  Tensor w = torch::randn({2, lq, 8, 12}, opts);
  Tensor out = call("winnow::gsa_sparse_attention", {q, k, v, indices, counts})[0].toTensor();
  auto grads = torch::autograd::grad({(out * w).sum()}, {q, k, v});
  Tensor mask = list_mask(indices, lk);
  Tensor ref = composed_list_softmax(q, k, v, mask);
  auto ref_grads = torch::autograd::grad({(ref * w).sum()}, {q, k, v});
  EXPECT_LT(rel(out, ref), 1e-12);
  for (int i = 0; i < 3; ++i) EXPECT_LT(rel(grads[i], ref_grads[i]), 1e-11) << "grad " << i;
  Tensor unlisted = mask.any(1).logical_not();  // (B, Lk)
  ASSERT_GT(unlisted.sum().item<int64_t>(), 0);
  EXPECT_EQ(grads[1].abs().sum(-1).sum(-1).masked_select(unlisted).max().item<double>(), 0.0);
  EXPECT_EQ(grads[2].abs().sum(-1).sum(-1).masked_select(unlisted).max().item<double>(), 0.0);

  winnow::torch_ops::AttentionCall c;
  Tensor entry = winnow::torch_ops::gsa_sparse_attention(q, k, v, indices, counts, c, /*trusted=*/true);
  auto entry_grads = torch::autograd::grad({(entry * w).sum()}, {q, k, v});
  EXPECT_TRUE(torch::equal(entry, out));
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(torch::equal(entry_grads[i], grads[i])) << "grad " << i;
}

// The float32 CPU kernels against the float64 reference through the forward and backward
// operators, on packed sequences with an empty one and queries that are a suffix of their keys.
TEST(TorchOps, GsaSparseOpsAgreeWithTheReferenceBackend) {
  torch::manual_seed(14);
  Tensor q = torch::randn({21, 4, 32}), k = torch::randn({30, 2, 32}), v = torch::randn({30, 2, 16});
  Tensor cu_q = torch::tensor({0, 6, 6, 21}, torch::kInt), cu_k = torch::tensor({0, 9, 15, 30}, torch::kInt);
  Indexer in{torch::randn({21, 3, 8}), torch::randn({30, 1, 8}), torch::randn({21, 3}), torch::randn({3})};
  auto sel = select_keys(in, in.bias, 5, "sigmoid", "reference", c10::IValue(), 4, 1, 0.01, cu_q, cu_k);
  Tensor indices = sel[0].toTensor(), counts = sel[1].toTensor();
  Tensor dout = torch::randn({21, 4, 16});
  auto d = [](const Tensor& t) { return t.to(torch::kDouble); };
  auto fast = call("winnow::gsa_sparse_attention_forward", {q, k, v, indices, counts, cu_q, cu_k});
  auto fast_grads = call("winnow::gsa_sparse_attention_backward",
                         {q, k, v, indices, counts, fast[0], fast[1], dout, cu_q, cu_k});
  auto ref = call("winnow::gsa_sparse_attention_forward",
                  {d(q), d(k), d(v), indices, counts, cu_q, cu_k, c10::IValue(), false, true});
  auto ref_grads = call("winnow::gsa_sparse_attention_backward",
                        {d(q), d(k), d(v), indices, counts, ref[0], ref[1], d(dout), cu_q, cu_k, c10::IValue(),
                         false, false, true});
  EXPECT_EQ(fast[1].toTensor().sizes(), (std::vector<int64_t>{21, 4}));
  EXPECT_LT(rel(fast[0].toTensor(), ref[0].toTensor()), 1e-5);
  EXPECT_LT(rel(fast[1].toTensor(), ref[1].toTensor()), 1e-5);
  for (int i = 0; i < 3; ++i) {
    EXPECT_LT(rel(fast_grads[i].toTensor(), ref_grads[i].toTensor()), 1e-5) << "grad " << i;
  }
}

// The selection is not differentiable: its outputs never require grad.
TEST(TorchOps, GsaSelectKeysOutputsRequireNoGradient) {
  torch::manual_seed(15);
  Indexer in = make_indexer(1, 9, 9, torch::kFloat);
  in.q.requires_grad_();
  in.w.requires_grad_();
  auto sel = select_keys(in, in.bias, 4, "sigmoid", "fixed");
  for (int i = 0; i < 3; ++i) EXPECT_FALSE(sel[i].toTensor().requires_grad()) << "output " << i;
}

// The error names the argument.
void expect_value_error_naming(const std::function<void()>& fn, const std::string& argument) {
  winnow::testing::expect_value_error(fn, "argument '" + argument + "'");
}

TEST(TorchOps, GsaBadArgumentsRaiseValueErrorsNamingTheArgument) {
  torch::manual_seed(16);
  Indexer in = make_indexer(1, 8, 8, torch::kFloat);
  expect_value_error_naming([&] { select_keys(in, in.bias, 4, "sigmoid", "inverse_variance", c10::IValue(), 4, 5); },
                     "k_min");
  expect_value_error_naming([&] { select_keys(in, in.bias, 0, "sigmoid", "fixed"); }, "k_max");
  expect_value_error_naming([&] { select_keys(in, in.bias, 4, "softmax", "fixed"); }, "form");
  expect_value_error_naming([&] { select_keys(in, in.bias, 4, "sigmoid", "top-k"); }, "budget");
  expect_value_error_naming([&] { select_keys(in, in.bias, 4, "sigmoid", "eq8", int64_t{3}, 4); }, "k_fixed");
  expect_value_error_naming([&] { select_keys(in, in.bias, 4, "relu", "fixed"); }, "bias");

  Tensor q = torch::randn({1, 8, 2, 16}), k = torch::randn({1, 8, 1, 16}), v = torch::randn({1, 8, 1, 16});
  auto sel = select_keys(in, in.bias, 4, "sigmoid", "fixed");
  Tensor indices = sel[0].toTensor(), counts = sel[1].toTensor();
  Tensor future = indices.clone();
  future[0][2][2] = 3;  // query 2 cannot see key 3
  expect_value_error_naming([&] { call("winnow::gsa_sparse_attention", {q, k, v, future, counts}); }, "indices");
  expect_value_error_naming([&] { call("winnow::gsa_sparse_attention", {q, k, v, indices.to(torch::kLong), counts}); },
                     "indices");
  expect_value_error_naming([&] { call("winnow::gsa_sparse_attention", {q, k, v, indices, counts + 5}); }, "counts");
}

}  // namespace
