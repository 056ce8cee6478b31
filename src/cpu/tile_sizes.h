// Tile sizes of the CPU kernels: query rows per work item and keys per inner step. Results
// depend on them only through early halting, which skips whole key tiles; white-box tests of
// that behaviour include this header.
#pragma once

#include <cstdint>

namespace winnow::cpu {

inline constexpr std::int64_t kQueryTile = 64;
inline constexpr std::int64_t kKeyTile = 64;

}  // namespace winnow::cpu
