// The winnow command line tool's subcommands.
#pragma once

#include <CLI/CLI.hpp>

namespace winnow::apps {

void add_info_command(CLI::App& app);
void add_demo_command(CLI::App& app);
// `train` and `train-bench`; built with LibTorch only (WINNOW_WITH_MODELS).
void add_train_command(CLI::App& app);
// `study`, `eval`, `plot` and `generate`; built with LibTorch only.
void add_study_commands(CLI::App& app);

}  // namespace winnow::apps
