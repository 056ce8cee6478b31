// `winnow info`: what this build contains and which devices it sees.
#include <omp.h>

#include <iostream>

#include "build_info.h"
#include "commands.h"
#include "winnow/winnow.h"

namespace winnow::apps {

void add_info_command(CLI::App& app) {
  CLI::App* cmd = app.add_subcommand("info", "Print the build's backends, devices and mechanisms");
  cmd->callback([] {
    std::cout << "winnow " << WINNOW_VERSION << "\n"
              << "CPU kernels:  yes (float32, float64), " << omp_get_max_threads()
              << " OpenMP threads\n"
              << "CUDA kernels: "
              << (built_with_cuda() ? std::string("built for ") + WINNOW_BUILD_CUDA_ARCHS
                                    : std::string("not built"))
              << "\n"
              << "CUDA devices: " << cuda_device_count() << "\n"
              << "operators:    softmax, stick_breaking (forward, backward; CPU and CUDA)\n"
#ifdef WINNOW_WITH_MODELS
              << "layers:       softmax (rope | nope | alibi, ssmax, gates g1/g2), differential,\n"
              << "              stick_breaking (remainder bias, head norm)\n"
              << "training:     winnow train --config FILE\n"
#endif
        ;
  });
}

}  // namespace winnow::apps
