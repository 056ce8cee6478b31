// What the model layer's runtime sees, for `winnow info` (no LibTorch in this header).
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace winnow::train {

// (label, value) lines: LibTorch's version, CUDA devices and thread count; the tasks.
std::vector<std::pair<std::string, std::string>> runtime_report();

}  // namespace winnow::train
