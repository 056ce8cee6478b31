// The float64 oracle: materializing implementations written straight from spec/, slow on
// purpose. Each one builds the full L x L weight matrix of every (sequence, head) and applies
// the spec's formulas to it; tests compare every fast path against these.
#pragma once

#include "core/params.h"

namespace winnow::reference {

void softmax_forward(const detail::AttentionParams& p);
void softmax_backward(const detail::AttentionParams& p, const detail::GradientParams& g);

// The reference is exact stick-breaking: it ignores cfg.halt_cutoff, whose effect on any
// weight is below exp(-halt_cutoff).
void stick_breaking_forward(const detail::AttentionParams& p, const detail::StickBreakingConfig& cfg);
void stick_breaking_backward(const detail::AttentionParams& p, const detail::GradientParams& g,
                             const detail::StickBreakingConfig& cfg);

void entmax_forward(const detail::AttentionParams& p, const detail::EntmaxConfig& cfg);
void entmax_backward(const detail::AttentionParams& p, const detail::GradientParams& g,
                     const detail::EntmaxConfig& cfg);

void sieve_forward(const detail::AttentionParams& p, const detail::SieveConfig& cfg);
void sieve_backward(const detail::AttentionParams& p, const detail::GradientParams& g,
                    const detail::SieveConfig& cfg);

// TRA and TDA. The backward writes dq, dk, dv and cfg's dbeta (and, for TDA, dlambda, dq2, dk2).
void threshold_forward(const detail::AttentionParams& p, const detail::ThresholdConfig& cfg);
void threshold_backward(const detail::AttentionParams& p, const detail::GradientParams& g,
                        const detail::ThresholdConfig& cfg);

// Multiscreen's screening. The backward recomputes everything from the inputs (it ignores the
// saved output and norms) and writes dq, dk, dv and cfg's ds_w and ds_r.
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

}  // namespace winnow::reference
