// Language modeling on a byte-level corpus (tools/prepare_corpus.py): next-byte prediction on
// windows drawn uniformly from the memory-mapped split files. Training draws from train.bin,
// evaluation from val.bin. A batch is a pure function of its seed, as for every task, so a
// resumed run sees exactly the windows it would have seen, and no state needs saving.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "tasks/task.h"
#include "winnow/error.h"

namespace winnow::tasks {
namespace {

// A read-only file mapped into memory for the task's lifetime: the OS pages in the windows a
// batch touches, so a corpus of any size costs no load time and no copy.
class MappedFile {
 public:
  explicit MappedFile(const std::string& path) : path_(path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      throw Error(ErrorKind::invalid_argument,
                  "task.corpus.dir: cannot open " + path + " (" + std::strerror(errno) +
                      "); `make corpus` builds data/corpus (tools/prepare_corpus.py)");
    }
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      const int err = errno;
      ::close(fd);
      throw Error(ErrorKind::runtime, "task.corpus.dir: cannot stat " + path + " (" + std::strerror(err) + ")");
    }
    size_ = static_cast<std::int64_t>(st.st_size);
    if (size_ > 0) {
      void* at = ::mmap(nullptr, static_cast<std::size_t>(size_), PROT_READ, MAP_PRIVATE, fd, 0);
      if (at == MAP_FAILED) {
        const int err = errno;
        ::close(fd);
        throw Error(ErrorKind::runtime, "task.corpus.dir: cannot map " + path + " (" + std::strerror(err) + ")");
      }
      data_ = static_cast<const std::uint8_t*>(at);
    }
    ::close(fd);
  }
  ~MappedFile() {
    if (data_ != nullptr) ::munmap(const_cast<std::uint8_t*>(data_), static_cast<std::size_t>(size_));
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::uint8_t* data() const { return data_; }
  std::int64_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  const std::uint8_t* data_ = nullptr;
  std::int64_t size_ = 0;
};

class Corpus final : public Task {
 public:
  explicit Corpus(const CorpusConfig& c)
      : train_(c.dir + "/train.bin"), val_(c.dir + "/val.bin") {}

  std::int64_t vocab_size() const override { return 256; }

  Batch sample(std::int64_t batch, std::int64_t length, std::uint64_t seed) const override {
    return windows(val_, batch, length, seed);
  }
  Batch sample_training(std::int64_t batch, std::int64_t length, std::uint64_t seed) const override {
    return windows(train_, batch, length, seed);
  }

  // Bytes as text: printable ASCII as is, newlines and tabs escaped, the document separator as
  // "<|doc|>", other bytes as \xNN.
  std::string render(const std::vector<std::int64_t>& tokens) const override {
    static const char* hex = "0123456789abcdef";
    std::string out;
    for (std::int64_t t : tokens) {
      if (t == 0) {
        out += "<|doc|>";
      } else if (t == '\n') {
        out += "\\n";
      } else if (t == '\t') {
        out += "\\t";
      } else if (t >= 32 && t < 127) {
        out += static_cast<char>(t);
      } else {
        out += "\\x";
        out += hex[(t >> 4) & 15];
        out += hex[t & 15];
      }
    }
    return out;
  }

 private:
  // Row b: the bytes at [s, s + length) as inputs and [s + 1, s + length + 1) as targets, s
  // uniform over the file's possible starts; every position counts.
  static Batch windows(const MappedFile& file, std::int64_t batch, std::int64_t length,
                       std::uint64_t seed) {
    if (length < 1) {
      throw Error(ErrorKind::invalid_argument, "length: expected >= 1, got " + std::to_string(length));
    }
    if (file.size() < length + 1) {
      throw Error(ErrorKind::invalid_argument,
                  "length: expected at most " + std::to_string(std::max<std::int64_t>(file.size() - 1, 0)) +
                      " tokens, the size of " + file.path() + " less one, got " + std::to_string(length));
    }
    Rng rng(seed);
    const auto starts = static_cast<std::uint64_t>(file.size() - length);
    torch::Tensor inputs = torch::empty({batch, length}, torch::kInt64);
    torch::Tensor targets = torch::empty({batch, length}, torch::kInt64);
    auto in = inputs.accessor<std::int64_t, 2>();
    auto out = targets.accessor<std::int64_t, 2>();
    for (std::int64_t b = 0; b < batch; ++b) {
      const std::uint8_t* w = file.data() + rng.below(starts);
      for (std::int64_t t = 0; t < length; ++t) {
        in[b][t] = w[t];
        out[b][t] = w[t + 1];
      }
    }
    return {inputs, targets, torch::ones({batch, length})};
  }

  MappedFile train_, val_;
};

}  // namespace

std::unique_ptr<Task> make_corpus(const CorpusConfig& config) {
  return std::make_unique<Corpus>(config);
}

}  // namespace winnow::tasks
