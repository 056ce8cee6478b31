// Random paged-cache decoding problems (winnow/decode.h) for the CPU and CUDA tests: pages
// handed out in a shuffled order with spare pages between, block tables wider than needed
// (unused entries -1), and the float64 answer from each sequence's keys gathered by hand and
// run through the mechanism's reference forward. Header-only (GoogleTest-free).
#pragma once

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "support/attention_case.h"
#include "support/host_tensor.h"
#include "winnow/decode.h"

namespace winnow::testing {

struct PagedShape {
  std::string name;
  std::vector<std::int64_t> seq_lens;
  std::int64_t len_q = 1, heads_q = 1, heads_kv = 1, dim = 16, dim_v = 16, page_size = 16;
};

struct PagedProblem {
  PagedShape shape;
  HostTensor q;                 // (B, Lq, Hq, D) float64
  HostTensor k_pages, v_pages;  // (P, S, Hkv, D / Dv) float64
  HostTensor block_table;       // (B, max_pages) int32
  HostTensor seq_lens;          // (B) int32

  std::int64_t batch() const { return static_cast<std::int64_t>(shape.seq_lens.size()); }

  static PagedProblem random(const PagedShape& s, std::uint64_t seed, double input_std = 1.0) {
    std::mt19937_64 rng(seed);
    PagedProblem p;
    p.shape = s;
    const std::int64_t B = p.batch(), S = s.page_size;
    std::int64_t max_pages = 1, used = 0;
    for (std::int64_t n : s.seq_lens) {
      max_pages = std::max(max_pages, (n + S - 1) / S + 1);
      used += (n + S - 1) / S;
    }
    const std::int64_t pages = 2 * used + 3;  // spare pages the table never names
    p.q = HostTensor({B, s.len_q, s.heads_q, s.dim}, DType::float64);
    p.q.set_values(random_normal(p.q.numel(), rng, input_std));
    p.k_pages = HostTensor({pages, S, s.heads_kv, s.dim}, DType::float64);
    p.k_pages.set_values(random_normal(p.k_pages.numel(), rng, input_std));
    p.v_pages = HostTensor({pages, S, s.heads_kv, s.dim_v}, DType::float64);
    p.v_pages.set_values(random_normal(p.v_pages.numel(), rng));
    std::vector<double> order(static_cast<std::size_t>(pages));
    std::iota(order.begin(), order.end(), 0.0);
    std::shuffle(order.begin(), order.end(), rng);
    std::vector<double> table(static_cast<std::size_t>(B * max_pages), -1.0), lens;
    std::size_t next = 0;
    for (std::int64_t b = 0; b < B; ++b) {
      const std::int64_t n = s.seq_lens[static_cast<std::size_t>(b)];
      for (std::int64_t i = 0; i < (n + S - 1) / S; ++i) {
        table[static_cast<std::size_t>(b * max_pages + i)] = order[next];
        next += 2;  // leave a spare page between neighbours
      }
      lens.push_back(static_cast<double>(n));
    }
    p.block_table = HostTensor({B, max_pages}, DType::int32);
    p.block_table.set_values(table);
    p.seq_lens = HostTensor({B}, DType::int32);
    p.seq_lens.set_values(lens);
    return p;
  }

  // Sequence b's keys (values) in order, as a (1, n, Hkv, D) float64 tensor.
  HostTensor gathered(const HostTensor& pages, std::int64_t b) const {
    const std::int64_t n = shape.seq_lens[static_cast<std::size_t>(b)], S = shape.page_size;
    const std::int64_t row = pages.shape()[2] * pages.shape()[3];
    const std::vector<double> all = pages.values(), table = block_table.values();
    std::vector<double> out;
    for (std::int64_t i = 0; i < n; ++i) {
      const auto page = static_cast<std::int64_t>(table[static_cast<std::size_t>(b * block_table.shape()[1] + i / S)]);
      const auto first = all.begin() + (page * S + i % S) * row;
      out.insert(out.end(), first, first + row);
    }
    HostTensor t({1, n, pages.shape()[2], pages.shape()[3]}, DType::float64);
    t.set_values(out);
    return t;
  }
};

struct PagedResults {
  std::vector<double> out, stat;
};

// The decode call on the problem's tensors converted to dtype (placed on a device when a
// placement is given), outputs poisoned beforehand.
inline PagedResults run_paged(const PagedProblem& p, Mechanism mechanism, DType dtype, bool attend_current,
                              Placement* placement = nullptr, Backend backend = Backend::automatic) {
  const std::int64_t B = p.batch();
  const HostTensor q = p.q.converted(dtype), k = p.k_pages.converted(dtype), v = p.v_pages.converted(dtype);
  const DType stat_dtype = dtype == DType::float64 ? DType::float64 : DType::float32;
  HostTensor out({B, p.shape.len_q, p.shape.heads_q, p.shape.dim_v}, dtype);
  HostTensor stat({B, p.shape.len_q, p.shape.heads_q}, stat_dtype);
  out.fill(std::nan(""));
  stat.fill(std::nan(""));
  auto placed = [&](const HostTensor& t) { return placement ? placement->place(t) : t.view(); };
  decode::PagedCache cache{placed(k), placed(v), placed(p.block_table), placed(p.seq_lens)};
  const TensorView q_v = placed(q), out_v = placed(out), stat_v = placed(stat);
  ExecContext ctx;
  ctx.backend = backend;
  if (mechanism == Mechanism::softmax) {
    softmax::Options o;
    o.attend_current = attend_current;
    decode::softmax(q_v, cache, o, {out_v, stat_v}, ctx);
  } else {
    stick_breaking::Options o;
    o.attend_current = attend_current;
    decode::stick_breaking(q_v, cache, o, {out_v, stat_v, std::nullopt}, ctx);
  }
  if (placement) {
    placement->fetch(out_v, out);
    placement->fetch(stat_v, stat);
  }
  return {out.values(), stat.values()};
}

// The float64 answer: per sequence, its gathered keys through the reference forward, from the
// problem's inputs rounded to dtype (what the kernels see).
inline PagedResults reference_paged(const PagedProblem& p, Mechanism mechanism, DType dtype, bool attend_current) {
  PagedResults r;
  const HostTensor q_all = p.q.converted(dtype).converted(DType::float64);
  const std::vector<double> qv = q_all.values();
  const std::int64_t per_seq = p.shape.len_q * p.shape.heads_q * p.shape.dim;
  for (std::int64_t b = 0; b < p.batch(); ++b) {
    HostTensor q({1, p.shape.len_q, p.shape.heads_q, p.shape.dim}, DType::float64);
    q.set_values(std::vector<double>(qv.begin() + b * per_seq, qv.begin() + (b + 1) * per_seq));
    const HostTensor k = p.gathered(p.k_pages.converted(dtype).converted(DType::float64), b);
    const HostTensor v = p.gathered(p.v_pages.converted(dtype).converted(DType::float64), b);
    HostTensor out({1, p.shape.len_q, p.shape.heads_q, p.shape.dim_v}, DType::float64);
    HostTensor stat({1, p.shape.len_q, p.shape.heads_q}, DType::float64);
    AttentionInputs in{q.view(), k.view(), v.view(), std::nullopt, std::nullopt};
    ExecContext ctx;
    ctx.backend = Backend::reference;
    if (mechanism == Mechanism::softmax) {
      softmax::Options o;
      o.attend_current = attend_current;
      softmax::forward(in, o, {out.view(), stat.view()}, ctx);
    } else {
      stick_breaking::Options o;
      o.attend_current = attend_current;
      stick_breaking::forward(in, o, {out.view(), stat.view(), std::nullopt}, ctx);
    }
    const std::vector<double> ov = out.values(), sv = stat.values();
    r.out.insert(r.out.end(), ov.begin(), ov.end());
    r.stat.insert(r.stat.end(), sv.begin(), sv.end());
  }
  return r;
}

}  // namespace winnow::testing
