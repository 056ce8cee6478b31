// The LibTorch operators from C++: dispatch through torch.ops.winnow.*, autograd against the
// float64 reference reached through the same binding, and against an independent composed
// LibTorch expression; strided inputs; errors surfacing as c10 exceptions.
#include <ATen/core/dispatch/Dispatcher.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

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
        "winnow::sieve_attention_forward", "winnow::sieve_attention_backward"}) {
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

}  // namespace
