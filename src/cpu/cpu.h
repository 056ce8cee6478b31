// Streaming CPU kernels: tiled like the GPU kernels, O(L) extra memory, multithreaded with
// OpenMP, float32 and float64.
#pragma once

#include "core/params.h"
#include "core/cast_params.h"
#include "core/layer_params.h"
#include "core/optimizer_params.h"
#include "core/rotary_params.h"

namespace winnow::cpu {

void softmax_forward(const detail::AttentionParams& p);
void softmax_backward(const detail::AttentionParams& p, const detail::GradientParams& g);

void stick_breaking_forward(const detail::AttentionParams& p, const detail::StickBreakingConfig& cfg);
void stick_breaking_backward(const detail::AttentionParams& p, const detail::GradientParams& g,
                             const detail::StickBreakingConfig& cfg);

void entmax_forward(const detail::AttentionParams& p, const detail::EntmaxConfig& cfg);
void entmax_backward(const detail::AttentionParams& p, const detail::GradientParams& g,
                     const detail::EntmaxConfig& cfg);

void sieve_forward(const detail::AttentionParams& p, const detail::SieveConfig& cfg);
void sieve_backward(const detail::AttentionParams& p, const detail::GradientParams& g,
                    const detail::SieveConfig& cfg);

void threshold_forward(const detail::AttentionParams& p, const detail::ThresholdConfig& cfg);
void threshold_backward(const detail::AttentionParams& p, const detail::GradientParams& g,
                        const detail::ThresholdConfig& cfg);

void screening_forward(const detail::AttentionParams& p, const detail::ScreeningConfig& cfg);
void screening_backward(const detail::AttentionParams& p, const detail::GradientParams& g,
                        const detail::ScreeningConfig& cfg);

// GSA's indexer with selection: scores, row variance (p.stats), budget, top-k positions.
void gsa_select_keys(const detail::AttentionParams& p, const detail::IndexerConfig& c);

// GSA's sparse attention over per-row key lists (validated by the API).
void gsa_sparse_forward(const detail::AttentionParams& p, const detail::KeyListConfig& lists);
void gsa_sparse_backward(const detail::AttentionParams& p, const detail::GradientParams& g,
                         const detail::KeyListConfig& lists);

// GSA's indexer loss (winnow/gsa.h): p is the indexer's params (its per-row KL in p.stats).
void gsa_indexer_loss_forward(const detail::AttentionParams& p, const detail::IndexerLossConfig& c);
void gsa_indexer_loss_backward(const detail::AttentionParams& p, const detail::IndexerLossConfig& c);

void rotary(const detail::RotaryParams& p);

// dy in x's dtype, y in x's dtype (the API checks): the CPU has float32 and float64 only.
void rms_norm_forward(const detail::RMSNormParams& p);
void rms_norm_backward(const detail::RMSNormParams& p);

void swiglu_forward(const detail::SwiGLUParams& p);
void swiglu_backward(const detail::SwiGLUParams& p);

// AdamW with the global-norm clip (winnow/adamw.h).
void adamw_clipped_step(const detail::AdamWParams& p);

// The masked cross-entropy of logits (winnow/cross_entropy.h).
void cross_entropy_forward(const detail::CrossEntropyParams& p);
void cross_entropy_backward(const detail::CrossEntropyParams& p);

// Sources converted into one buffer side by side (winnow/cast.h).
void cast_concatenate(const detail::CastParams& p);

}  // namespace winnow::cpu
