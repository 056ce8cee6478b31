#include <exception>
#include <iostream>

#include "commands.h"
#include "winnow/error.h"

int main(int argc, char** argv) {
  CLI::App app{"winnow: causal attention that selects instead of spreading"};
  app.require_subcommand(1);
  winnow::apps::add_info_command(app);
  winnow::apps::add_demo_command(app);
#ifdef WINNOW_WITH_MODELS
  winnow::apps::add_train_command(app);
  winnow::apps::add_study_commands(app);
#endif
  try {
    CLI11_PARSE(app, argc, argv);
  } catch (const winnow::Error& e) {
    std::cerr << "error: " << e.what() << '\n';
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << '\n';
    return 1;
  }
  return 0;
}
