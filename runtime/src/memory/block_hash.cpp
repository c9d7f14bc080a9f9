#include "kvforge/block_hash.hpp"

#include <cstring>
#include <vector>

namespace kvforge {

namespace {

// FIPS 180-4, section 4.2.2: the first 32 bits of the fractional parts of the cube roots of the first
// 64 primes.
constexpr uint32_t kRound[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

void compress(uint32_t (&h)[8], const uint8_t* block) {
  uint32_t w[64];
  for (int t = 0; t < 16; ++t)
    w[t] = uint32_t(block[4 * t]) << 24 | uint32_t(block[4 * t + 1]) << 16 | uint32_t(block[4 * t + 2]) << 8 |
           uint32_t(block[4 * t + 3]);
  for (int t = 16; t < 64; ++t) {
    const uint32_t s0 = rotr(w[t - 15], 7) ^ rotr(w[t - 15], 18) ^ (w[t - 15] >> 3);
    const uint32_t s1 = rotr(w[t - 2], 17) ^ rotr(w[t - 2], 19) ^ (w[t - 2] >> 10);
    w[t] = w[t - 16] + s0 + w[t - 7] + s1;
  }
  uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], k = h[7];
  for (int t = 0; t < 64; ++t) {
    const uint32_t t1 = k + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + kRound[t] + w[t];
    const uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
    k = g, g = f, f = e, e = d + t1, d = c, c = b, b = a, a = t1 + t2;
  }
  h[0] += a, h[1] += b, h[2] += c, h[3] += d, h[4] += e, h[5] += f, h[6] += g, h[7] += k;
}

// Canonical CBOR (RFC 8949, section 4.2.1: the shortest head) of the few items a block hash holds.
void cbor_head(std::vector<uint8_t>& out, int major, uint64_t value) {
  const uint8_t type = uint8_t(major << 5);
  int bytes = 0;
  if (value < 24) {
    out.push_back(uint8_t(type | value));
    return;
  }
  if (value <= 0xff) out.push_back(type | 24), bytes = 1;
  else if (value <= 0xffff) out.push_back(type | 25), bytes = 2;
  else if (value <= 0xffffffffULL) out.push_back(type | 26), bytes = 4;
  else out.push_back(type | 27), bytes = 8;
  for (int i = bytes; i-- > 0;) out.push_back(uint8_t(value >> (8 * i)));
}
void cbor_int(std::vector<uint8_t>& out, int64_t v) {
  if (v >= 0) cbor_head(out, 0, uint64_t(v)); else cbor_head(out, 1, uint64_t(-1 - v));
}
void cbor_bytes(std::vector<uint8_t>& out, int major, const uint8_t* data, size_t size) {
  cbor_head(out, major, size);
  out.insert(out.end(), data, data + size);
}

// One step of the kvforge key, on unsigned 64-bit integers modulo 2^64: a running combination, then
// splitmix64's finalizer, cheap and well spread.
uint64_t mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
  h ^= h >> 30;
  h *= 0xbf58476d1ce4e5b9ULL;
  h ^= h >> 27;
  h *= 0x94d049bb133111ebULL;
  h ^= h >> 31;
  return h;
}

}  // namespace

Sha256Digest sha256(const uint8_t* data, size_t size) {
  uint32_t h[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  size_t done = 0;
  for (; size - done >= 64; done += 64) compress(h, data + done);
  // The padding: a 1 bit, zeros, and the message's length in bits as 64 bits, to a whole block.
  uint8_t tail[128] = {};
  const size_t rest = size - done;
  std::memcpy(tail, data + done, rest);
  tail[rest] = 0x80;
  const size_t blocks = rest + 9 <= 64 ? 1 : 2;
  const uint64_t bits = uint64_t(size) * 8;
  for (int i = 0; i < 8; ++i) tail[64 * blocks - 1 - i] = uint8_t(bits >> (8 * i));
  for (size_t b = 0; b < blocks; ++b) compress(h, tail + 64 * b);
  Sha256Digest out;
  for (int i = 0; i < 32; ++i) out[size_t(i)] = uint8_t(h[i / 4] >> (24 - 8 * (i % 4)));
  return out;
}

BlockHasher::BlockHasher(BlockHashScheme scheme, const std::string& seed) : scheme_(scheme) {
  std::vector<uint8_t> text;
  cbor_bytes(text, 3, reinterpret_cast<const uint8_t*>(seed.data()), seed.size());
  none_hash_ = sha256(text.data(), text.size());
}

BlockChain BlockHasher::next(const BlockChain& parent, uint64_t salt, const int32_t* tokens, int32_t n) const {
  BlockChain out;
  if (scheme_ == BlockHashScheme::kvforge) {
    uint64_t h = mix(parent.key, salt);
    for (int32_t i = 0; i < n; ++i) h = mix(h, uint64_t(uint32_t(tokens[i])));
    out.key = h;
    return out;
  }
  // [parent digest, [token ids], null or [salt]]
  std::vector<uint8_t> item;
  item.reserve(48 + 5 * size_t(n));
  cbor_head(item, 4, 3);
  const Sha256Digest& chained = parent.key == 0 ? none_hash_ : parent.digest;
  cbor_bytes(item, 2, chained.data(), chained.size());
  cbor_head(item, 4, uint64_t(n));
  for (int32_t i = 0; i < n; ++i) cbor_int(item, tokens[i]);
  if (salt == 0) {
    item.push_back(0xf6);  // null
  } else {
    cbor_head(item, 4, 1);
    cbor_head(item, 0, salt);
  }
  out.digest = sha256(item.data(), item.size());
  for (int i = 24; i < 32; ++i) out.key = out.key << 8 | out.digest[size_t(i)];
  return out;
}

}  // namespace kvforge
