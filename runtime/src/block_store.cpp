#include "kvforge/block_store.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "kvforge/errors.hpp"

namespace kvforge {

namespace {

constexpr int64_t kAlign = 4096;            // direct I/O moves whole, aligned sectors
constexpr char kMagic[8] = {'K', 'V', 'F', 'B', 'L', 'K', '0', '1'};

// A record: this header, then the tokens (int32 each), then the packed bytes, then zeros to the
// record's size. `checksum` covers the whole record with the checksum field read as 0.
struct Header {
  char magic[8];
  uint64_t key, parent, salt;
  int64_t packed_bytes;
  int32_t tokens, priority;
  uint64_t checksum;
  uint64_t reserved[2];
};
static_assert(sizeof(Header) == 72, "the record header's layout is documented");

// 64-bit words folded with splitmix64's finalizer (the block hash's mix): fast, and any flipped bit
// changes it.
uint64_t checksum_of(const unsigned char* p, int64_t bytes) {
  uint64_t h = 0x6b76666f72676521ULL;
  for (int64_t i = 0; i < bytes; i += 8) {
    uint64_t w = 0;
    std::memcpy(&w, p + i, size_t(bytes - i < 8 ? bytes - i : 8));
    h ^= w + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
    h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ULL;
    h = (h ^ (h >> 27)) * 0x94d049bb133111ebULL;
    h ^= h >> 31;
  }
  return h;
}

struct Aligned {
  unsigned char* p = nullptr;
  explicit Aligned(int64_t bytes) : p(static_cast<unsigned char*>(std::aligned_alloc(kAlign, size_t(bytes)))) {
    if (!p) throw BackendError("disk tier: cannot allocate an I/O buffer of " + std::to_string(bytes) + " bytes");
  }
  ~Aligned() { std::free(p); }
};

class FileBlockStore final : public BlockStore {
 public:
  FileBlockStore(const std::string& path, int64_t records, int64_t packed_bytes, int32_t block_tokens)
      : records_(records), packed_(packed_bytes), tokens_(block_tokens),
        record_(file_store_record_bytes(packed_bytes, block_tokens)), buffer_(record_), read_buffer_(record_) {
    fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_DIRECT, 0644);
    if (fd_ < 0 && errno == EINVAL) fd_ = ::open(path.c_str(), O_RDWR | O_CREAT, 0644);  // no direct I/O here (tmpfs)
    if (fd_ < 0) throw BackendError("disk tier: cannot open " + path + ": " + std::strerror(errno));
    struct stat st{};
    if (::fstat(fd_, &st) != 0 || (st.st_size < records_ * record_ && ::ftruncate(fd_, records_ * record_) != 0)) {
      const std::string why = std::strerror(errno);
      ::close(fd_);
      throw BackendError("disk tier: cannot size " + path + " to " + std::to_string(records_ * record_) + " bytes: " + why);
    }
  }
  ~FileBlockStore() override { ::close(fd_); }

  int64_t capacity() const override { return records_; }

  void write(int64_t slot, const StoredBlock& b, const void* packed) override {
    std::memset(buffer_.p, 0, size_t(record_));
    Header h{};
    std::memcpy(h.magic, kMagic, sizeof kMagic);
    h.key = b.key, h.parent = b.parent, h.salt = b.salt;
    h.packed_bytes = packed_;
    h.tokens = int32_t(b.tokens.size()), h.priority = b.priority;
    std::memcpy(buffer_.p, &h, sizeof h);
    std::memcpy(buffer_.p + sizeof h, b.tokens.data(), b.tokens.size() * sizeof(int32_t));
    std::memcpy(buffer_.p + sizeof h + b.tokens.size() * sizeof(int32_t), packed, size_t(packed_));
    h.checksum = checksum_of(buffer_.p, record_);
    std::memcpy(buffer_.p, &h, sizeof h);
    if (::pwrite(fd_, buffer_.p, size_t(record_), slot * record_) != record_)
      throw BackendError(std::string("disk tier: write failed: ") + std::strerror(errno));
  }

  bool read(int64_t slot, uint64_t key, void* packed) override {
    std::lock_guard<std::mutex> lock(read_mutex_);
    StoredBlock b;
    if (!load(slot, b, read_buffer_.p) || b.key != key) return false;
    std::memcpy(packed, read_buffer_.p + sizeof(Header) + b.tokens.size() * sizeof(int32_t), size_t(packed_));
    return true;
  }

  void scan(const std::function<void(int64_t, const StoredBlock&)>& f) override {
    StoredBlock b;
    for (int64_t slot = 0; slot < records_; ++slot) {
      bool intact;
      {
        std::lock_guard<std::mutex> lock(read_mutex_);  // not across f, which may read
        intact = load(slot, b, read_buffer_.p);
      }
      if (intact) f(slot, b);
    }
  }

 private:
  // Reads a record into `buffer` and checks it whole; false for anything short of a record this store
  // wrote intact (one a write is replacing at the same time included).
  bool load(int64_t slot, StoredBlock& b, unsigned char* buffer) const {
    if (::pread(fd_, buffer, size_t(record_), slot * record_) != record_) return false;
    Header h;
    std::memcpy(&h, buffer, sizeof h);
    if (std::memcmp(h.magic, kMagic, sizeof kMagic) != 0 || h.packed_bytes != packed_ || h.tokens != tokens_) return false;
    const uint64_t stored = h.checksum;
    h.checksum = 0;
    std::memcpy(buffer, &h, sizeof h);
    if (checksum_of(buffer, record_) != stored) return false;
    b.key = h.key, b.parent = h.parent, b.salt = h.salt, b.priority = h.priority;
    b.tokens.resize(size_t(h.tokens));
    std::memcpy(b.tokens.data(), buffer + sizeof h, b.tokens.size() * sizeof(int32_t));
    return true;
  }

  int fd_ = -1;
  int64_t records_, packed_;
  int32_t tokens_;
  int64_t record_;
  Aligned buffer_;       // write's
  Aligned read_buffer_;  // read's and scan's, which may run on another thread than write
  std::mutex read_mutex_;
};

}  // namespace

int64_t file_store_record_bytes(int64_t packed_bytes, int32_t block_tokens) {
  const int64_t bytes = int64_t(sizeof(Header)) + int64_t(block_tokens) * 4 + packed_bytes;
  return (bytes + kAlign - 1) / kAlign * kAlign;
}

std::unique_ptr<BlockStore> open_file_store(const std::string& path, int64_t records, int64_t packed_bytes,
                                            int32_t block_tokens) {
  if (records < 1) throw OutOfRangeError("disk_blocks", records, 1, INT32_MAX);
  return std::make_unique<FileBlockStore>(path, records, packed_bytes, block_tokens);
}

}  // namespace kvforge
