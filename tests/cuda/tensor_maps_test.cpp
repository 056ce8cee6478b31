// The tensor maps' layouts (cuda/tensor_maps.h), checked on the host: no driver or GPU is needed,
// so these run in CI (label cpu). On the GPU machine CudaBackward.TensorMapCopies* runs the
// copies themselves against cp.async and the reference.
#include <gtest/gtest.h>

#include <cstdint>
#include <optional>

#include "cuda/tensor_maps.h"

namespace winnow::cuda {
namespace {

// An aligned stand-in base address: the layout never dereferences it.
alignas(16) unsigned char base[16];

detail::Operand operand(std::int64_t batch, std::int64_t row, std::int64_t head, std::int64_t dim = 1) {
  detail::Operand x;
  x.data = base;
  x.batch = batch;
  x.row = row;
  x.head = head;
  x.dim = dim;
  return x;
}

TEST(CudaHost, RowTileLayoutOfBatchedRowsHeadsFeatures) {
  // (B, L, H, D) = (2, 193, 4, 128), contiguous, bf16: head, then row, then batch.
  const auto l = row_tile_layout(operand(193 * 4 * 128, 4 * 128, 128), DType::bfloat16, 2, 193, 4, 128, 64);
  ASSERT_TRUE(l.has_value());
  EXPECT_EQ(l->sizes[0], 128u);
  EXPECT_EQ(l->sizes[1], 4u);
  EXPECT_EQ(l->sizes[2], 193u);
  EXPECT_EQ(l->sizes[3], 2u);
  EXPECT_EQ(l->strides[0], 256u);
  EXPECT_EQ(l->strides[1], 1024u);
  EXPECT_EQ(l->strides[2], 193u * 1024u);
  EXPECT_EQ(l->boxes[0], 64u);  // a 128-byte panel of 16-bit elements
  EXPECT_EQ(l->boxes[1], 1u);
  EXPECT_EQ(l->boxes[2], 64u);
  EXPECT_EQ(l->boxes[3], 1u);
  EXPECT_EQ(l->head_axis, 1);
  EXPECT_EQ(l->row_axis, 2);
  EXPECT_EQ(l->batch_axis, 3);
}

TEST(CudaHost, RowTileLayoutOfHeadMajorRows) {
  // (B, H, L, D) = (3, 2, 333, 64), fp16, boxes of 128 rows: row, then head, then batch.
  const auto l = row_tile_layout(operand(2 * 333 * 64, 64, 333 * 64), DType::float16, 3, 333, 2, 64, 128);
  ASSERT_TRUE(l.has_value());
  EXPECT_EQ(l->row_axis, 1);
  EXPECT_EQ(l->head_axis, 2);
  EXPECT_EQ(l->batch_axis, 3);
  EXPECT_EQ(l->sizes[1], 333u);
  EXPECT_EQ(l->sizes[2], 2u);
  EXPECT_EQ(l->strides[0], 128u);
  EXPECT_EQ(l->strides[1], 333u * 128u);
  EXPECT_EQ(l->boxes[1], 128u);
  EXPECT_EQ(l->boxes[2], 1u);
}

TEST(CudaHost, RowTileLayoutGivesAxesOfOneElementTheLargestStride) {
  // One sequence whose batch stride is whatever the caller left (0 here): past the rows.
  const auto one_sequence = row_tile_layout(operand(0, 4 * 128, 128), DType::bfloat16, 1, 300, 4, 128, 64);
  ASSERT_TRUE(one_sequence.has_value());
  EXPECT_EQ(one_sequence->batch_axis, 3);
  EXPECT_GE(one_sequence->strides[2], one_sequence->strides[1] * 300u);
  EXPECT_EQ(one_sequence->strides[2] % 16, 0u);
  // One head: its axis goes last, past the batches.
  const auto one_head = row_tile_layout(operand(200 * 64, 64, 64), DType::bfloat16, 2, 200, 1, 64, 64);
  ASSERT_TRUE(one_head.has_value());
  EXPECT_EQ(one_head->row_axis, 1);
  EXPECT_EQ(one_head->batch_axis, 2);
  EXPECT_EQ(one_head->head_axis, 3);
  EXPECT_GE(one_head->strides[2], one_head->strides[1] * 2u);
}

TEST(CudaHost, RowTileLayoutRefusesWhatAMapCannotDescribe) {
  const detail::Operand good = operand(193 * 4 * 128, 4 * 128, 128);
  auto refused = [](const detail::Operand& x, DType t, std::int64_t b, std::int64_t l, std::int64_t h,
                    std::int64_t d, int box) { return !row_tile_layout(x, t, b, l, h, d, box).has_value(); };
  EXPECT_FALSE(refused(good, DType::bfloat16, 2, 193, 4, 128, 64));
  EXPECT_TRUE(refused(good, DType::float32, 2, 193, 4, 128, 64)) << "float32 rows";
  EXPECT_TRUE(refused(operand(193 * 4 * 128, 4 * 128, 128, 2), DType::bfloat16, 2, 193, 4, 128, 64))
      << "features not contiguous";
  EXPECT_TRUE(refused(operand(193 * 4 * 96, 4 * 96, 96), DType::bfloat16, 2, 193, 4, 96, 64)) << "dim 96";
  EXPECT_TRUE(refused(operand(193 * 516, 516, 128), DType::bfloat16, 2, 193, 4, 128, 64))
      << "rows 1032 bytes apart (8 past a multiple of 16)";
  EXPECT_TRUE(refused(operand(193 * 4 * 136, 4 * 136, 132), DType::bfloat16, 2, 193, 4, 128, 64))
      << "heads 264 bytes apart";
  EXPECT_TRUE(refused(operand(0, 4 * 128, 128), DType::bfloat16, 2, 193, 4, 128, 64))
      << "two sequences at one address (a zero batch stride)";
  EXPECT_TRUE(refused(good, DType::bfloat16, 0, 193, 4, 128, 64)) << "no sequences";
  EXPECT_TRUE(refused(good, DType::bfloat16, 2, 193, 4, 128, 512)) << "boxes past 256 rows";
  EXPECT_TRUE(refused(good, DType::bfloat16, 2, std::int64_t{1} << 31, 4, 128, 64)) << "rows past 32-bit coordinates";
  detail::Operand unaligned = good;
  unaligned.data = base + 8;
  EXPECT_TRUE(refused(unaligned, DType::bfloat16, 2, 193, 4, 128, 64)) << "a base 8 bytes past 16";
}

}  // namespace
}  // namespace winnow::cuda
