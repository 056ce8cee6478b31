// Clipped AdamW on the CPU: the squared sums over fixed chunks (in float64, added in chunk
// order, so the norm does not depend on the thread count), then the update chunk by chunk.
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu/cpu.h"
#include "math/adamw.h"

namespace winnow::cpu {
namespace {

constexpr std::int64_t kChunk = 1 << 14;

struct Chunk {
  std::size_t tensor;
  std::int64_t begin, end;
};

std::vector<Chunk> chunks_of(const detail::AdamWParams& p) {
  std::vector<Chunk> chunks;
  for (std::size_t t = 0; t < p.tensors.size(); ++t) {
    for (std::int64_t b = 0; b < p.tensors[t].numel; b += kChunk) {
      chunks.push_back({t, b, std::min(b + kChunk, p.tensors[t].numel)});
    }
  }
  return chunks;
}

}  // namespace

void adamw_clipped_step(const detail::AdamWParams& p) {
  const std::vector<Chunk> chunks = chunks_of(p);
  const std::int64_t n = static_cast<std::int64_t>(chunks.size());
  const int threads = p.num_threads > 0 ? p.num_threads : omp_get_max_threads();
  std::vector<double> sums(chunks.size(), 0.0);
#pragma omp parallel for num_threads(threads) schedule(static)
  for (std::int64_t c = 0; c < n; ++c) {
    const float* g = p.tensors[chunks[c].tensor].grad;
    double s = 0;
    for (std::int64_t i = chunks[c].begin; i < chunks[c].end; ++i) s += static_cast<double>(g[i]) * g[i];
    sums[c] = s;
  }
  double total = 0;
  for (double s : sums) total += s;
  const float norm = static_cast<float>(std::sqrt(total));
  *p.norm = norm;
  bool skip = !std::isfinite(norm);
  for (const float* guard : p.guards) skip = skip || !std::isfinite(*guard);
  if (skip) return;
  const float scale = math::adamw::clip_scale(norm, static_cast<float>(p.max_norm));

  // Every tensor's constants before any step count moves.
  std::vector<math::adamw::StepConstants> constants;
  for (const detail::AdamWTensor& t : p.tensors) {
    constants.push_back(math::adamw::step_constants(*p.group_lr[t.group], p.group_weight_decay[t.group], p.beta1,
                                                    p.beta2, p.eps, static_cast<double>(*t.step) + 1.0));
  }
#pragma omp parallel for num_threads(threads) schedule(static)
  for (std::int64_t c = 0; c < n; ++c) {
    const detail::AdamWTensor& t = p.tensors[chunks[c].tensor];
    const math::adamw::StepConstants& k = constants[chunks[c].tensor];
    for (std::int64_t i = chunks[c].begin; i < chunks[c].end; ++i) {
      math::adamw::update(t.param[i], scale * t.grad[i], t.exp_avg[i], t.exp_avg_sq[i], k);
    }
  }
  for (const detail::AdamWTensor& t : p.tensors) *t.step += 1.0f;
}

}  // namespace winnow::cpu
