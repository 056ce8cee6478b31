// Decoding against paged caches on the CPU (winnow/decode.h): every sequence's keys gathered
// from shuffled pages give the float64 reference forward's answer, for both mechanisms, both
// causal rules, GQA, several queries per sequence and odd page sizes; bad lengths and pages
// are refused with the sequence named, before any output is written.
#include <gtest/gtest.h>

#include <cmath>

#include "support/expect_error.h"
#include "support/paged_case.h"

namespace winnow::testing {
namespace {

const std::vector<PagedShape>& shapes() {
  static const std::vector<PagedShape> all = {
      {"gqa_one_query", {1, 70, 301}, 1, 8, 2, 16, 16, 16},
      {"mha_three_queries_page_7", {3, 64, 100}, 3, 2, 2, 24, 8, 7},
      {"page_of_one", {5, 2}, 2, 4, 1, 8, 16, 1},
  };
  return all;
}

TEST(Decode, PagedCacheMatchesTheReferenceOnTheGatheredKeys) {
  for (std::size_t s = 0; s < shapes().size(); ++s) {
    const PagedProblem p = PagedProblem::random(shapes()[s], 40 + s);
    for (Mechanism m : {Mechanism::softmax, Mechanism::stick_breaking}) {
      for (bool current : {true, false}) {
        SCOPED_TRACE(shapes()[s].name + " " + name_of(m) + (current ? " current" : " strict"));
        const PagedResults want = reference_paged(p, m, DType::float64, current);
        const PagedResults f64 = run_paged(p, m, DType::float64, current);
        EXPECT_LT(relative_error(f64.out, want.out), 1e-12);
        EXPECT_LT(relative_error(f64.stat, want.stat), 1e-12);
        const PagedResults f32 = run_paged(p, m, DType::float32, current);
        const PagedResults want32 = reference_paged(p, m, DType::float32, current);
        EXPECT_LT(relative_error(f32.out, want32.out), 1e-5);
        EXPECT_LT(relative_error(f32.stat, want32.stat), 1e-5);
        const PagedResults ref = run_paged(p, m, DType::float64, current, nullptr, Backend::reference);
        EXPECT_LT(relative_error(ref.out, want.out), 1e-14);
      }
    }
  }
}

// A query that sees no key (one cached key, strict causality) outputs zero with the empty
// row's statistic: lse -inf, log_rem 0.
TEST(Decode, QueryWithoutVisibleKeysOutputsZero) {
  const PagedProblem p = PagedProblem::random({"one_key", {1, 4}, 1, 2, 1, 8, 8, 4}, 9);
  const PagedResults sm = run_paged(p, Mechanism::softmax, DType::float64, /*attend_current=*/false);
  const PagedResults sb = run_paged(p, Mechanism::stick_breaking, DType::float64, false);
  for (int h = 0; h < 2; ++h) {
    EXPECT_EQ(sm.stat[static_cast<std::size_t>(h)], -INFINITY);
    EXPECT_EQ(sb.stat[static_cast<std::size_t>(h)], 0.0);
    for (int d = 0; d < 8; ++d) {
      EXPECT_EQ(sm.out[static_cast<std::size_t>(h * 8 + d)], 0.0);
      EXPECT_EQ(sb.out[static_cast<std::size_t>(h * 8 + d)], 0.0);
    }
  }
}

TEST(Decode, BadLengthsPagesAndOptionsAreRefused) {
  const PagedProblem good = PagedProblem::random({"errors", {3, 20}, 2, 2, 1, 8, 8, 4}, 3);
  auto call = [](const PagedProblem& p) { run_paged(p, Mechanism::softmax, DType::float64, true); };
  {
    PagedProblem p = good;
    p.seq_lens.set_values({3, 1});  // fewer keys than its two queries
    expect_error([&] { call(p); }, "sequence 1 holding at least its 2 queries' keys");
  }
  {
    PagedProblem p = good;
    const std::int64_t capacity = p.block_table.shape()[1] * 4;
    p.seq_lens.set_values({3, static_cast<double>(capacity + 1)});
    expect_error([&] { call(p); }, "sequence 1 holding at most the " + std::to_string(capacity));
  }
  {
    PagedProblem p = good;
    std::vector<double> table = p.block_table.values();
    table[0] = static_cast<double>(p.k_pages.shape()[0]);  // one past the last page
    p.block_table.set_values(table);
    expect_error([&] { call(p); }, "sequence 0's pages in [0, ");
  }
  {
    PagedProblem p = good;
    p.k_pages = HostTensor({p.k_pages.shape()[0], 4, 1, 6}, DType::float64);
    expect_error([&] { call(p); }, "argument 'k'");
  }
  {
    PagedProblem p = good;
    p.block_table = HostTensor({2, 6}, DType::float64);
    expect_error([&] { call(p); }, "argument 'block_table'");
  }
  {
    const HostTensor q = good.q, k = good.k_pages, v = good.v_pages;
    HostTensor out({2, 2, 2, 8}, DType::float64), stat({2, 2, 2}, DType::float64);
    decode::PagedCache cache{k.view(), v.view(), good.block_table.view(), good.seq_lens.view()};
    stick_breaking::Options o;
    o.halt_cutoff = 40;
    expect_error([&] { decode::stick_breaking(q.view(), cache, o, {out.view(), stat.view(), std::nullopt}); },
                 "halt_cutoff");
    HostTensor short_stat({2, 2, 1}, DType::float64);
    expect_error([&] { decode::softmax(q.view(), cache, {}, {out.view(), short_stat.view()}); }, "argument 'lse'");
  }
}

}  // namespace
}  // namespace winnow::testing
