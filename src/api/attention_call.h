// Argument checking shared by every attention entry point. An AttentionCall validates the
// inputs once, then checks each output or gradient against the shape it must have, and
// finally hands out the filled AttentionParams. Every failure throws winnow::Error naming
// the operation, the argument, what was expected and what arrived, before any work starts.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "core/params.h"
#include "winnow/attention.h"
#include "winnow/error.h"

namespace winnow::detail {

enum class Route { reference, cpu, cuda };

class AttentionCall {
 public:
  AttentionCall(const char* op, const AttentionInputs& in, const ExecContext& ctx);

  [[noreturn]] void fail(const std::string& arg, const std::string& expected,
                         const std::string& got,
                         ErrorKind kind = ErrorKind::invalid_argument) const;

  // out / dq / dk / dv / dout: same dtype and device as q, the given role's shape.
  // With `dtype`, that dtype instead of q's (gradients kept in float32).
  Operand like_q(const char* name, const TensorView& t, bool value_dim,
                 std::optional<DType> dtype = std::nullopt) const;
  Operand like_k(const char* name, const TensorView& t, bool value_dim,
                 std::optional<DType> dtype = std::nullopt) const;
  // Per-row statistics: (B, Lq, Hq) or (Tq, Hq), of stats_dtype() (or the given dtype).
  Operand row_stats(const char* name, const TensorView& t) const;
  Operand row_stats(const char* name, const TensorView& t, DType dtype) const;
  // Per query row, not per head: (B, Lq) or (Tq), or with a trailing dimension of `width`
  // (B, Lq, width) or (Tq, width) when width > 0; of `dtype`. The operand's head stride walks
  // the trailing dimension.
  Operand per_query_row(const char* name, const TensorView& t, DType dtype, std::int64_t width = 0) const;
  // A learned scalar per query head: (Hq) or (1) (shared by every head), of stats_dtype(), on
  // q's device. The operand's head stride is 0 for a shared one.
  Operand per_head(const char* name, const TensorView& t) const;
  // Its gradient: shaped like `like` (the scalar), writable.
  Operand per_head_grad(const char* name, const TensorView& t, const char* like_name,
                        const TensorView& like) const;
  // A buffer of `elements` contiguous elements of `dtype` in one dimension, on q's device.
  void* flat(const char* name, const TensorView& t, DType dtype, std::int64_t elements) const;
  // Outputs must not overlap themselves (no broadcast strides on dimensions of size > 1).
  void require_writable(const char* name, const TensorView& t) const;
  // A backward's operands, checked in this order: dout, the statistic's gradient (when the
  // mechanism has one and it is given), dq, dk, dv, then that the gradients are writable.
  GradientParams gradients(const TensorView& dout, const AttentionGrads& grads,
                           const std::optional<TensorView>& dstats = std::nullopt,
                           const char* dstats_name = "dlog_rem") const;

  void check_scale(const std::optional<double>& scale) const;
  void check_option(const char* name, bool ok, const std::string& expected,
                    const std::string& got) const;

  DType stats_dtype() const { return params_.dtype == DType::float64 ? DType::float64 : DType::float32; }
  Route route() const { return route_; }
  const char* op() const { return op_; }

  // Fills scale (default 1 / sqrt(D)) and the causal flag; outputs are bound by the caller.
  AttentionParams params(const std::optional<double>& scale, bool attend_current) const;

 private:
  void check_operand(const char* name, const TensorView& t) const;
  // Checks a cu_seqlens tensor and returns its values (copied to the host if on a device).
  std::vector<std::int32_t> check_cu_seqlens(const char* name, const TensorView& t,
                                             std::int64_t total_rows) const;
  void check_shape(const char* name, const TensorView& t, const std::int64_t* shape, int ndim,
                   const char* layout) const;
  Operand operand(const TensorView& t, int row_dim) const;

  const char* op_;
  const AttentionInputs& in_;
  const ExecContext& ctx_;
  bool varlen_ = false;
  Route route_ = Route::cpu;
  AttentionParams params_;
};

// The threshold-search tolerance of entmax and Sieve: the caller's, or 1e-12 for float64
// inputs and 1e-5 otherwise: float32 sums of long rows round at about 1e-6, and the spec asks
// for 1e-4.
double resolve_tolerance(const AttentionCall& call, const std::optional<double>& tolerance);

}  // namespace winnow::detail
