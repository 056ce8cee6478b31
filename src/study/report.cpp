#include "study/report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "winnow/error.h"

#ifdef WINNOW_HAVE_PLPLOT
#include <plplot/plstream.h>
#endif

namespace winnow::study {
using nlohmann::json;

namespace {

std::string fixed(double x, int digits = 1) {
  char text[32];
  std::snprintf(text, sizeof text, "%.*f", digits, x);
  return text;
}

// The measure the tables lead with: exact match for generative tasks, else the study's metric.
std::string main_measure(const json& r) {
  return r.value("generative", false) ? "exact_match" : r.value("metric", std::string("accuracy"));
}

std::string measure_words(const json& r, const std::string& measure) {
  const std::string task = r.contains("task") ? r["task"].value("name", std::string()) : "";
  if (measure == "exact_match") {
    return r.value("generative", false)
               ? "exact match of the generated answer (%), mean over depths"
               : "exact match per sequence (%)";
  }
  if (task == "mqrar") return "per-query accuracy (%)";
  if (task == "corpus") return "next-byte accuracy (%)";
  return "per-token accuracy (%)";
}

std::string column_header(const json& point, bool first) {
  const std::string len = std::to_string(point["length"].get<long long>());
  const long long mult = point["multiple"].get<long long>();
  if (mult == 1 && first) return "ID (" + len + ")";
  return std::to_string(mult) + "x (" + len + ")";
}

// One row per mechanism, one column per length, of value(point) written with `digits`.
template <class Value>
std::string table_of(const json& r, Value value, int digits) {
  const json& mechs = r["mechanisms"];
  if (mechs.empty()) return "(no mechanisms ran)\n";
  std::string out = "| mechanism |";
  std::string rule = "|---|";
  const json& first = mechs[0]["results"];
  for (std::size_t i = 0; i < first.size(); ++i) {
    out += " " + column_header(first[i], i == 0) + " |";
    rule += "---:|";
  }
  out += "\n" + rule + "\n";
  for (const json& m : mechs) {
    out += "| " + m["label"].get<std::string>() + " |";
    for (const json& p : m["results"]) out += " " + fixed(value(p), digits) + " |";
    out += "\n";
  }
  return out;
}

bool language_modeling(const json& r) {
  return r.contains("task") && r["task"].value("name", std::string()) == "corpus";
}

// A measure in percent.
std::string table(const json& r, const std::string& measure) {
  return table_of(r, [&](const json& p) { return 100.0 * p.value(measure, 0.0); }, 1);
}

// A magnitude that may be huge (a diverged run's activations): fixed below 1e5, else %.2g.
std::string magnitude(double x) {
  if (std::abs(x) < 1e5) return fixed(x, 1);
  char text[32];
  std::snprintf(text, sizeof text, "%.2g", x);
  return text;
}

std::string seconds(double s) {
  if (s >= 120) return fixed(s / 60.0, 1) + " min";
  return fixed(s, 1) + " s";
}

// Losses are shown in bits per byte for the byte-level corpus, in nats elsewhere.
double loss_unit(const json& r) { return language_modeling(r) ? std::log(2.0) : 1.0; }
std::string loss_unit_words(const json& r) {
  return language_modeling(r) ? "bits per byte" : "nats per token";
}

// The mean loss over positions [lo, hi) from a point's binned loss by position; NaN where no
// bin lies inside.
double segment_loss(const json& position_loss, double lo, double hi) {
  double nll = 0, tokens = 0;
  const json& start = position_loss["start"];
  for (std::size_t i = 0; i < start.size(); ++i) {
    const double a = start[i].get<double>(), b = position_loss["end"][i].get<double>();
    if (a >= lo && b <= hi) {
      const double t = position_loss["tokens"][i].get<double>();
      nll += position_loss["loss"][i].get<double>() * t;
      tokens += t;
    }
  }
  return tokens > 0 ? nll / tokens : std::nan("");
}

// The point of a mechanism's results at the longest length that has `key`, or nullptr.
const json* longest_with(const json& mechanism, const char* key) {
  const json* best = nullptr;
  for (const json& p : mechanism["results"]) {
    if (p.contains(key) && (best == nullptr || p["length"].get<double>() > (*best)["length"].get<double>()))
      best = &p;
  }
  return best;
}

// Loss by position at the longest length, in segments between the evaluated lengths:
// [0, n), [n, 2n), ... for multiples 1, 2, ...: does the loss stay flat past the training length?
std::string position_loss_table(const json& r) {
  const json& mechs = r["mechanisms"];
  const json* first = mechs.empty() ? nullptr : longest_with(mechs[0], "position_loss");
  if (first == nullptr) return "";
  std::vector<double> edges = {0};
  for (const json& p : mechs[0]["results"]) {
    const double len = p["length"].get<double>();
    if (len > edges.back() && len <= (*first)["length"].get<double>()) edges.push_back(len);
  }
  std::string out = "\nloss (" + loss_unit_words(r) + ") by position at L = " +
                    std::to_string((*first)["length"].get<long long>()) +
                    ", in segments between the evaluated lengths:\n\n| mechanism |";
  std::string rule = "|---|";
  for (std::size_t i = 1; i < edges.size(); ++i) {
    out += " " + fixed(edges[i - 1], 0) + "-" + fixed(edges[i], 0) + " |";
    rule += "---:|";
  }
  out += "\n" + rule + "\n";
  for (const json& m : mechs) {
    const json* p = longest_with(m, "position_loss");
    out += "| " + m["label"].get<std::string>() + " |";
    for (std::size_t i = 1; i < edges.size(); ++i) {
      const double v = p ? segment_loss((*p)["position_loss"], edges[i - 1], edges[i]) : std::nan("");
      out += " " + (std::isfinite(v) ? fixed(v / loss_unit(r), 4) : std::string("-")) + " |";
    }
    out += "\n";
  }
  return out;
}

// Full-context forward latency (ms, median) by length, for the mechanisms that measured it.
std::string latency_table(const json& r) {
  std::vector<double> lengths;
  for (const json& m : r["mechanisms"]) {
    if (!m.contains("latency")) continue;
    for (const json& p : m["latency"]) {
      const double l = p["length"].get<double>();
      if (std::find(lengths.begin(), lengths.end(), l) == lengths.end()) lengths.push_back(l);
    }
  }
  if (lengths.empty()) return "";
  std::sort(lengths.begin(), lengths.end());
  std::string out =
      "\nFull-context forward latency (ms, median; one sequence, no gradients, the evaluated "
      "model):\n\n| mechanism |";
  std::string rule = "|---|";
  for (double l : lengths) {
    out += " " + fixed(l, 0) + " |";
    rule += "---:|";
  }
  out += "\n" + rule + "\n";
  for (const json& m : r["mechanisms"]) {
    if (!m.contains("latency")) continue;
    out += "| " + m["label"].get<std::string>() + " |";
    for (double l : lengths) {
      std::string cell = "-";
      for (const json& p : m["latency"]) {
        if (p["length"].get<double>() == l) {
          cell = p.contains("median_ms") ? fixed(p["median_ms"].get<double>(), 2) : std::string("failed");
        }
      }
      out += " " + cell + " |";
    }
    out += "\n";
  }
  return out;
}

}  // namespace

std::string markdown_report(const json& r) {
  std::string out;
  const std::string title = r.value("title", std::string());
  out += "## " + (title.empty() ? r.value("study", std::string("study")) : title) + "\n\n";
  const std::string measure = main_measure(r);
  out += measure_words(r, measure) + ", " + std::to_string(r.value("instances", 0)) +
         " fresh instances per length" + (r.value("generative", false) ? " and depth" : "") +
         "; trained at n = " + std::to_string(r.value("train_length", 0)) + " (" +
         r.value("profile", std::string("?")) + " profile, " + r.value("device", std::string("?")) +
         ", " + r.value("date", std::string()) + ").\n\n";
  if (language_modeling(r)) {
    // Next-byte prediction: the held-out loss leads, in bits per byte; exact match of whole
    // windows means nothing here.
    out += table(r, "accuracy");
    out += "\nheld-out loss, bits per byte (nats / ln 2), at each length:\n\n" +
           table_of(r, [](const json& p) { return p.value("loss", 0.0) / std::log(2.0); }, 4);
  } else {
    out += table(r, measure);
  }
  out += position_loss_table(r);
  out += latency_table(r);
  if (!r.value("generative", false)) {
    if (!language_modeling(r)) {
      const std::string other = measure == "accuracy" ? "exact_match" : "accuracy";
      out += "\n" + measure_words(r, other) + ":\n\n" + table(r, other);
    }
  } else {
    for (const json& m : r["mechanisms"]) {
      out += "\n" + m["label"].get<std::string>() + ", exact match (%) by length and depth:\n\n";
      std::string head = "| length |", rule = "|---:|";
      const json& results = m["results"];
      if (results.empty()) continue;
      for (const json& c : results[0]["cells"]) {
        head += " " + fixed(c["depth"].get<double>(), 2) + " |";
        rule += "---:|";
      }
      out += head + "\n" + rule + "\n";
      for (const json& p : results) {
        out += "| " + std::to_string(p["length"].get<long long>()) + " |";
        for (const json& c : p["cells"])
          out += " " + fixed(100.0 * c["exact_match"].get<double>()) + " |";
        out += "\n";
      }
    }
  }
  out +=
      "\nTraining (same budget for every mechanism); loss spikes: steps whose loss exceeded the "
      "running mean by the spike threshold (train.spike_threshold), largest loss / running mean "
      "in brackets; max activation: the largest |value| of the residual stream on a held-out "
      "batch, over the log steps:\n\n"
      "| mechanism | parameters | steps | tokens | train time | held-out loss | held-out accuracy "
      "| loss spikes | max activation |\n"
      "|---|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  for (const json& m : r["mechanisms"]) {
    const json& e = m["final_eval"];
    const bool resumed = m.value("resumed_at_step", 0) > 0;
    out += "| " + m["label"].get<std::string>() + " | " +
           std::to_string(m["parameters"].get<long long>()) + " | " +
           std::to_string(m["steps"].get<long long>()) + " | " +
           fixed(m["train_tokens"].get<double>() / 1e6, 2) + " M | " +
           (resumed ? "resumed" : seconds(m["train_seconds"].get<double>())) + " | " +
           fixed(e.value("eval_loss", 0.0), 4) + " | " +
           fixed(100.0 * e.value("eval_accuracy", 0.0)) + "% | ";
    if (m.contains("health")) {
      const json& h = m["health"];
      out += std::to_string(h.value("spikes", 0)) + " (" + fixed(h.value("max_loss_ratio", 0.0), 2) +
             ") | " + magnitude(h.value("max_activation", 0.0)) + " |\n";
    } else {
      out += "- | - |\n";
    }
  }
  // eval.select_multiple: the checkpoint each mechanism was evaluated with.
  std::string chosen;
  for (const json& m : r["mechanisms"]) {
    if (!m.contains("selection")) continue;
    const json& sel = m["selection"];
    const std::string measure = sel["measure"].get<std::string>();
    chosen += "| " + m["label"].get<std::string>() + " | " + std::to_string(sel["multiple"].get<long long>()) +
              "x (" + std::to_string(sel["length"].get<long long>()) + ") | " +
              std::to_string(sel["chosen_step"].get<long long>()) + " |";
    for (const json& c : sel["checkpoints"]) {
      chosen += " " + std::to_string(c["step"].get<long long>()) + ": " + fixed(100.0 * c[measure].get<double>()) + "%";
    }
    chosen += " |\n";
  }
  if (!chosen.empty()) {
    out +=
        "\nCheckpoint selection (eval.select_multiple): every kept checkpoint scored at the "
        "selection length on instances apart from the evaluation's; the tables above use the "
        "chosen one:\n\n| mechanism | at | chosen step | measure by step |\n|---|---|---:|---|\n" +
        chosen;
  }
  bool any_diagnostics = false;
  for (const json& m : r["mechanisms"]) {
    for (const json& p : m["results"]) any_diagnostics |= p.contains("diagnostics");
  }
  if (any_diagnostics) {
    out +=
        "\nDiagnostics, mean over layers and heads of the last query rows (nn/probe.h): sink "
        "ratio (mass on key 0 relative to uniform, 004's generalized sink ratio), first-token "
        "share (003's attention to the first token, %), weight entropy (nats), exact-zero "
        "fraction, support (nonzero weights per query: mean, and largest), unallocated stick "
        "(stick-breaking, Sieve):\n\n"
        "| mechanism | length | sink ratio | first token | entropy | zero fraction | support | "
        "max support | remainder |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|\n";
    for (const json& m : r["mechanisms"]) {
      for (const json& p : m["results"]) {
        if (!p.contains("diagnostics")) continue;
        const json& mean = p["diagnostics"]["mean"];
        const json max = p["diagnostics"].value("max", json::object());
        auto cell = [&](const char* key, int digits, double times = 1.0) {
          return mean.contains(key) ? fixed(times * mean[key].get<double>(), digits) : std::string("-");
        };
        const std::string max_support =
            max.contains("support_max") ? fixed(max["support_max"].get<double>(), 0) : "-";
        out += "| " + m["label"].get<std::string>() + " | " +
               std::to_string(p["length"].get<long long>()) + " | " + cell("sink_ratio", 2) +
               " | " + cell("first_token_share", 1, 100.0) + " | " + cell("entropy", 2) + " | " + cell("zero_fraction", 3) + " | " +
               cell("support", 1) + " | " + max_support + " | " + cell("remainder", 3) + " |\n";
      }
    }
  }
  return out;
}

std::string sweep_report(const json& r) {
  const json& sweep = r["sweep"];
  const std::string key = sweep.value("key", std::string("?"));
  const std::string title = r.value("title", std::string());
  std::string out = "## " + (title.empty() ? r.value("study", std::string("study")) : title) +
                    ": sweep of " + key + "\n\n";
  out += "Final held-out loss (" + loss_unit_words(r) + ") of each run by " + key + " (" +
         r.value("profile", std::string("?")) + " profile, " + r.value("device", std::string("?")) +
         ", " + r.value("date", std::string()) +
         "); diverged: a loss or gradient norm that was not finite (at the step shown), or a "
         "final loss no better than uniform guessing.\n\n| mechanism |";
  std::string rule = "|---|";
  for (const json& v : sweep["values"]) {
    out += " " + v.dump() + " |";
    rule += "---:|";
  }
  out += "\n" + rule + "\n";
  auto row = [&](const json& m, auto cell) {
    out += "| " + m["label"].get<std::string>() + " |";
    for (const json& run : m["runs"]) out += " " + cell(run) + " |";
    out += "\n";
  };
  for (const json& m : r["mechanisms"]) {
    row(m, [&](const json& run) {
      std::string text = run.contains("final_loss")
                             ? fixed(run["final_loss"].get<double>() / loss_unit(r), 4)
                             : std::string();
      if (run.value("diverged", false)) {
        text += (text.empty() ? "" : " ") + std::string("diverged") +
                (run.contains("diverged_at_step")
                     ? " (step " + std::to_string(run["diverged_at_step"].get<long long>()) + ")"
                     : std::string());
      }
      return text;
    });
  }
  out += "\nLoss spikes (largest loss / running mean) and the largest residual activation of "
         "each run:\n\n| mechanism |";
  for (const json& v : sweep["values"]) out += " " + v.dump() + " |";
  out += "\n" + rule + "\n";
  for (const json& m : r["mechanisms"]) {
    row(m, [&](const json& run) {
      const json h = run.value("health", json::object());
      return std::to_string(h.value("spikes", 0)) + " (" + fixed(h.value("max_loss_ratio", 0.0), 2) +
             "), " + magnitude(h.value("max_activation", 0.0));
    });
  }
  return out;
}

#ifdef WINNOW_HAVE_PLPLOT
bool can_plot() { return true; }

namespace {
// An SVG page of width x height pixels, black on white.
void start_svg(plstream& pls, const std::string& path, PLINT width, PLINT height) {
  pls.sdev("svg");
  pls.sfnam(path.c_str());
  pls.spage(0, 0, width, height, 0, 0);
  pls.scolbg(255, 255, 255);
  pls.scol0(15, 0, 0, 0);
  pls.init();
}

// Lines with point markers, series i in colour i of PLplot's default map (then its line styles,
// every eight), and their legend. The labels stay here: the legend reads them as C strings.
class Series {
 public:
  void draw(plstream& pls, const std::string& label, const std::vector<PLFLT>& x,
            const std::vector<PLFLT>& y) {
    static constexpr PLINT kColours[] = {1, 9, 3, 13, 8, 10, 4, 14};
    const std::size_t i = labels_.size();
    const PLINT colour = kColours[i % 8], style = static_cast<PLINT>(i / 8 % 8 + 1);
    pls.col0(colour);
    pls.lsty(style);
    pls.width(2.5);
    if (!x.empty()) {
      pls.line(static_cast<PLINT>(x.size()), x.data(), y.data());
      pls.poin(static_cast<PLINT>(x.size()), x.data(), y.data(), 4);
    }
    pls.lsty(1);
    pls.width(1);
    colours_.push_back(colour);
    styles_.push_back(style);
    labels_.push_back(label);
  }

  void legend(plstream& pls, PLINT position, PLFLT x, PLFLT y, PLFLT plot_width, PLFLT text_scale) const {
    const auto n = static_cast<PLINT>(labels_.size());
    std::vector<PLINT> opt(labels_.size(), PL_LEGEND_LINE), text_colours(labels_.size(), 15);
    std::vector<PLFLT> widths(labels_.size(), 2.5);
    std::vector<const char*> text;
    for (const std::string& l : labels_) text.push_back(l.c_str());
    PLFLT width = 0, height = 0;
    pls.legend(&width, &height, PL_LEGEND_BACKGROUND | PL_LEGEND_BOUNDING_BOX, position, x, y,
               plot_width, 0, 15, 1, n, 1, n, opt.data(), 1.0, text_scale, 2.0, 0.0,
               text_colours.data(), text.data(), nullptr, nullptr, nullptr, nullptr,
               colours_.data(), styles_.data(), widths.data(), nullptr, nullptr, nullptr, nullptr);
  }

 private:
  std::vector<PLINT> colours_, styles_;
  std::vector<std::string> labels_;
};

// Lines over data coordinates, x optionally logarithmic; dashed verticals at x_marks; crosses
// (PLplot symbol 5) at each line's marked points, in the line's colour.
struct Curve {
  std::string label;
  std::vector<double> x, y;
  std::vector<double> cross_x, cross_y;
};
void line_plot(const std::string& path, const std::string& title, const std::string& x_label,
               const std::string& y_label, const std::vector<Curve>& curves, bool log_x,
               const std::vector<double>& x_marks) {
  auto tx = [&](double x) { return log_x ? std::log10(x) : x; };
  double x_lo = 1e300, x_hi = -1e300, y_lo = 1e300, y_hi = -1e300;
  for (const Curve& c : curves) {
    for (std::size_t i = 0; i < c.x.size(); ++i) {
      x_lo = std::min(x_lo, tx(c.x[i]));
      x_hi = std::max(x_hi, tx(c.x[i]));
      y_lo = std::min(y_lo, c.y[i]);
      y_hi = std::max(y_hi, c.y[i]);
    }
    for (std::size_t i = 0; i < c.cross_x.size(); ++i) {
      x_lo = std::min(x_lo, tx(c.cross_x[i]));
      x_hi = std::max(x_hi, tx(c.cross_x[i]));
      y_lo = std::min(y_lo, c.cross_y[i]);
      y_hi = std::max(y_hi, c.cross_y[i]);
    }
  }
  if (!(x_hi >= x_lo) || !(y_hi >= y_lo))
    throw Error(ErrorKind::invalid_argument, "plot: nothing to draw for " + path);
  const double x_pad = std::max(1e-3, 0.04 * (x_hi - x_lo)), y_pad = std::max(1e-3, 0.06 * (y_hi - y_lo));
  plstream pls;
  start_svg(pls, path, 1040, 560);
  pls.scol0(3, 0, 150, 0);
  pls.adv(0);
  pls.vpor(0.09, 0.66, 0.12, 0.9);  // the legend goes to the right, off the data
  pls.wind(x_lo - x_pad, x_hi + x_pad, y_lo - y_pad, y_hi + y_pad);
  pls.col0(15);
  pls.box(log_x ? "bcgnstl" : "bcgnst", 0, 0, "bcgnstv", 0, 0);
  pls.lab(x_label.c_str(), y_label.c_str(), "");
  pls.schr(0, 0.75);  // long study titles fit the page
  pls.mtex("t", 2.0, 0.5, 0.5, title.c_str());
  pls.schr(0, 1.0);
  for (double m : x_marks) {
    const PLFLT gx[2] = {tx(m), tx(m)}, gy[2] = {y_lo - y_pad, y_hi + y_pad};
    pls.lsty(2);
    pls.line(2, gx, gy);
    pls.lsty(1);
  }
  Series series;
  for (const Curve& c : curves) {
    std::vector<PLFLT> x, y;
    for (std::size_t i = 0; i < c.x.size(); ++i) {
      x.push_back(tx(c.x[i]));
      y.push_back(c.y[i]);
    }
    series.draw(pls, c.label, x, y);
    if (!c.cross_x.empty()) {
      std::vector<PLFLT> cx, cy;
      for (std::size_t i = 0; i < c.cross_x.size(); ++i) {
        cx.push_back(tx(c.cross_x[i]));
        cy.push_back(c.cross_y[i]);
      }
      pls.ssym(0, 2.5);
      pls.poin(static_cast<PLINT>(cx.size()), cx.data(), cy.data(), 5);
      pls.ssym(0, 1.0);
    }
  }
  series.legend(pls, PL_POSITION_RIGHT | PL_POSITION_OUTSIDE, 0.02, 0.0, 0.05, 0.75);
}
}  // namespace

void plot_result(const json& r, const std::string& path) {
  const std::string measure = main_measure(r);
  const json& mechs = r["mechanisms"];
  double lo = 1e300, hi = 0;
  for (const json& m : mechs) {
    for (const json& p : m["results"]) {
      const double x = std::log10(p["length"].get<double>());
      lo = std::min(lo, x);
      hi = std::max(hi, x);
    }
  }
  if (mechs.empty() || hi <= 0)
    throw Error(ErrorKind::invalid_argument, "plot: the result has no points");
  if (hi - lo < 0.3) {
    lo -= 0.15;
    hi += 0.15;
  }
  const double pad = 0.04 * (hi - lo);
  plstream pls;
  start_svg(pls, path, 800, 560);
  pls.adv(0);
  pls.vpor(0.1, 0.95, 0.12, 0.9);
  pls.wind(lo - pad, hi + pad, -3, 105);
  pls.col0(15);
  pls.box("bc", 0, 0, "bcgnstv", 20, 2);
  // The x axis is labelled at the evaluated lengths (with their multiple), not at powers of 10.
  const json& points = mechs[0]["results"];
  for (std::size_t i = 0; i < points.size(); ++i) {
    const double x = std::log10(points[i]["length"].get<double>());
    const double at = (x - (lo - pad)) / ((hi + pad) - (lo - pad));
    const long long mult = points[i]["multiple"].get<long long>();
    const std::string label =
        std::to_string(points[i]["length"].get<long long>()) +
        (mult == 1 ? std::string(" (ID)") : " (" + std::to_string(mult) + "x)");
    pls.mtex("b", 1.6, at, 0.5, label.c_str());
    const PLFLT gx[2] = {x, x}, gy[2] = {-3, 105};
    pls.lsty(2);
    pls.line(2, gx, gy);
    pls.lsty(1);
  }
  const std::string title = r.value("title", std::string());
  pls.lab("sequence length in tokens (multiple of the training length)",
          measure_words(r, measure).c_str(), title.c_str());
  pls.scol0(3, 0, 150, 0);  // a green that reads on white
  Series series;
  for (const json& m : mechs) {
    std::vector<PLFLT> x, y;
    for (const json& p : m["results"]) {
      x.push_back(std::log10(p["length"].get<double>()));
      y.push_back(100.0 * p.value(measure, 0.0));
    }
    series.draw(pls, m["label"].get<std::string>(), x, y);
  }
  series.legend(pls, PL_POSITION_LEFT | PL_POSITION_BOTTOM | PL_POSITION_INSIDE, 0.03, 0.14, 0.12, 0.9);
}

std::vector<std::string> plot_study(const json& r, const std::string& dir) {
  namespace fs = std::filesystem;
  std::vector<std::string> written;
  const std::string accuracy = (fs::path(dir) / "accuracy.svg").string();
  plot_result(r, accuracy);
  written.push_back(accuracy);
  const std::string title = r.value("title", std::string());
  const double train_length = r.value("train_length", 0.0);
  std::vector<Curve> by_position, sinks, latency;
  for (const json& m : r["mechanisms"]) {
    if (m.contains("latency")) {
      Curve c{m["label"].get<std::string>(), {}, {}, {}, {}};
      for (const json& p : m["latency"]) {
        if (!p.contains("median_ms")) continue;
        c.x.push_back(p["length"].get<double>());
        c.y.push_back(p["median_ms"].get<double>());
      }
      if (!c.x.empty()) latency.push_back(c);
    }
    if (const json* p = longest_with(m, "position_loss")) {
      Curve c{m["label"].get<std::string>(), {}, {}, {}, {}};
      const json& pl = (*p)["position_loss"];
      for (std::size_t i = 0; i < pl["start"].size(); ++i) {
        if (pl["tokens"][i].get<double>() <= 0) continue;
        c.x.push_back(0.5 * (pl["start"][i].get<double>() + pl["end"][i].get<double>()));
        c.y.push_back(pl["loss"][i].get<double>() / loss_unit(r));
      }
      by_position.push_back(c);
    }
    Curve sink{m["label"].get<std::string>(), {}, {}, {}, {}};
    for (const json& p : m["results"]) {
      if (!p.contains("diagnostics") || !p["diagnostics"]["mean"].contains("sink_ratio")) continue;
      sink.x.push_back(p["length"].get<double>());
      sink.y.push_back(p["diagnostics"]["mean"]["sink_ratio"].get<double>());
    }
    if (!sink.x.empty()) sinks.push_back(sink);
  }
  if (!by_position.empty()) {
    const std::string path = (fs::path(dir) / "loss_by_position.svg").string();
    line_plot(path, title, "position (the dashed line: the training length)",
              "loss (" + loss_unit_words(r) + "), by bins of positions", by_position,
              /*log_x=*/false, {train_length});
    written.push_back(path);
  }
  if (!latency.empty()) {
    const std::string path = (fs::path(dir) / "latency.svg").string();
    line_plot(path, title, "sequence length in tokens (the dashed line: the training length)",
              "full-context forward latency (ms, median)", latency, /*log_x=*/true, {train_length});
    written.push_back(path);
  }
  if (!sinks.empty()) {
    const std::string path = (fs::path(dir) / "sink_ratio.svg").string();
    line_plot(path, title, "sequence length in tokens (the dashed line: the training length)",
              "sink ratio (key 0's mass / uniform's)", sinks,
              /*log_x=*/true, {train_length});
    written.push_back(path);
  }
  return written;
}

void plot_sweep(const json& r, const std::string& path) {
  if (!r.contains("sweep") || !r.contains("mechanisms"))
    throw Error(ErrorKind::invalid_argument, "plot: expected a sweep result (with \"sweep\")");
  const std::string key = r["sweep"].value("key", std::string("value"));
  bool numeric = true, positive = true;
  double lo = 1e300, hi = -1e300, worst = -1e300;
  for (const json& m : r["mechanisms"]) {
    for (const json& run : m["runs"]) {
      if (!run["value"].is_number()) {
        numeric = false;
        continue;
      }
      const double v = run["value"].get<double>();
      positive &= v > 0;
      lo = std::min(lo, v);
      hi = std::max(hi, v);
      if (run.contains("final_loss") && std::isfinite(run["final_loss"].get<double>()))
        worst = std::max(worst, run["final_loss"].get<double>() / loss_unit(r));
    }
  }
  if (!numeric)
    throw Error(ErrorKind::invalid_argument, "plot: a sweep is drawn over numeric values only (" + key + ")");
  std::vector<Curve> curves;
  for (const json& m : r["mechanisms"]) {
    Curve c{m["label"].get<std::string>(), {}, {}, {}, {}};
    for (const json& run : m["runs"]) {
      const double v = run["value"].get<double>();
      const bool has_loss = run.contains("final_loss") && std::isfinite(run["final_loss"].get<double>());
      if (run.value("diverged", false)) {
        // Diverged runs without a loss sit at the top of the plot.
        c.cross_x.push_back(v);
        c.cross_y.push_back(has_loss ? run["final_loss"].get<double>() / loss_unit(r) : worst);
      } else if (has_loss) {
        c.x.push_back(v);
        c.y.push_back(run["final_loss"].get<double>() / loss_unit(r));
      }
    }
    curves.push_back(c);
  }
  line_plot(path, r.value("title", std::string()),
            key + " (crosses: diverged runs)", "final held-out loss (" + loss_unit_words(r) + ")",
            curves, positive && hi > 10 * lo, {});
}

namespace {
// One panel of the throughput plot, in the viewport [x0, x1] of the page's width: tokens/s
// (log) against L (log), one line per method; the last panel carries the legend, outside it.
void throughput_panel(plstream& pls, const json& rows, const std::vector<std::string>& methods,
                      const char* key, const char* title, double x0, double x1, bool legend) {
  double x_lo = 1e300, x_hi = -1e300, y_lo = 1e300, y_hi = -1e300;
  for (const json& row : rows) {
    if (!row.contains(key)) continue;
    x_lo = std::min(x_lo, std::log10(row["L"].get<double>()));
    x_hi = std::max(x_hi, std::log10(row["L"].get<double>()));
    y_lo = std::min(y_lo, std::log10(row[key].get<double>()));
    y_hi = std::max(y_hi, std::log10(row[key].get<double>()));
  }
  if (!(x_hi >= x_lo)) throw Error(ErrorKind::invalid_argument, std::string("plot: no row has ") + key);
  const double x_pad = std::max(0.05, 0.04 * (x_hi - x_lo)), y_pad = std::max(0.1, 0.05 * (y_hi - y_lo));
  pls.vpor(x0, x1, 0.15, 0.9);
  pls.wind(x_lo - x_pad, x_hi + x_pad, y_lo - y_pad, y_hi + y_pad);
  pls.col0(15);
  pls.box("bcgnstl", 0, 0, "bcgnstvl", 0, 0);
  pls.lab("sequence length L (tokens)", "tokens/s", title);
  Series series;
  for (const std::string& method : methods) {
    std::vector<PLFLT> x, y;
    for (const json& row : rows) {
      if (row["method"] != method || !row.contains(key)) continue;
      x.push_back(std::log10(row["L"].get<double>()));
      y.push_back(std::log10(row[key].get<double>()));
    }
    series.draw(pls, method, x, y);
  }
  if (legend) series.legend(pls, PL_POSITION_RIGHT | PL_POSITION_OUTSIDE, 0.03, 0.0, 0.06, 0.75);
}
}  // namespace

void plot_throughput(const json& bench, const std::string& path) {
  if (!bench.contains("results") || !bench["results"].is_array())
    throw Error(ErrorKind::invalid_argument, "plot: expected a benchmark JSON with a \"results\" list");
  const json& rows = bench["results"];
  std::vector<std::string> methods;  // in the order the benchmark ran them
  for (const json& row : rows) {
    if (!row.is_object() || !row.contains("method") || !row["method"].is_string() || !row.contains("L") ||
        !row["L"].is_number() || row["L"].get<double>() <= 0) {
      throw Error(ErrorKind::invalid_argument,
                  "plot: expected every benchmark row to have a \"method\" and a positive \"L\", got " +
                      row.dump());
    }
    for (const char* key : {"inference_tokens_per_s", "training_tokens_per_s"}) {
      if (row.contains(key) && !(row[key].is_number() && row[key].get<double>() > 0)) {
        throw Error(ErrorKind::invalid_argument,
                    std::string("plot: expected \"") + key + "\" to be a positive number, got " + row.dump());
      }
    }
    const std::string m = row["method"].get<std::string>();
    if (std::find(methods.begin(), methods.end(), m) == methods.end()) methods.push_back(m);
  }
  if (methods.empty()) throw Error(ErrorKind::invalid_argument, "plot: the benchmark has no rows");
  plstream pls;
  start_svg(pls, path, 1300, 520);
  pls.scol0(3, 0, 150, 0);
  pls.adv(0);
  throughput_panel(pls, rows, methods, "inference_tokens_per_s", "inference (forward)", 0.08, 0.36, false);
  throughput_panel(pls, rows, methods, "training_tokens_per_s", "training (forward + backward)", 0.45, 0.73, true);
}
#else
bool can_plot() { return false; }

void plot_result(const json&, const std::string&) {
  throw Error(ErrorKind::unsupported,
              "plot: this build has no PLplot (install libplplot-dev and rebuild)");
}
void plot_throughput(const json&, const std::string&) {
  throw Error(ErrorKind::unsupported,
              "plot: this build has no PLplot (install libplplot-dev and rebuild)");
}
std::vector<std::string> plot_study(const json&, const std::string&) {
  throw Error(ErrorKind::unsupported,
              "plot: this build has no PLplot (install libplplot-dev and rebuild)");
}
void plot_sweep(const json&, const std::string&) {
  throw Error(ErrorKind::unsupported,
              "plot: this build has no PLplot (install libplplot-dev and rebuild)");
}
#endif

}  // namespace winnow::study
