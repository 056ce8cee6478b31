// Decoding against a paged key/value cache, the layout of vLLM and FlashInfer: the cache is a
// pool of pages of page_size key (value) rows, and a block table lists each sequence's pages in
// order, so sequences grow a page at a time without copying. Key i of sequence b is row
// i % page_size of page block_table[b][i / page_size].
//
// q (B, Lq, Hq, D) holds each sequence's newest Lq tokens, whose keys and values the caller has
// already written into the cache: query r of sequence b sits at position seq_lens[b] - Lq + r
// and sees the keys the mechanism's causal rule allows (attend_current as in the forward
// calls). The outputs are those of softmax::forward and stick_breaking::forward on the gathered
// keys.
//
// On CUDA the keys are split across thread blocks and the splits merged exactly (flash-
// decoding); all query heads of a kv head, and all Lq queries, share each load of the cache.
// CUDA takes float16, bfloat16 and float32 with D and Dv multiples of 8 up to 256 and cache
// rows 16-byte aligned with contiguous features. Contiguous caches need no API of their own:
// softmax::forward and stick_breaking::forward take these kernels for up to 8 queries per
// sequence.
#pragma once

#include "winnow/attention.h"
#include "winnow/softmax.h"
#include "winnow/stick_breaking.h"

namespace winnow::decode {

struct PagedCache {
  TensorView k;            // (num_pages, page_size, Hkv, D)
  TensorView v;            // (num_pages, page_size, Hkv, Dv)
  TensorView block_table;  // (B, max_pages) int32: sequence b's pages, in order
  TensorView seq_lens;     // (B) int32: keys sequence b holds, its Lq new tokens included
  // false: check seq_lens (Lq <= seq_lens[b] <= max_pages * page_size) and the pages in use
  // (0 <= page < num_pages) before reading; on CUDA that costs a wait for the device. true
  // skips the check for callers that maintain the table themselves; out-of-range values then
  // read out of bounds.
  bool trusted = false;
};

void softmax(const TensorView& q, const PagedCache& cache, const softmax::Options& options,
             const softmax::Outputs& outputs, const ExecContext& ctx = {});

// halt_cutoff must be 0 (decoding keeps every key); kept_from, when given, is written as 0.
void stick_breaking(const TensorView& q, const PagedCache& cache, const stick_breaking::Options& options,
                    const stick_breaking::Outputs& outputs, const ExecContext& ctx = {});

}  // namespace winnow::decode
