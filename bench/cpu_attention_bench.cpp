// CPU attention benchmark: winnow's streaming kernels (through the C++ API) beside the
// composed LibTorch expression softmax(q k^T * scale + mask) v, on the same inputs, same
// machine, same thread count. Reports median wall time over repeated runs, causal TFLOP/s
// (spec conventions: 4 B H L^2 D / 2 forward) and the peak extra memory of one call, measured
// in a forked child (VmHWM after resetting it, minus VmRSS before the call).
#include <torch/torch.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <functional>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "winnow/winnow.h"

namespace {

using Clock = std::chrono::steady_clock;

double median_seconds(const std::function<void()>& fn, int repeats) {
  fn();  // warm-up: first-touch page faults, thread pool start
  std::vector<double> t;
  for (int i = 0; i < repeats; ++i) {
    const auto start = Clock::now();
    fn();
    t.push_back(std::chrono::duration<double>(Clock::now() - start).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

long status_kib(const char* field) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind(field, 0) == 0) return std::stol(line.substr(std::string(field).size()));
  }
  return -1;
}

// Peak resident memory added by one call of fn, in MiB, measured in this process: VmHWM is
// reset to the current RSS first. Run in a fresh process per variant (see --memory-of), so
// no earlier variant's freed pages can be reused unseen.
double peak_extra_mib(const std::function<void()>& fn) {
  { std::ofstream("/proc/self/clear_refs") << "5"; }
  const long before = status_kib("VmRSS:");
  fn();
  return (status_kib("VmHWM:") - before) / 1024.0;
}

// Runs this program again to measure one variant's memory in a fresh process (forking a
// process whose OpenMP pool is running is not safe).
double measure_in_child(const std::string& self, const std::string& args) {
  const std::string cmd = self + " " + args;
  FILE* pipe = popen(cmd.c_str(), "r");
  if (!pipe) return -1;
  double mib = -1;
  if (std::fscanf(pipe, "%lf", &mib) != 1) mib = -1;
  pclose(pipe);
  return mib;
}

std::string blas_library() {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    for (const char* name : {"libopenblas", "libblis", "libmkl", "/blas/libblas"}) {
      if (line.find(name) != std::string::npos) return line.substr(line.find('/'));
    }
  }
  return "unknown";
}

winnow::TensorView view(const torch::Tensor& t) {
  winnow::TensorView v;
  v.data = t.data_ptr();
  v.dtype = winnow::DType::float32;
  v.ndim = static_cast<int>(t.dim());
  for (int d = 0; d < v.ndim; ++d) {
    v.shape[d] = t.size(d);
    v.stride[d] = t.stride(d);
  }
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"winnow CPU attention benchmark"};
  std::vector<int64_t> lengths{1024, 4096};
  int64_t batch = 1, heads = 8, dim = 64;
  int repeats = 5, threads = 0;
  bool backward = true;
  int64_t composed_max_length = 8192;
  std::string json_path, memory_of;
  app.add_option("--lengths", lengths, "sequence lengths");
  app.add_option("--batch", batch);
  app.add_option("--heads", heads);
  app.add_option("--dim", dim);
  app.add_option("--repeats", repeats, "timed runs per measurement (median reported)");
  app.add_option("--threads", threads, "threads for LibTorch and winnow (0: all cores)");
  app.add_option("--backward", backward, "also time the backward passes");
  app.add_option("--composed-max-length", composed_max_length,
                 "skip the composed LibTorch baseline above this length (it holds L x L scores)");
  app.add_option("--json", json_path, "write the results here");
  app.add_option("--memory-of", memory_of, "internal: print one variant's peak extra MiB");
  CLI11_PARSE(app, argc, argv);

  if (threads > 0) torch::set_num_threads(threads);
  threads = torch::get_num_threads();
  torch::NoGradGuard no_grad;
  nlohmann::json results = nlohmann::json::array();
  if (memory_of.empty()) {
    std::printf("B=%ld H=%ld D=%ld float32, %d threads, LibTorch %s, BLAS %s\n", batch, heads,
                dim, threads, TORCH_VERSION, blas_library().c_str());
    std::printf("%-7s %-34s %10s %9s %12s\n", "L", "variant", "median ms", "TFLOP/s",
                "peak +MiB");
    std::fflush(stdout);
  }

  for (int64_t L : lengths) {
    torch::manual_seed(0);
    torch::Tensor q = torch::randn({batch, L, heads, dim});
    torch::Tensor k = torch::randn({batch, L, heads, dim});
    torch::Tensor v = torch::randn({batch, L, heads, dim});
    // Outputs are touched up front so the memory measurement sees only working memory.
    torch::Tensor out = torch::zeros_like(q), stat = torch::zeros({batch, L, heads});
    torch::Tensor dout = torch::randn_like(q);
    torch::Tensor dq = torch::empty_like(q), dk = torch::empty_like(k), dv = torch::empty_like(v);
    const double scale = 1.0 / std::sqrt(static_cast<double>(dim));
    const double causal_flops = 4.0 * batch * heads * L * L * dim / 2;

    winnow::AttentionInputs in;
    in.q = view(q);
    in.k = view(k);
    in.v = view(v);
    winnow::ExecContext ctx;
    ctx.num_threads = threads;
    const winnow::AttentionGrads grads{view(dq), view(dk), view(dv)};

    struct Variant {
      std::string name;
      double flops;
      std::function<void()> fn;
      bool memory;
    };
    std::vector<Variant> variants;
    if (L <= composed_max_length)
    variants.push_back({"torch composed softmax forward", causal_flops, [&] {
                          torch::Tensor qh = q.transpose(1, 2), kh = k.transpose(1, 2),
                                        vh = v.transpose(1, 2);
                          torch::Tensor mask =
                              torch::full({L, L}, -INFINITY).triu(1);
                          torch::Tensor z = torch::matmul(qh, kh.transpose(-1, -2)) * scale + mask;
                          torch::Tensor o = torch::matmul(torch::softmax(z, -1), vh);
                          (void)o;
                        },
                        true});
    variants.push_back({"winnow stick_breaking forward", causal_flops, [&] {
                          winnow::stick_breaking::forward(in, {}, {view(out), view(stat), {}}, ctx);
                        },
                        true});
    variants.push_back({"winnow softmax forward", causal_flops, [&] {
                          winnow::softmax::forward(in, {}, {view(out), view(stat)}, ctx);
                        },
                        true});
    if (backward) {
      variants.push_back({"winnow stick_breaking backward", 2.5 * causal_flops, [&] {
                            winnow::stick_breaking::forward(in, {}, {view(out), view(stat), {}}, ctx);
                            winnow::stick_breaking::backward(in, {}, {view(out), view(stat), {}},
                                                             view(dout), std::nullopt, grads, ctx);
                          },
                          false});
      variants.push_back({"winnow softmax backward", 2.5 * causal_flops, [&] {
                            winnow::softmax::forward(in, {}, {view(out), view(stat)}, ctx);
                            winnow::softmax::backward(in, {}, {view(out), view(stat)}, view(dout),
                                                      grads, ctx);
                          },
                          false});
    }
    if (!memory_of.empty()) {
      for (const Variant& var : variants) {
        if (var.name == memory_of) std::printf("%.3f\n", peak_extra_mib(var.fn));
      }
      continue;
    }
    double composed_ms = 0;
    for (const Variant& var : variants) {
      double seconds = median_seconds(var.fn, repeats);
      if (var.name.find("backward") != std::string::npos) {
        // The timed call includes a forward pass to refresh out/stat; report backward alone.
        const std::string fwd_name =
            var.name.substr(0, var.name.find(" backward")) + " forward";
        for (const auto& r : results) {
          if (r["L"] == L && r["variant"] == fwd_name) seconds -= r["median_ms"].get<double>() / 1e3;
        }
      }
      std::ostringstream args;
      args << "--lengths " << L << " --batch " << batch << " --heads " << heads << " --dim " << dim
           << " --threads " << threads << " --memory-of '" << var.name << "'";
      const double mib = var.memory ? measure_in_child("/proc/" + std::to_string(getpid()) + "/exe", args.str()) : -1;
      const double ms = seconds * 1e3;
      if (var.name.rfind("torch", 0) == 0) composed_ms = ms;
      std::printf("%-7ld %-34s %10.1f %9.3f %12.1f\n", L, var.name.c_str(), ms,
                  var.flops / seconds / 1e12, mib);
      std::fflush(stdout);
      results.push_back({{"L", L}, {"variant", var.name}, {"median_ms", ms},
                         {"tflops", var.flops / seconds / 1e12}, {"peak_extra_mib", mib},
                         {"speed_vs_composed_softmax", composed_ms > 0 ? composed_ms / ms : 1.0}});
    }
  }
  if (!json_path.empty()) {
    std::ofstream(json_path) << nlohmann::json{{"batch", batch}, {"heads", heads}, {"dim", dim},
                                               {"threads", threads}, {"blas", blas_library()},
                                               {"results", results}}
                                    .dump(2);
  }
  return 0;
}
