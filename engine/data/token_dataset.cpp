#include "engine/data/token_dataset.h"

#include <fcntl.h>
#include <omp.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <utility>

#include "engine/core/error.h"
#include "engine/io/atomic_file.h"

namespace cputrain {
namespace {

constexpr char kMagic[8] = {'C', 'T', 'T', 'O', 'K', '0', '0', '1'};

// The file "CTTOK001": this header, then n_tokens int32 (the n_train training tokens first),
// in the machine's byte order (little-endian on x86-64).
struct Header {
  char magic[8];
  uint64_t n_tokens;
  uint64_t n_train;
  uint64_t fingerprint;
};
static_assert(sizeof(Header) == 32);

}  // namespace

TokenDataset TokenDataset::build(const std::vector<std::string>& documents,
                                 const Tokenizer& tokenizer, const std::string& cache_path,
                                 uint64_t fingerprint,
                                 const std::function<void(int64_t, int64_t)>& progress) {
  const int64_t n = static_cast<int64_t>(documents.size());
  std::vector<std::vector<int32_t>> encoded(documents.size());
  std::atomic<int64_t> done{0};
  int64_t next_report = 256;  // read and written by thread 0 only
#pragma omp parallel for schedule(dynamic, 64)
  for (int64_t i = 0; i < n; ++i) {
    encoded[i] = tokenizer.encode(documents[i]);
    const int64_t d = done.fetch_add(1, std::memory_order_relaxed) + 1;
    if (progress && omp_get_thread_num() == 0 && d >= next_report) {
      progress(d, n);
      next_report = d + 256;
    }
  }
  if (progress) progress(n, n);
  auto is_val = [n](int64_t i) { return n < 10 ? n >= 2 && i == n - 1 : i % 10 == 9; };

  Header h{};
  std::memcpy(h.magic, kMagic, sizeof(kMagic));
  h.fingerprint = fingerprint;
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t len = encoded[i].size() + 1;  // BOS
    h.n_tokens += len;
    if (!is_val(i)) h.n_train += len;
  }
  std::string bytes(sizeof(Header) + h.n_tokens * sizeof(int32_t), '\0');
  std::memcpy(bytes.data(), &h, sizeof(h));
  char* out = bytes.data() + sizeof(Header);
  const int32_t bos = tokenizer.bos_id();
  for (bool val : {false, true}) {
    for (int64_t i = 0; i < n; ++i) {
      if (is_val(i) != val) continue;
      std::memcpy(out, &bos, sizeof(bos));
      out += sizeof(bos);
      std::memcpy(out, encoded[i].data(), encoded[i].size() * sizeof(int32_t));
      out += encoded[i].size() * sizeof(int32_t);
    }
  }
  write_file_atomic(cache_path, bytes.data(), bytes.size());
  return open(cache_path);
}

TokenDataset TokenDataset::open(const std::string& cache_path) {
  const int fd = ::open(cache_path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw UserError(cache_path + ": cannot be opened (" + std::strerror(errno) + ")");
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    throw UserError(cache_path + ": cannot be read (" + std::strerror(err) + ")");
  }
  const size_t size = static_cast<size_t>(st.st_size);
  if (size < sizeof(Header)) {
    ::close(fd);
    throw UserError(cache_path + ": not a token cache (file too short)");
  }
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  const int map_err = errno;
  ::close(fd);
  if (map == MAP_FAILED)
    throw UserError(cache_path + ": cannot be mapped (" + std::strerror(map_err) + ")");
  TokenDataset d;  // unmaps on the throws below
  d.map_ = map;
  d.map_bytes_ = size;
  Header h;
  std::memcpy(&h, map, sizeof(h));
  if (std::memcmp(h.magic, kMagic, sizeof(kMagic)) != 0)
    throw UserError(cache_path + ": not a token cache (no CTTOK001 magic)");
  const size_t room = (size - sizeof(Header)) / sizeof(int32_t);
  if (h.n_tokens != room || size != sizeof(Header) + room * sizeof(int32_t) ||
      h.n_train > h.n_tokens)
    throw UserError(cache_path + ": token cache is truncated or its header is corrupt (" +
                    std::to_string(size) + " bytes for " + std::to_string(h.n_tokens) + " tokens)");
  d.tokens_ = reinterpret_cast<const int32_t*>(static_cast<const char*>(map) + sizeof(Header));
  d.total_ = h.n_tokens;
  d.train_ = h.n_train;
  d.fingerprint_ = h.fingerprint;
  return d;
}

TokenDataset::TokenDataset(TokenDataset&& other) noexcept {
  *this = std::move(other);
}

TokenDataset& TokenDataset::operator=(TokenDataset&& other) noexcept {
  if (this != &other) {
    unmap();
    map_ = std::exchange(other.map_, nullptr);
    map_bytes_ = std::exchange(other.map_bytes_, 0);
    tokens_ = std::exchange(other.tokens_, nullptr);
    total_ = std::exchange(other.total_, 0);
    train_ = std::exchange(other.train_, 0);
    fingerprint_ = std::exchange(other.fingerprint_, 0);
  }
  return *this;
}

TokenDataset::~TokenDataset() {
  unmap();
}

void TokenDataset::unmap() {
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
  map_ = nullptr;
}

}  // namespace cputrain
