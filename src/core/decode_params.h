// The plain struct of the decoding kernels (split-KV, winnow/decode.h): a few queries per
// sequence against a key/value cache that is either contiguous per sequence or paged through a
// block table. Raw pointers, sizes and strides only, filled by the API layer (paged caches) or
// from a forward call's AttentionParams (short query suffixes against contiguous keys).
#pragma once

#include <cstdint>

#include "core/params.h"
#include "math/host_device.h"

namespace winnow::detail {

// Where key i of sequence b lives. Paged: page block_table[b * table_stride + i / page_size],
// slot i % page_size. Contiguous (block_table null): "page" b, slot i, so `page` is the batch
// stride and `slot` the row stride.
struct CacheOperand {
  const void* data = nullptr;
  std::int64_t page = 0, slot = 0, head = 0;  // element strides; the head dimension is contiguous
};

struct DecodeParams {
  DType dtype = DType::float32;  // of q, the cache and out
  std::int64_t num_seqs = 0, heads_q = 0, heads_kv = 0, dim_qk = 0, dim_v = 0;
  std::int64_t len_q = 0;  // queries per sequence: the last len_q positions of its keys

  Operand q, out;       // (B, Lq, H, D) in the batched scheme of Operand
  Operand stats;        // lse or log_rem, float32
  Operand kept_from;    // stick-breaking's int32 per row, written as 0 when data != nullptr
  // Mechanisms whose rows' thresholds come from a search over the whole cache first
  // (threshold_search.cuh), as in the forward:
  Operand threshold;    // float per row: Sieve's in score units; entmax's tau in x units
  Operand count;        // Sieve's int32 candidates per row, written when data != nullptr
  float alpha = 1.5f;   // entmax's
  float bound_eps = 0.f;  // Sieve's bound filter: threshold = the row's largest score - bound_eps
  // Threshold attention (TRA; TDA as a second pass over its second view): beta and lambda per
  // query head, float32 at stride `head`; the weights' power and the normalization's eps. The
  // second pass weighs by -lambda and adds into out (add_to_out).
  Operand beta, lambda;
  float power = 2.f, norm_eps = 1e-6f;
  bool clamp_lambda = true, add_to_out = false;
  // The entmax threshold search over the cache (entmax and Sieve's exact filter): per row
  // ([b][query][head]) its largest x and a floor under tau, the count and list of the keys above
  // the floor (decode.cuh's kSearchCapacity a row), and a flag raised where a row's keys
  // overflow its list.
  float* search_rows = nullptr;  // two floats a row
  int* search_counts = nullptr;
  float* search_lists = nullptr;
  int* search_overflow = nullptr;

  CacheOperand k, v;
  const std::int32_t* block_table = nullptr;  // null: contiguous
  std::int64_t table_stride = 0, page_size = 0;
  const std::int32_t* seq_lens = nullptr;     // keys per sequence; null: len_k for every one
  std::int64_t len_k = 0;
  std::int64_t capacity = 0;  // keys the longest sequence may hold: the split's range

  double scale = 1.0;
  bool attend_current = true;

  // Split-KV: sequence keys [s * split_len, (s + 1) * split_len) go to split s.
  int splits = 1;
  std::int64_t split_len = 0;
  // Rows of a kv head's group (len_q * heads_q / heads_kv) a block serves; more come in groups.
  int row_groups = 1;
  float* partial_out = nullptr;    // [b][kv head][row][split][dim_v] when splits > 1
  float* partial_stats = nullptr;  // [b][kv head][row][split][2]

  void* cuda_stream = nullptr;
  DeviceAllocator* allocator = nullptr;  // the split workspace (launchers only)

  WINNOW_HD std::int64_t group_size() const { return heads_q / heads_kv; }
  WINNOW_HD std::int64_t group_rows() const { return len_q * group_size(); }
};

}  // namespace winnow::detail
