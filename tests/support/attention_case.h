// Random attention problems of any layout, run through winnow's C++ API with any backend, so
// one test can compare a fast path against the float64 reference on the same inputs.
#pragma once

#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "support/host_tensor.h"
#include "winnow/winnow.h"

namespace winnow::testing {

// entmax15 / sparsemax / entmax13: alpha-entmax at alpha 1.5, 2 and 1.3 (the general-alpha
// path); sieve_exact / sieve_bound: Sieve at alpha 1.5 with either filter.
enum class Mechanism { softmax, stick_breaking, entmax15, sparsemax, entmax13, sieve_exact, sieve_bound };
const std::vector<Mechanism>& all_mechanisms();
bool is_sieve(Mechanism m);
bool is_entmax(Mechanism m);
double alpha_of(Mechanism m);  // entmax and Sieve
const char* name_of(Mechanism m);

struct ProblemShape {
  std::string name;
  // (q_len, k_len) per sequence. Batched problems need all sequences alike.
  std::vector<std::pair<std::int64_t, std::int64_t>> seqs;
  bool varlen = false;
  std::int64_t heads_q = 1, heads_kv = 1, dim = 16, dim_v = 16;
};

// The float64 values of one problem: inputs and the incoming gradients.
struct Problem {
  ProblemShape shape;
  HostTensor q, k, v;           // float64, logical layout
  HostTensor dout, dstat;       // float64
  std::optional<HostTensor> cu_q, cu_k;

  static Problem random(const ProblemShape& shape, std::uint64_t seed, double input_std = 1.0);
  std::vector<std::int64_t> q_shape() const { return q.shape(); }
};

// Where run() keeps the tensors a call sees: the host by default, or a device through these
// hooks (tests/cuda implements them with the CUDA runtime).
class Placement {
 public:
  virtual ~Placement() = default;
  // A device copy of t with the same strides; valid until the Placement is destroyed.
  virtual TensorView place(const HostTensor& t) = 0;
  virtual void fetch(const TensorView& placed, HostTensor& t) = 0;
};

struct RunConfig {
  Mechanism mechanism = Mechanism::softmax;
  DType dtype = DType::float64;
  Backend backend = Backend::automatic;
  bool attend_current = true;
  double halt_cutoff = 0.0;
  std::optional<double> scale;
  bool with_dstat = true;       // stick-breaking, Sieve: pass dlog_rem
  std::optional<double> tolerance;  // entmax, Sieve: the threshold search's
  std::optional<double> alpha;      // entmax, Sieve: in place of the mechanism's own (alpha_of)
  std::optional<double> eps;        // Sieve's bound filter
  bool permuted = false;        // store (B, L, H, D) as (B, H, L, D) / (T, H, D) as (H, T, D)
  int num_threads = 0;
  bool deterministic = false;
  bool keep_support = false;    // entmax: the forward keeps a support record for the backward
  Placement* placement = nullptr;  // nullptr: host memory
};

struct Results {
  std::vector<double> out, stat, dq, dk, dv;
  std::vector<double> kept_from;  // stick-breaking only
  std::vector<double> threshold, count;  // Sieve only
  std::vector<double> support;           // entmax with keep_support: the record as the forward left it
};

Results run(const Problem& p, const RunConfig& cfg);

std::string describe(const ProblemShape& s);

}  // namespace winnow::testing
