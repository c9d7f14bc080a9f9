// The key of a full block of a prefix: it chains the key of the block before it, a salt and the
// block's token ids, so equal keys mean equal prefixes. Two constructions (docs/memory.md, "Block
// hashes", gives both byte for byte):
//   kvforge           a 64-bit mix, cheap; the default.
//   vllm_sha256_cbor  vLLM's: SHA-256 over the canonical CBOR of (parent's digest, token ids, extra
//                     keys), the chain starting at SHA-256 over the CBOR of a seed string. A block's key
//                     is the digest's low 64 bits, read big-endian: what vLLM's KV events carry with
//                     integer block hashes, so a router that hashes prompts vLLM's way finds
//                     kvforge's blocks.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace kvforge {

enum class BlockHashScheme : uint8_t { kvforge, vllm_sha256_cbor };

using Sha256Digest = std::array<uint8_t, 32>;
// SHA-256 (FIPS 180-4) of `size` bytes.
Sha256Digest sha256(const uint8_t* data, size_t size);

// Where a prefix's chain of blocks stands: after no block (key 0), or after the block keyed `key`.
struct BlockChain {
  uint64_t key = 0;
  Sha256Digest digest{};  // vllm_sha256_cbor only: the whole hash, which the next block chains
};

class BlockHasher {
 public:
  // seed: vllm_sha256_cbor's chain start, as vLLM's PYTHONHASHSEED (its default when that is unset).
  explicit BlockHasher(BlockHashScheme scheme = BlockHashScheme::kvforge, const std::string& seed = "vllm-none-hash");
  // The chain after one more full block of `n` tokens. A nonzero salt is mixed into every block: with
  // vllm_sha256_cbor as the extra keys (salt), an unsigned integer (vLLM's own extra keys, a LoRA
  // name or a cache salt, are strings, so only salt 0 matches vLLM).
  BlockChain next(const BlockChain& parent, uint64_t salt, const int32_t* tokens, int32_t n) const;
  BlockHashScheme scheme() const { return scheme_; }
  const Sha256Digest& none_hash() const { return none_hash_; }

 private:
  BlockHashScheme scheme_;
  Sha256Digest none_hash_{};
};

}  // namespace kvforge
