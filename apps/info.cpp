// `winnow info`: what this build contains, which devices it sees, and which attention
// mechanisms the model layer can build.
#include <omp.h>

#include <iostream>

#include "build_info.h"
#include "commands.h"
#include "winnow/winnow.h"

#ifdef WINNOW_WITH_MODELS
#include "nn/mechanisms.h"
#include "train/distributed.h"
#include "train/runtime.h"
#endif

namespace winnow::apps {

void add_info_command(CLI::App& app) {
  CLI::App* cmd = app.add_subcommand("info", "Print the build's backends, devices and mechanisms");
  cmd->callback([] {
    std::cout << "winnow " << WINNOW_VERSION << " (" << WINNOW_BUILD_TYPE << ")\n"
              << "CPU kernels:  yes (float32, float64), " << omp_get_max_threads()
              << " OpenMP threads\n"
              << "CUDA kernels: "
              << (built_with_cuda() ? std::string("built for ") + WINNOW_BUILD_CUDA_ARCHS
                                    : std::string("not built"))
              << "\n"
              << "CUDA devices: " << cuda_device_count() << "\n"
              << "operators:    softmax_attention, stick_breaking_attention, entmax_attention "
                 "(any alpha > 1), sieve_attention (exact | bound filter), threshold_attention "
                 "(TRA, TDA), screening_attention (Multiscreen), gsa_select_keys and "
                 "gsa_sparse_attention (GSA); forward and backward\n"
              << "decoding:     split-KV kernels for softmax and stick-breaking (CUDA: fp16 / bf16 / "
                 "fp32, D and Dv multiples of 8 up to 256) behind the forward calls with <= 8 "
                 "queries per sequence, and paged caches (winnow::decode, torch.ops.winnow."
                 "paged_decode)\n"
              << "fused CUDA:   softmax, stick-breaking, entmax, Sieve, TRA / TDA (bf16 / fp16, "
                 "D = Dv = 64 or 128; stick-breaking and Sieve also 16 or 32), screening (bf16 / "
                 "fp16, d_K 16 / 32 / 64, d_V 64 / 128); everything else on the simple path\n";
#ifdef WINNOW_WITH_MODELS
    for (const auto& [label, value] : train::runtime_report()) {
      std::cout << label << ":" << std::string(label.size() < 13 ? 13 - label.size() : 1, ' ')
                << value << "\n";
    }
    std::cout << "data-parallel: "
              << (train::collective_backends() != "none"
                      ? "c10d " + train::collective_backends() +
                            " (winnow train/study --gpus N / --processes N, or torchrun's variables)"
                      : std::string("not in this build (its LibTorch has neither the NCCL nor the gloo process group)"))
              << "\n";
    std::cout << "\nattention layers (model.attention.kind):\n";
    for (const nn::Mechanism& m : nn::mechanisms()) {
      std::cout << "  " << m.name << ": " << m.summary << "\n"
                << "      positions: " << config::join(m.positions) << " (default "
                << m.positions.front() << "); own keys: "
                << (m.option_keys.empty() ? std::string("none") : config::join(m.option_keys))
                << "\n      fused path: " << m.fused_operator << "\n";
    }
    std::cout << "  Multiscreen's screening is an architecture of its own (model.architecture "
                 "multiscreen)\n"
              << "\ntraining: winnow train --config FILE [--set key=value ...] (configs/ has "
                 "examples; --print-config shows every key)\n";
#else
    std::cout << "models:       not built (LibTorch was not found)\n";
#endif
  });
}

}  // namespace winnow::apps
