#include "train/files.h"

#include <ftw.h>
#include <sys/stat.h>

#include <cstdio>

namespace winnow::train {
namespace {

int remove_entry(const char* path, const struct stat*, int, struct FTW*) {
  return std::remove(path) == 0 ? 0 : -1;
}

}  // namespace

bool remove_tree(const std::filesystem::path& path) noexcept {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) return true;  // nothing there
  // Depth first (children before their folder), without following symbolic links.
  return ::nftw(path.c_str(), remove_entry, 32, FTW_DEPTH | FTW_PHYS) == 0;
}

}  // namespace winnow::train
