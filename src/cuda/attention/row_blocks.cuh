// Kernels that give each query row (over every sequence) a block of its own: which sequence and
// row a block's index names.
#pragma once

#include <cstdint>

#include "core/params.h"

namespace winnow::cuda {

struct QueryRow {
  std::int64_t b, r;  // sequence, row within its queries
  detail::SequenceExtent s;
  __device__ __forceinline__ std::int64_t position() const { return r + s.q_offset(); }  // t
  __device__ __forceinline__ std::int64_t operand_row() const { return s.q_start + r; }
};

// Row i of all rows_q: batched rows are b * len_q + r; packed rows are found among the offsets.
__device__ __forceinline__ QueryRow locate_query_row(const detail::AttentionParams& p, std::int64_t i) {
  QueryRow q;
  if (p.cu_seqlens_q == nullptr) {
    q.b = i / p.len_q;
    q.r = i % p.len_q;
  } else {
    // The last sequence whose offset is <= i (empty sequences share offsets with the next).
    std::int64_t lo = 0, hi = p.num_seqs - 1;
    while (lo < hi) {
      const std::int64_t mid = (lo + hi + 1) / 2;
      if (p.cu_seqlens_q[mid] <= i) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    q.b = lo;
    q.r = i - p.cu_seqlens_q[lo];
  }
  q.s = p.sequence(q.b);
  return q;
}

}  // namespace winnow::cuda
