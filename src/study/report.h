// A study's result as people read it: a Markdown table shaped like 000's table 1 (rows:
// mechanisms; columns: in distribution and each length multiple) and a plot of the measure
// against length, one line per mechanism, the way 000's figure 1 shows it.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace winnow::study {

// The Markdown report of a result (run_study's JSON): the main table, the other measure, the
// training summary and, where recorded, diagnostics.
std::string markdown_report(const nlohmann::json& result);

// Whether this build can draw plots (PLplot was found).
bool can_plot();
// Draws the measure against length as SVG into `path`; throws when !can_plot().
void plot_result(const nlohmann::json& result, const std::string& path);
// Draws a GPU benchmark's tokens/s against sequence length (bench/gpu_attention_bench.py --json:
// rows with method, L, inference_tokens_per_s, training_tokens_per_s), inference and training
// side by side, both axes logarithmic: 000's figure 4 left. Throws when !can_plot().
void plot_throughput(const nlohmann::json& bench, const std::string& path);

}  // namespace winnow::study
