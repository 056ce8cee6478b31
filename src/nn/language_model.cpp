#include "nn/language_model.h"

#include "nn/multiscreen.h"
#include "nn/transformer.h"
#include "winnow/error.h"

namespace winnow::nn {

torch::Tensor LanguageModelImpl::residual_maxima(const torch::Tensor& tokens) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> maxima;
  run(tokens, nullptr, &maxima);
  return torch::stack(maxima).to(torch::kFloat32);
}

LanguageModel make_language_model(const ModelConfig& c) {
  if (c.architecture == "multiscreen") return std::make_shared<MultiscreenLMImpl>(c);
  if (c.architecture == "transformer") return std::make_shared<TransformerLMImpl>(c);
  throw Error(ErrorKind::invalid_argument, "config: 'model.architecture': expected \"transformer\" or "
                                           "\"multiscreen\", got \"" + c.architecture + "\"");
}

std::string describe(const ModelConfig& c) {
  if (c.architecture == "multiscreen") {
    const MultiscreenConfig& m = c.multiscreen;
    return "multiscreen (" + std::to_string(m.tiles) + " tiles of d_K " + std::to_string(m.key_dim) + " / d_V " +
           std::to_string(m.value_dim) + ", " + m.implementation + ")";
  }
  return c.attention.kind + " attention (" + c.attention.position + ", " + c.attention.implementation + ")";
}

bool uses_kernel(const ModelConfig& c) {
  return c.architecture == "multiscreen" ? c.multiscreen.implementation == "kernel" : uses_kernel(c.attention);
}

}  // namespace winnow::nn
