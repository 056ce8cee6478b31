// Data-parallel runs that winnow starts itself: `winnow train|study --gpus N | --processes N`
// start N copies of the same call as the ranks of one run, with torchrun's variables.
#include <algorithm>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <torch/cuda.h>

#include "commands.h"
#include "winnow/error.h"

extern char** environ;

namespace winnow::apps {
namespace {

// A TCP port that was free a moment ago, for the ranks' store.
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    if (fd >= 0) ::close(fd);
    throw Error(ErrorKind::runtime, "winnow: cannot find a free port for the data-parallel ranks to meet on");
  }
  ::close(fd);
  return ntohs(addr.sin_port);
}

}  // namespace

void launch_ranks(const std::string& command, int count, const std::vector<std::string>& args) {
  std::vector<std::string> argv_storage = {"/proc/self/exe", command};
  argv_storage.insert(argv_storage.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : argv_storage) argv.push_back(a.data());
  argv.push_back(nullptr);
  const std::string port = std::to_string(free_port());
  // N ranks each with a thread per core would oversubscribe the host N times over (torchrun
  // sets one thread); a share of the cores each keeps the CPU path's parallelism.
  const bool threads_set = std::getenv("OMP_NUM_THREADS") != nullptr;
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  const std::string threads = std::to_string(std::max(1u, cores / static_cast<unsigned>(count)));
  std::vector<pid_t> pids;
  for (int rank = 0; rank < count; ++rank) {
    std::vector<std::string> env = {"WORLD_SIZE=" + std::to_string(count), "RANK=" + std::to_string(rank),
                                    "LOCAL_RANK=" + std::to_string(rank), "MASTER_ADDR=127.0.0.1",
                                    "MASTER_PORT=" + port, "NCCL_NVLS_ENABLE=0"};
    if (!threads_set) env.push_back("OMP_NUM_THREADS=" + threads);
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string var(*e);
      const std::string name = var.substr(0, var.find('='));
      if (name != "WORLD_SIZE" && name != "RANK" && name != "LOCAL_RANK" && name != "MASTER_ADDR" &&
          name != "MASTER_PORT" && name != "NCCL_NVLS_ENABLE") {
        env.push_back(var);
      }
    }
    std::vector<char*> envp;
    for (auto& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    pid_t pid = -1;
    if (posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, argv.data(), envp.data()) != 0) {
      for (pid_t p : pids) ::kill(p, SIGTERM);
      throw Error(ErrorKind::runtime, "winnow " + command + ": cannot start rank " + std::to_string(rank));
    }
    pids.push_back(pid);
  }
  std::string failure;
  for (std::size_t left = pids.size(); left > 0; --left) {
    int status = 0;
    const pid_t done = ::waitpid(-1, &status, 0);
    const auto it = std::find(pids.begin(), pids.end(), done);
    if (it == pids.end()) continue;
    const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    if (!ok && failure.empty()) {
      failure = "rank " + std::to_string(it - pids.begin()) +
                (WIFEXITED(status) ? " exited with status " + std::to_string(WEXITSTATUS(status))
                                   : " was killed by signal " + std::to_string(WTERMSIG(status)));
      for (pid_t p : pids) {
        if (p != done) ::kill(p, SIGTERM);
      }
    }
    *it = -1;
  }
  if (!failure.empty()) {
    throw Error(ErrorKind::runtime, "winnow " + command + ": " + failure + "; the others were stopped");
  }
}

void add_rank_options(CLI::App& cmd, int& gpus, int& processes) {
  cmd.add_option("--gpus", gpus,
                 "data-parallel over this many GPUs of this machine: starts one process per GPU "
                 "itself (as torchrun would)")
      ->check(CLI::PositiveNumber);
  cmd.add_option("--processes", processes,
                 "data-parallel over this many processes on the device the config names (on the "
                 "CPU: to try data parallelism without GPUs)")
      ->check(CLI::PositiveNumber);
}

int rank_count(const std::string& command, int gpus, int processes, const std::string& device) {
  if (gpus <= 0 && processes <= 0) return 0;
  if (gpus > 0 && processes > 0) {
    throw Error(ErrorKind::invalid_argument,
                command + ": arguments '--gpus' and '--processes': expected one of them, got both");
  }
  if (std::getenv("WORLD_SIZE") != nullptr) {
    throw Error(ErrorKind::invalid_argument,
                command + ": argument '--gpus' / '--processes': expected no WORLD_SIZE in the environment "
                          "(a launcher such as torchrun already started the ranks), got WORLD_SIZE=" +
                    std::string(std::getenv("WORLD_SIZE")));
  }
  if (gpus > 0) {
    const auto visible = static_cast<int>(torch::cuda::device_count());
    if (gpus > visible) {
      throw Error(ErrorKind::unsupported, command + ": argument '--gpus': expected at most " +
                                              std::to_string(visible) + " (the GPUs visible), got " +
                                              std::to_string(gpus));
    }
    if (device != "auto" && device.rfind("cuda", 0) != 0) {
      throw Error(ErrorKind::invalid_argument,
                  command + ": argument '--gpus': expected device auto or cuda in the config, got device " + device);
    }
  }
  return std::max(gpus, processes);
}

}  // namespace winnow::apps
