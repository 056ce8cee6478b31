// `winnow train`: trains the model an experiment file describes.
#include <cstdio>
#include <string>
#include <vector>

#include "commands.h"
#include "train/config.h"
#include "train/trainer.h"

namespace winnow::apps {

void add_train_command(CLI::App& app) {
  struct Args {
    std::string config;
    std::vector<std::string> overrides;
    bool fresh = false, print_config = false;
  };
  auto args = std::make_shared<Args>();
  CLI::App* cmd = app.add_subcommand("train", "Train a model from an experiment file");
  cmd->add_option("--config", args->config, "experiment file (JSON)")->required()->check(CLI::ExistingFile);
  cmd->add_option("--set", args->overrides, "override a key: --set train.lr=3e-4 (repeatable)");
  cmd->add_flag("--fresh", args->fresh, "ignore checkpoints in train.out_dir and start over");
  cmd->add_flag("--print-config", args->print_config, "print the resolved configuration and exit");
  cmd->callback([args] {
    const train::ExperimentConfig config = train::load_experiment(args->config, args->overrides);
    if (args->print_config) {
      std::printf("%s\n", train::to_json(config).dump(2).c_str());
      return;
    }
    train::Trainer trainer(config);
    if (!args->fresh) trainer.resume();
    trainer.train();
    std::printf("final %s\n", trainer.evaluate().dump().c_str());
  });
}

}  // namespace winnow::apps
