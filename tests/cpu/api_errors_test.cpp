// Every argument check of the C++ API: a bad call throws winnow::Error of the right kind,
// naming the operation, the argument, what was expected and what arrived, and writes nothing.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>

#include "support/host_tensor.h"
#include "winnow/winnow.h"

namespace winnow::testing {
namespace {

// A valid batched call: B = 2, L = 8, Hq = 4, Hkv = 2, D = 16, Dv = 8, float32.
struct ValidCall {
  HostTensor q{{2, 8, 4, 16}, DType::float32}, k{{2, 8, 2, 16}, DType::float32},
      v{{2, 8, 2, 8}, DType::float32};
  HostTensor out{{2, 8, 4, 8}, DType::float32}, stat{{2, 8, 4}, DType::float32};
  HostTensor dout{{2, 8, 4, 8}, DType::float32}, dstat{{2, 8, 4}, DType::float32};
  HostTensor dq{{2, 8, 4, 16}, DType::float32}, dk{{2, 8, 2, 16}, DType::float32},
      dv{{2, 8, 2, 8}, DType::float32};
  AttentionInputs in;
  TensorView out_view, stat_view, dout_view, dstat_view;
  AttentionGrads grads;

  ValidCall() {
    std::mt19937_64 rng(1);
    for (HostTensor* t : {&q, &k, &v, &dout, &dstat}) t->set_values(random_normal(t->numel(), rng));
    in.q = q.view();
    in.k = k.view();
    in.v = v.view();
    out_view = out.view();
    stat_view = stat.view();
    dout_view = dout.view();
    dstat_view = dstat.view();
    grads = {dq.view(), dk.view(), dv.view()};
  }

  void softmax_forward(const softmax::Options& o = {}, const ExecContext& ctx = {}) {
    softmax::forward(in, o, {out_view, stat_view}, ctx);
  }
  void stick_forward(const stick_breaking::Options& o = {}, const ExecContext& ctx = {}) {
    stick_breaking::forward(in, o, {out_view, stat_view, std::nullopt}, ctx);
  }
  void stick_backward(const stick_breaking::Options& o = {}) {
    stick_breaking::backward(in, o, {out_view, stat_view, std::nullopt}, dout_view, dstat_view, grads);
  }
  void softmax_backward() { softmax::backward(in, {}, {out_view, stat_view}, dout_view, grads); }
  void entmax_forward(const entmax::Options& o = {}) { entmax::forward(in, o, {out_view, stat_view}); }
  void entmax_backward(const entmax::Options& o = {}) {
    entmax::backward(in, o, {out_view, stat_view}, dout_view, grads);
  }
  // The threshold shares the log_rem buffer's shape; a separate one keeps them apart.
  HostTensor threshold{{2, 8, 4}, DType::float32};
  HostTensor count{{2, 8, 4}, DType::int32};
  void sieve_forward(const sieve::Options& o = {}, bool with_count = true) {
    sieve::forward(in, o,
                   {out_view, stat_view, threshold.view(),
                    with_count ? std::optional<TensorView>(count.view()) : std::nullopt});
  }
  void sieve_backward(const sieve::Options& o = {}) {
    sieve::backward(in, o, {out_view, stat_view, threshold.view(), std::nullopt}, dout_view,
                    dstat_view, grads);
  }
};

void expect_error(const std::function<void()>& call, const std::string& arg,
                  ErrorKind kind = ErrorKind::invalid_argument, const std::string& fragment = "") {
  try {
    call();
    ADD_FAILURE() << "no error for a bad '" << arg << "'";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(static_cast<int>(e.kind()), static_cast<int>(kind)) << msg;
    EXPECT_NE(msg.find("winnow::"), std::string::npos) << msg;
    EXPECT_NE(msg.find("argument '" + arg + "'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("expected"), std::string::npos) << msg;
    EXPECT_NE(msg.find(", got "), std::string::npos) << msg;
    if (!fragment.empty()) EXPECT_NE(msg.find(fragment), std::string::npos) << msg;
  }
}

TensorView with_shape(TensorView t, std::initializer_list<std::int64_t> shape) {
  int d = 0;
  for (std::int64_t s : shape) t.shape[d++] = s;
  t.ndim = d;
  return t;
}

TEST(ApiErrors, ValidSetupRuns) {
  ValidCall s;
  EXPECT_NO_THROW(s.softmax_forward());
  EXPECT_NO_THROW(s.softmax_backward());
  EXPECT_NO_THROW(s.stick_forward());
  EXPECT_NO_THROW(s.stick_backward());
}

TEST(ApiErrors, InputRanksDtypesAndDevices) {
  ValidCall s;
  s.in.q = with_shape(s.q.view(), {16, 4, 16});
  expect_error([&] { s.softmax_forward(); }, "q", ErrorKind::invalid_argument, "(B, L, H, D)");

  ValidCall s2;
  HostTensor k64 = s2.k.converted(DType::float64);
  s2.in.k = k64.view();
  expect_error([&] { s2.stick_forward(); }, "k", ErrorKind::invalid_argument, "float32 like q");

  ValidCall s3;
  s3.in.v.device = Device::cuda(0);
  expect_error([&] { s3.softmax_forward(); }, "v", ErrorKind::invalid_argument, "on cpu like q");

  ValidCall s4;
  for (TensorView* t : {&s4.in.q, &s4.in.k, &s4.in.v}) t->dtype = DType::float16;
  expect_error([&] { s4.softmax_forward(); }, "q", ErrorKind::invalid_argument, "on the CPU");

  ValidCall s5;
  ExecContext ref;
  ref.backend = Backend::reference;
  expect_error([&] { s5.stick_forward({}, ref); }, "q", ErrorKind::invalid_argument, "float64");

  ValidCall s6;
  s6.in.q.data = nullptr;
  expect_error([&] { s6.softmax_forward(); }, "q", ErrorKind::invalid_argument, "nullptr");
}

TEST(ApiErrors, InputShapesMustAgree) {
  {
    ValidCall s;
    s.in.k = with_shape(s.k.view(), {1, 8, 2, 16});
    expect_error([&] { s.softmax_forward(); }, "k", ErrorKind::invalid_argument, "batch size");
  }
  {
    ValidCall s;
    s.in.v = with_shape(s.v.view(), {2, 7, 2, 8});
    expect_error([&] { s.softmax_forward(); }, "v", ErrorKind::invalid_argument, "rows like k");
  }
  {
    ValidCall s;
    s.in.k = with_shape(s.k.view(), {2, 8, 2, 15});
    expect_error([&] { s.stick_forward(); }, "k", ErrorKind::invalid_argument, "head dimension");
  }
  {
    ValidCall s;
    s.in.v = with_shape(s.v.view(), {2, 8, 1, 8});
    expect_error([&] { s.stick_forward(); }, "v", ErrorKind::invalid_argument, "heads like k");
  }
  {
    ValidCall s;
    s.in.k = with_shape(s.k.view(), {2, 8, 3, 16});
    s.in.v = with_shape(s.v.view(), {2, 8, 3, 8});
    expect_error([&] { s.stick_forward(); }, "k", ErrorKind::invalid_argument, "grouped-query");
  }
  {
    ValidCall s;
    s.in.q = with_shape(s.q.view(), {2, 8, 4, 0});
    s.in.k = with_shape(s.k.view(), {2, 8, 2, 0});
    expect_error([&] { s.softmax_forward(); }, "q", ErrorKind::invalid_argument, ">= 1");
  }
  {
    ValidCall s;
    HostTensor long_q({2, 9, 4, 16}, DType::float32);
    s.in.q = long_q.view();
    expect_error([&] { s.softmax_forward(); }, "q", ErrorKind::invalid_argument, "at most as many rows");
  }
}

// Varlen: q (T, H, D) with cu_seqlens. T = 10 in two sequences of 4 and 6.
struct VarlenCall : ValidCall {
  HostTensor qv{{10, 4, 16}, DType::float32}, kv{{10, 2, 16}, DType::float32},
      vv{{10, 2, 8}, DType::float32}, ov{{10, 4, 8}, DType::float32}, sv{{10, 4}, DType::float32};
  HostTensor cu = int32_tensor({0, 4, 10});
  VarlenCall() {
    in.q = qv.view();
    in.k = kv.view();
    in.v = vv.view();
    in.cu_seqlens_q = cu.view();
    out_view = ov.view();
    stat_view = sv.view();
  }
};

TEST(ApiErrors, CuSeqlens) {
  {
    VarlenCall s;
    EXPECT_NO_THROW(s.stick_forward());
  }
  {
    ValidCall s;
    HostTensor cu = int32_tensor({0, 8, 16});
    s.in.cu_seqlens_k = cu.view();
    expect_error([&] { s.softmax_forward(); }, "cu_seqlens_k");
  }
  {
    VarlenCall s;
    s.in.cu_seqlens_q->dtype = DType::int64;
    expect_error([&] { s.softmax_forward(); }, "cu_seqlens_q", ErrorKind::invalid_argument, "int32");
  }
  {
    VarlenCall s;
    s.in.cu_seqlens_q = with_shape(s.cu.view(), {1, 3});
    expect_error([&] { s.softmax_forward(); }, "cu_seqlens_q", ErrorKind::invalid_argument, "1-D");
  }
  {
    VarlenCall s;
    HostTensor bad = int32_tensor({1, 4, 10});
    s.in.cu_seqlens_q = bad.view();
    expect_error([&] { s.softmax_forward(); }, "cu_seqlens_q", ErrorKind::invalid_argument, "== 0");
  }
  {
    VarlenCall s;
    HostTensor bad = int32_tensor({0, 6, 4, 10});
    s.in.cu_seqlens_q = bad.view();
    expect_error([&] { s.softmax_forward(); }, "cu_seqlens_q", ErrorKind::invalid_argument, "non-decreasing");
  }
  {
    VarlenCall s;
    HostTensor bad = int32_tensor({0, 4, 9});
    s.in.cu_seqlens_q = bad.view();
    expect_error([&] { s.softmax_forward(); }, "cu_seqlens_q", ErrorKind::invalid_argument, "last offset");
  }
  {
    VarlenCall s;
    HostTensor ck = int32_tensor({0, 10});
    s.in.cu_seqlens_k = ck.view();
    expect_error([&] { s.softmax_forward(); }, "cu_seqlens_k", ErrorKind::invalid_argument, "entries");
  }
  {
    VarlenCall s;
    HostTensor ck = int32_tensor({0, 5, 10});  // sequence 1: 6 queries, 5 keys
    s.in.cu_seqlens_k = ck.view();
    expect_error([&] { s.softmax_forward(); }, "cu_seqlens_q", ErrorKind::invalid_argument, "sequence 1");
  }
  {
    VarlenCall s;
    HostTensor wide = int32_tensor({0, 0, 4, 0, 10, 0});
    TensorView strided = wide.view();
    strided.shape[0] = 3;
    strided.stride[0] = 2;
    s.in.cu_seqlens_q = strided;
    expect_error([&] { s.softmax_forward(); }, "cu_seqlens_q", ErrorKind::invalid_argument, "contiguous");
  }
  {
    VarlenCall s;
    s.in.cu_seqlens_q->device = Device::cuda(0);
    expect_error([&] { s.softmax_forward(); }, "cu_seqlens_q", ErrorKind::invalid_argument, "like q");
  }
}

TEST(ApiErrors, Outputs) {
  {
    ValidCall s;
    s.out_view = with_shape(s.out.view(), {2, 8, 4, 16});
    expect_error([&] { s.softmax_forward(); }, "out", ErrorKind::invalid_argument, "(2, 8, 4, 8)");
  }
  {
    ValidCall s;
    HostTensor out64 = s.out.converted(DType::float64);
    s.out_view = out64.view();
    expect_error([&] { s.stick_forward(); }, "out", ErrorKind::invalid_argument, "float32");
  }
  {
    ValidCall s;
    HostTensor stat64({2, 8, 4}, DType::float64);
    s.stat_view = stat64.view();
    expect_error([&] { s.stick_forward(); }, "log_rem", ErrorKind::invalid_argument, "float32");
    expect_error([&] { s.softmax_forward(); }, "lse", ErrorKind::invalid_argument, "float32");
  }
  {
    ValidCall s;
    s.out_view.stride[1] = 0;
    expect_error([&] { s.softmax_forward(); }, "out", ErrorKind::invalid_argument, "writable");
  }
}

TEST(ApiErrors, BackwardOperands) {
  {
    ValidCall s;
    s.grads.dq = with_shape(s.dq.view(), {2, 8, 4, 8});
    expect_error([&] { s.stick_backward(); }, "dq");
  }
  {
    ValidCall s;
    HostTensor dk64 = s.dk.converted(DType::float64);
    s.grads.dk = dk64.view();
    expect_error([&] { s.softmax_backward(); }, "dk", ErrorKind::invalid_argument, "float32");
  }
  {
    ValidCall s;
    s.grads.dv = with_shape(s.dv.view(), {2, 8, 2, 16});
    expect_error([&] { s.stick_backward(); }, "dv", ErrorKind::invalid_argument, "(like v)");
  }
  {
    ValidCall s;
    s.dout_view = with_shape(s.dout.view(), {2, 8, 4, 16});
    expect_error([&] { s.softmax_backward(); }, "dout");
  }
  {
    ValidCall s;
    s.dstat_view = with_shape(s.dstat.view(), {2, 8});
    expect_error([&] { s.stick_backward(); }, "dlog_rem");
  }
  {
    ValidCall s;
    s.grads.dq.stride[3] = 0;
    expect_error([&] { s.stick_backward(); }, "dq", ErrorKind::invalid_argument, "writable");
  }
}

TEST(ApiErrors, Options) {
  ValidCall s;
  softmax::Options bad_scale;
  bad_scale.scale = std::nan("");
  expect_error([&] { s.softmax_forward(bad_scale); }, "scale", ErrorKind::invalid_argument, "finite");
  stick_breaking::Options negative;
  negative.halt_cutoff = -1.0;
  expect_error([&] { s.stick_forward(negative); }, "halt_cutoff");
  stick_breaking::Options nan_cutoff;
  nan_cutoff.halt_cutoff = std::nan("");
  expect_error([&] { s.stick_forward(nan_cutoff); }, "halt_cutoff");
  stick_breaking::Options inf_scale;
  inf_scale.scale = INFINITY;
  expect_error([&] { s.stick_backward(inf_scale); }, "scale");
}

// The support record (winnow/entmax.h): one contiguous int32 dimension of exactly
// support_record_size elements, else an error naming it; a valid one comes back from a CPU
// forward marked unlisted.
TEST(ApiErrors, EntmaxSupportRecord) {
  ValidCall s;
  const std::int64_t size = entmax::support_record_size<std::int64_t>(2 * 8 * 4, 2 * 8 * 2);
  auto forward_with = [&](const TensorView& record) {
    entmax::forward(s.in, {}, {s.out_view, s.stat_view, record});
  };
  auto backward_with = [&](const TensorView& record) {
    entmax::backward(s.in, {}, {s.out_view, s.stat_view, record}, s.dout_view, s.grads);
  };
  HostTensor wrong_dtype{{size}, DType::float32}, short_record{{size - 1}, DType::int32},
      two_dims{{1, size}, DType::int32}, strided{{2 * size}, DType::int32};
  for (const TensorView& bad : {wrong_dtype.view(), short_record.view(), two_dims.view()}) {
    expect_error([&] { forward_with(bad); }, "support");
    expect_error([&] { backward_with(bad); }, "support");
  }
  TensorView every_other = strided.view();
  every_other.shape[0] = size;
  every_other.stride[0] = 2;
  expect_error([&] { forward_with(every_other); }, "support", ErrorKind::invalid_argument, "contiguous");
  HostTensor record{{size}, DType::int32};
  record.fill(-7);
  EXPECT_NO_THROW(forward_with(record.view()));
  EXPECT_EQ(record.values()[0], 0.0) << "the CPU paths list nothing and say so";
  EXPECT_NO_THROW(backward_with(record.view()));
}

TEST(ApiErrors, EntmaxAndSieveOptions) {
  ValidCall s;
  EXPECT_NO_THROW(s.entmax_forward());
  EXPECT_NO_THROW(s.sieve_forward());
  for (const double alpha : {1.0, 0.5, std::nan(""), HUGE_VAL}) {
    entmax::Options e;
    e.alpha = alpha;
    expect_error([&] { s.entmax_forward(e); }, "alpha");
    expect_error([&] { s.entmax_backward(e); }, "alpha");
    sieve::Options v;
    v.alpha = alpha;
    expect_error([&] { s.sieve_forward(v); }, "alpha");
  }
  for (const double tolerance : {0.0, -1e-6, std::nan("")}) {
    entmax::Options e;
    e.tolerance = tolerance;
    expect_error([&] { s.entmax_forward(e); }, "tolerance");
  }
  sieve::Options eps_with_exact;
  eps_with_exact.eps = 0.5;
  expect_error([&] { s.sieve_forward(eps_with_exact); }, "eps", ErrorKind::invalid_argument, "bound");
  sieve::Options negative_eps;
  negative_eps.filter = sieve::Filter::bound;
  negative_eps.eps = -0.5;
  expect_error([&] { s.sieve_forward(negative_eps); }, "eps");
  expect_error([&] { s.sieve_backward(negative_eps); }, "eps");
}

TEST(ApiErrors, SieveOutputs) {
  ValidCall s;
  s.threshold = HostTensor({2, 8, 3}, DType::float32);
  expect_error([&] { s.sieve_forward(); }, "threshold");
  ValidCall c;
  c.count = HostTensor({2, 8, 4}, DType::float32);
  expect_error([&] { c.sieve_forward(); }, "count");
  ValidCall ok;
  EXPECT_NO_THROW(ok.sieve_forward({}, /*with_count=*/false));
}

TEST(ApiErrors, CudaTensorsWithoutCudaKernelsAreUnsupported) {
  if (built_with_cuda()) GTEST_SKIP() << "this build has CUDA kernels: tests/cuda covers CUDA calls";
  ValidCall s;
  for (TensorView* t : {&s.in.q, &s.in.k, &s.in.v, &s.out_view, &s.stat_view}) {
    t->device = Device::cuda(0);
  }
  expect_error([&] { s.stick_forward(); }, "q", ErrorKind::unsupported, "CUDA");
  expect_error([&] { s.softmax_forward(); }, "q", ErrorKind::unsupported, "CUDA");
}

TEST(ApiErrors, NothingIsWrittenWhenACheckFails) {
  ValidCall s;
  s.out.fill(7.0);
  s.stat.fill(7.0);
  stick_breaking::Options bad;
  bad.halt_cutoff = -3.0;
  EXPECT_THROW(s.stick_forward(bad), Error);
  for (double x : s.out.values()) ASSERT_EQ(x, 7.0);
  for (double x : s.stat.values()) ASSERT_EQ(x, 7.0);

  s.dq.fill(7.0);
  s.grads.dv = with_shape(s.dv.view(), {2, 8, 2, 9});
  EXPECT_THROW(s.stick_backward(), Error);
  for (double x : s.dq.values()) ASSERT_EQ(x, 7.0);
}

TEST(ApiErrors, MakeViewRejectsTooManyDimensions) {
  float x = 0;
  EXPECT_THROW(make_view(&x, DType::float32, {1, 1, 1, 1, 1}), Error);
}

}  // namespace
}  // namespace winnow::testing
