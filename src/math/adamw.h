// AdamW's update and the global-norm clip (winnow/adamw.h), shared by the CPU and CUDA kernels.
#pragma once

#include <cmath>

#include "math/host_device.h"

namespace winnow::math::adamw {

// The factor the gradients are scaled by, given their global norm: what
// torch.nn.utils.clip_grad_norm_ applies (min(1, max_norm / (norm + 1e-6))); 1 when max_norm <= 0.
WINNOW_HD float clip_scale(float norm, float max_norm) {
  if (!(max_norm > 0.0f)) return 1.0f;
  const float s = max_norm / (norm + 1e-6f);
  return s < 1.0f ? s : 1.0f;
}

// A tensor's constants for one step: its learning rate and weight decay, and the step number t
// (counting this step) for the bias corrections.
struct StepConstants {
  float lr_decay;    // lr * weight_decay
  float step_size;   // lr / (1 - beta1^t)
  float bias2_sqrt;  // sqrt(1 - beta2^t)
  float beta1, beta2, eps;
};

// The bias corrections in float64, as torch.optim.AdamW takes them (once per tensor and block).
WINNOW_HD StepConstants step_constants(float lr, double weight_decay, double beta1, double beta2, double eps,
                                       double t) {
  using std::pow;
  using std::sqrt;
  StepConstants c;
  c.lr_decay = static_cast<float>(lr * weight_decay);
  c.step_size = static_cast<float>(lr / (1.0 - pow(beta1, t)));
  c.bias2_sqrt = static_cast<float>(sqrt(1.0 - pow(beta2, t)));
  c.beta1 = static_cast<float>(beta1);
  c.beta2 = static_cast<float>(beta2);
  c.eps = static_cast<float>(eps);
  return c;
}

// One element, in the order of torch.optim.AdamW (and LibTorch's fused AdamW): decoupled decay,
// both moments, then the bias-corrected step. g is the already clipped gradient.
WINNOW_HD void update(float& param, float g, float& exp_avg, float& exp_avg_sq, const StepConstants& c) {
  param -= c.lr_decay * param;
  exp_avg = c.beta1 * exp_avg + (1.0f - c.beta1) * g;
  exp_avg_sq = c.beta2 * exp_avg_sq + (1.0f - c.beta2) * g * g;
  using std::sqrt;
  const float denom = sqrt(exp_avg_sq) / c.bias2_sqrt + c.eps;
  param -= c.step_size * exp_avg / denom;
}

}  // namespace winnow::math::adamw
