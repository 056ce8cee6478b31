// winnow's operators from C++ on LibTorch tensors: stick-breaking attention with autograd,
// against the same attention written as a composed LibTorch expression (float64), forward
// and gradients; then a bad argument's error. Exits nonzero if they disagree.
#include <torch/torch.h>
#include <winnow/torch/ops.h>

#include <cmath>
#include <cstdio>

namespace {

// The spec's product form on (B, L, H, D) tensors: A_ij = sigmoid(z_ij) prod_{i<k<j} (1 -
// sigmoid(z_kj)) over keys i < j, written in logs: log A_ij = z_ij - sum_{i<=k<j} softplus(z_kj).
std::pair<at::Tensor, at::Tensor> composed(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const int64_t L = q.size(1);
  const at::Tensor z = at::matmul(q.transpose(1, 2), k.transpose(1, 2).transpose(-1, -2)) /
                       std::sqrt(static_cast<double>(q.size(-1)));
  const at::Tensor visible = at::ones({L, L}, at::kBool).tril(-1);  // key i < query j
  const at::Tensor cost = at::where(visible, at::softplus(z), at::zeros_like(z));
  const at::Tensor suffix = cost.flip(-1).cumsum(-1).flip(-1);
  const at::Tensor w = at::where(visible, at::exp(z - suffix), at::zeros_like(z));
  return {at::matmul(w, v.transpose(1, 2)).transpose(1, 2), at::exp(-cost.sum(-1)).transpose(1, 2)};
}

double max_difference(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>();
}

}  // namespace

int main() {
  torch::manual_seed(0);
  const auto options = torch::dtype(torch::kFloat64).requires_grad(true);
  at::Tensor q = torch::randn({2, 37, 4, 16}, options), k = torch::randn({2, 37, 4, 16}, options),
             v = torch::randn({2, 37, 4, 16}, options);
  const at::Tensor weight = torch::randn({2, 37, 4, 16}, torch::kFloat64);

  winnow::torch_ops::AttentionCall call;  // scale 1/sqrt(D), no varlen offsets
  call.attend_current = false;              // keys i < j, the paper's choice
  auto [out, rem] = winnow::torch_ops::stick_breaking_attention(q, k, v, call);
  auto grads = torch::autograd::grad({(out * weight).sum() + rem.sum()}, {q, k, v});
  auto [ref_out, ref_rem] = composed(q, k, v);
  auto ref_grads = torch::autograd::grad({(ref_out * weight).sum() + ref_rem.sum()}, {q, k, v});

  double worst = std::fmax(max_difference(out, ref_out), max_difference(rem, ref_rem));
  for (int i = 0; i < 3; ++i) worst = std::fmax(worst, max_difference(grads[i], ref_grads[i]));
  std::printf("stick-breaking on LibTorch tensors, 2 x 37 x 4 x 16 float64: max |winnow - composed| "
              "over out, rem, dq, dk, dv = %.2e\n", worst);

  try {
    winnow::torch_ops::stick_breaking_attention(q, k, v.narrow(1, 0, 36), call);
    std::printf("no error for values of the wrong length\n");
    return 1;
  } catch (const c10::ValueError& e) {
    std::printf("bad argument: %s\n", e.what_without_backtrace());
  }
  return worst < 1e-10 ? 0 : 1;
}
