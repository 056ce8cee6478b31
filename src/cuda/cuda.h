// Fused CUDA kernels (bf16 / fp16 with fp32 accumulation, head dimensions 64 and 128, any
// layout with 16-byte aligned rows) and a simple path for everything else (float32 inputs,
// other head dimensions, unaligned strides).
#pragma once

#include "core/decode_params.h"
#include "core/params.h"
#include "core/cast_params.h"
#include "core/layer_params.h"
#include "core/optimizer_params.h"
#include "core/rotary_params.h"

namespace winnow::cuda {

void softmax_forward(const detail::AttentionParams& p);
void softmax_backward(const detail::AttentionParams& p, const detail::GradientParams& g);
// Whether softmax_backward stores dq and dk rotated back by g's RoPE tables
// (GradientParams::rotary_cos) for this call: the Hopper kernels do; elsewhere the caller rotates.
bool softmax_backward_rotates(const detail::AttentionParams& p, const detail::GradientParams& g);

void stick_breaking_forward(const detail::AttentionParams& p, const detail::StickBreakingConfig& cfg);
void stick_breaking_backward(const detail::AttentionParams& p, const detail::GradientParams& g,
                             const detail::StickBreakingConfig& cfg);

void entmax_forward(const detail::AttentionParams& p, const detail::EntmaxConfig& cfg);
void entmax_backward(const detail::AttentionParams& p, const detail::GradientParams& g,
                     const detail::EntmaxConfig& cfg);
// Backward calls that took the support-list path since the process started (for tests: the
// path runs only when every row's support fits its list).
std::int64_t entmax_sparse_backward_calls();
// Of those, the calls that took the record's totals from the forward's count instead of reading
// the record back (for tests).
std::int64_t entmax_counted_backward_calls();

// Forward calls of entmax and Sieve (exact) whose threshold search went on past the collect
// sweep (some row's candidate lists overflowed), so that the output sweep enqueued behind that
// sweep ran again (for tests).
std::int64_t threshold_output_reruns();

void sieve_forward(const detail::AttentionParams& p, const detail::SieveConfig& cfg);
void sieve_backward(const detail::AttentionParams& p, const detail::GradientParams& g,
                    const detail::SieveConfig& cfg);

// Threshold attention (TRA, and TDA when cfg.lambda is set): fused kernels for 16-bit inputs at
// D = 64 / 128, the simple path otherwise and whenever cfg.nonzero is asked for.
void threshold_forward(const detail::AttentionParams& p, const detail::ThresholdConfig& cfg);
void threshold_backward(const detail::AttentionParams& p, const detail::GradientParams& g,
                        const detail::ThresholdConfig& cfg);

// Multiscreen's screening: fused kernels for 16-bit inputs at d_K 16 / 32 / 64 with d_V 64 / 128,
// the simple path otherwise.
void screening_forward(const detail::AttentionParams& p, const detail::ScreeningConfig& cfg);
void screening_backward(const detail::AttentionParams& p, const detail::GradientParams& g,
                        const detail::ScreeningConfig& cfg);

// GSA (winnow/gsa.h): the indexer's exact top-k selection, a block per query row; sparse
// attention over per-token key lists, a block per (query row, kv head) sharing one gather of the
// listed keys. CUDA cores, every dtype, head dimensions up to 256.
void gsa_select_keys(const detail::AttentionParams& p, const detail::IndexerConfig& c);
void gsa_sparse_forward(const detail::AttentionParams& p, const detail::KeyListConfig& c);
void gsa_sparse_backward(const detail::AttentionParams& p, const detail::GradientParams& g,
                         const detail::KeyListConfig& c);
// The first malformed list (count outside [0, k_max], entries not strictly increasing within
// [0, t]) as (sequence << 32 | query row), or -1; waits for the device.
std::int64_t gsa_first_bad_list(const detail::AttentionParams& p, const detail::KeyListConfig& c);
// GSA's indexer loss: a warp per query row over key tiles shared by the block's rows, CUDA cores.
void gsa_indexer_loss_forward(const detail::AttentionParams& p, const detail::IndexerLossConfig& c);
void gsa_indexer_loss_backward(const detail::AttentionParams& p, const detail::IndexerLossConfig& c);

// Split-KV decoding (attention/decode.cuh): softmax and stick-breaking for a few queries per
// sequence against a contiguous or paged cache, 16-bit and float32, head dimensions that are
// multiples of 8 up to 256 with 16-byte aligned cache rows (decode_kernels_take).
bool decode_kernels_take(const detail::DecodeParams& p);
void softmax_decode(const detail::DecodeParams& p);
void stick_breaking_decode(const detail::DecodeParams& p);
// Sieve and alpha-entmax, 16-bit only: the forward calls' fused threshold search writes each
// row's threshold (p.threshold) over the whole cache first, then these take the cache once.
void sieve_decode(const detail::DecodeParams& p);
void entmax_decode(const detail::DecodeParams& p);
// Sieve's bound filter's thresholds (p.threshold: the row's largest score - p.bound_eps) for
// sieve_decode, in a pass of the decoding kernel that reads the keys alone.
void sieve_bound_thresholds(const detail::DecodeParams& p);
// Threshold attention's view (TRA; TDA's second view with p.lambda and p.add_to_out), 16-bit:
// queries and keys normalized as they are read.
void threshold_decode(const detail::DecodeParams& p);
// entmax's threshold search (alpha = p.alpha) over the cache on the decoding kernel, for entmax
// and Sieve's exact filter: the rows' thresholds into `result` as tau * result_scale. Waits for
// the device; false, with `result` partly written, where some row's keys above its floor
// overflow the list, for the caller to search on the forward kernel instead.
bool decode_thresholds(detail::DecodeParams p, float tolerance, const detail::Operand& result, float result_scale);
// Those calls that found every row's threshold (for tests).
std::int64_t decode_searches();
// Calls of the decoding kernels since the process started (for tests: which path a forward took).
std::int64_t decode_calls();
// Forward calls with a short suffix of queries (batched, at most 8 per sequence) that the
// decoding kernels take in place of the fused ones (WINNOW_NO_DECODE_KERNELS turns this off).
bool decode_path_applies(const detail::AttentionParams& p);
detail::DecodeParams decode_params_of(const detail::AttentionParams& p);
// The first sequence of a paged cache whose length or pages are out of range, as
// b * 4 + reason (1: fewer keys than queries, 2: more keys than its block table holds, 3: a
// page index outside [0, num_pages)), or -1; waits for the device.
std::int64_t first_bad_paged_sequence(const detail::DecodeParams& p, std::int64_t num_pages);

// Whether the Hopper kernels that can copy tiles through tensor maps (the key-stationary
// backward's Q and dO) do, rather than with cp.async; returns the previous setting. On unless
// WINNOW_NO_TENSOR_MAPS is set; for tests and A/B runs in one build.
bool set_tensor_maps(bool enabled);
// Launches that copied through tensor maps since the process started (for tests).
std::int64_t tensor_map_launches();

// Rotary position embedding (winnow/rotary.h), one element-wise pass.
void rotary(const detail::RotaryParams& p);

// RMSNorm (winnow/rms_norm.h): a warp per row; the backward's weight gradient in two passes.
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

}  // namespace winnow::cuda
