// File-system helpers the trainer and its tests share.
#pragma once

#include <filesystem>

namespace winnow::train {

// Removes `path` and everything below it (no error if it does not exist), like
// std::filesystem::remove_all, which is not called anywhere here: PyTorch's pip wheels export
// their own copy of it from libtorch.so, and a program linked against them ends up calling
// that copy, which crashes (seen with torch 2.11). Returns false if something could not be
// removed.
bool remove_tree(const std::filesystem::path& path) noexcept;

}  // namespace winnow::train
