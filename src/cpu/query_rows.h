// The work items of GSA's row-parallel CPU loops (cpu/gsa.cpp, cpu/gsa_indexer_loss.cpp).
#pragma once

#include <cstdint>
#include <vector>

#include "core/params.h"

namespace winnow::cpu {

// Every (sequence, query row). Later rows see more keys: listing them first balances the
// dynamic schedule.
struct RowItem {
  std::int64_t b, r;
};

inline std::vector<RowItem> query_rows(const detail::AttentionParams& p) {
  std::vector<RowItem> items;
  for (std::int64_t b = 0; b < p.num_seqs; ++b) {
    for (std::int64_t r = p.sequence(b).q_len - 1; r >= 0; --r) items.push_back({b, r});
  }
  return items;
}

}  // namespace winnow::cpu
