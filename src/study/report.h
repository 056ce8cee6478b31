// A study's result as people read it: a Markdown table shaped like 000's table 1 (rows:
// mechanisms; columns: in distribution and each length multiple) and a plot of the measure
// against length, one line per mechanism, the way 000's figure 1 shows it.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace winnow::study {

// The Markdown report of a result (run_study's JSON): the main table, the other measure, the
// training summary and, where recorded, diagnostics.
std::string markdown_report(const nlohmann::json& result);

// The Markdown report of a sweep (run_sweep's JSON): final held-out loss by mechanism and value,
// diverged runs marked, and the runs' loss spikes and largest activations.
std::string sweep_report(const nlohmann::json& sweep);

// Whether this build can draw plots (PLplot was found).
bool can_plot();
// Draws the measure against length as SVG into `path`; throws when !can_plot().
void plot_result(const nlohmann::json& result, const std::string& path);
// Draws every plot a result has data for into the folder `dir`: accuracy.svg (plot_result),
// loss_by_position.svg (bits per byte or nats against position at the longest length, where
// the study measured the loss by position) and sink_ratio.svg (the mean sink ratio against
// length, where it ran diagnostics). Returns the paths written; throws when !can_plot().
std::vector<std::string> plot_study(const nlohmann::json& result, const std::string& dir);
// Draws a sweep's final held-out loss against the swept value (log scale for a learning rate or
// any positive numbers spanning a factor over 10), diverged runs drawn as crosses.
void plot_sweep(const nlohmann::json& sweep, const std::string& path);
// Draws a GPU benchmark's tokens/s against sequence length (bench/gpu_attention_bench.py --json:
// rows with method, L, inference_tokens_per_s, training_tokens_per_s), inference and training
// side by side, both axes logarithmic: 000's figure 4 left. Throws when !can_plot().
void plot_throughput(const nlohmann::json& bench, const std::string& path);

}  // namespace winnow::study
