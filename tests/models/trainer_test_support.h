// What the trainer tests on the CPU (train_test.cpp) and on CUDA (models_cuda/) share: a fresh
// scratch folder per test and process, and bitwise equality of two trainers' parameters.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "train/files.h"
#include "train/trainer.h"

namespace winnow::train {

inline std::string scratch(const std::string& name) {
  const std::filesystem::path p = std::filesystem::temp_directory_path() /
                                  ("winnow_test_" + name + "_" + std::to_string(::getpid()));
  remove_tree(p);
  return p.string();
}

inline void expect_same_parameters(Trainer& a, Trainer& b) {
  auto pa = a.model()->named_parameters(), pb = b.model()->named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (const auto& item : pa) EXPECT_TRUE(torch::equal(item.value(), pb[item.key()])) << item.key();
}

}  // namespace winnow::train
