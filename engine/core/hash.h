// Small non-cryptographic hashes: FNV-1a for checksums and fingerprints, SplitMix64 for
// counter-based random numbers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace cputrain {

constexpr uint64_t kFnvOffset = 0xcbf29ce484222325ull;

inline uint64_t fnv1a(const void* data, size_t n, uint64_t h = kFnvOffset) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) {
    h ^= bytes[i];
    h *= 0x100000001b3ull;
  }
  return h;
}

inline uint64_t fnv1a(std::string_view text, uint64_t h = kFnvOffset) {
  return fnv1a(text.data(), text.size(), h);
}

inline uint64_t fnv1a_u64(uint64_t value, uint64_t h = kFnvOffset) {
  return fnv1a(&value, sizeof(value), h);
}

// The SplitMix64 finaliser (Steele, Lea, Flood 2014): a bijective mix of 64 bits.
inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace cputrain
