#include "kvforge/block_store.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "kvforge/errors.hpp"

namespace kvforge {

namespace {

constexpr int64_t kAlign = 4096;  // direct I/O moves whole, aligned sectors
constexpr char kRecordMagic[8] = {'K', 'V', 'F', 'B', 'L', 'K', '0', '2'};
constexpr char kFileMagic[8] = {'K', 'V', 'F', 'D', 'I', 'S', 'K', '2'};

// The file: this header, padded to kAlign bytes, then the records. The identity's text is kept whole
// so that a refusal can say what the file holds; its hash goes into every record.
struct FileHeader {
  char magic[8];
  uint64_t identity_hash;
  uint64_t generation;  // records of an older generation are misses (invalidate_all)
  int64_t record_bytes;
  int32_t identity_bytes;
  int32_t unused;
  uint64_t checksum;  // over the whole header block, this field read as 0
};
constexpr int64_t kMaxIdentity = kAlign - int64_t(sizeof(FileHeader));

// A record: this header, then the tokens (int32 each), then the packed bytes, then zeros to the
// record's size. `checksum` covers the whole record with the checksum field read as 0.
struct Header {
  char magic[8];
  uint64_t key, parent, salt;
  int64_t packed_bytes;
  int32_t tokens, priority;
  uint64_t checksum;
  uint64_t identity_hash, generation;
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

// An open, locked file descriptor that closes itself (and so unlocks) however the constructor ends.
struct LockedFile {
  int fd = -1;
  explicit LockedFile(const std::string& path) {
    fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_DIRECT, 0644);
    if (fd < 0 && errno == EINVAL) fd = ::open(path.c_str(), O_RDWR | O_CREAT, 0644);  // no direct I/O here (tmpfs)
    if (fd < 0) throw BackendError("disk tier: cannot open " + path + ": " + std::strerror(errno));
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int why = errno;
      ::close(fd);
      if (why == EWOULDBLOCK)
        throw StateError("options.disk_path", path + " is in use by another SequenceManager (this process or another): "
                                                     "a disk tier's file has one owner at a time; give each its own path");
      throw BackendError("disk tier: cannot lock " + path + ": " + std::strerror(why));
    }
  }
  ~LockedFile() {
    if (fd >= 0) ::close(fd);
  }
};

class FileBlockStore final : public BlockStore {
 public:
  FileBlockStore(const std::string& path, int64_t records, int64_t packed_bytes, int32_t block_tokens,
                 const std::string& identity)
      : path_(path), file_(path), records_(records), packed_(packed_bytes), tokens_(block_tokens),
        record_(file_store_record_bytes(packed_bytes, block_tokens)), identity_hash_(checksum_of(
            reinterpret_cast<const unsigned char*>(identity.data()), int64_t(identity.size()))),
        buffer_(record_), read_buffer_(record_), header_(kAlign) {
    if (int64_t(identity.size()) > kMaxIdentity)
      throw ArgumentError("identity", "longer than " + std::to_string(kMaxIdentity) + " bytes");
    struct stat st{};
    if (::fstat(file_.fd, &st) != 0) throw BackendError("disk tier: cannot stat " + path + ": " + std::strerror(errno));
    if (st.st_size == 0) {
      generation_ = 1;
      write_header(identity);
    } else {
      adopt_header(identity, int64_t(st.st_size));
    }
    const int64_t size = file_store_record_offset(records_, packed_, tokens_);
    if (st.st_size < size && ::ftruncate(file_.fd, size) != 0)
      throw BackendError("disk tier: cannot size " + path + " to " + std::to_string(size) + " bytes: " + std::strerror(errno));
  }

  int64_t capacity() const override { return records_; }

  void write(int64_t slot, const StoredBlock& b, const void* packed) override {
    std::memset(buffer_.p, 0, size_t(record_));
    Header h{};
    std::memcpy(h.magic, kRecordMagic, sizeof kRecordMagic);
    h.key = b.key, h.parent = b.parent, h.salt = b.salt;
    h.packed_bytes = packed_;
    h.tokens = int32_t(b.tokens.size()), h.priority = b.priority;
    h.identity_hash = identity_hash_, h.generation = generation_;
    std::memcpy(buffer_.p, &h, sizeof h);
    std::memcpy(buffer_.p + sizeof h, b.tokens.data(), b.tokens.size() * sizeof(int32_t));
    std::memcpy(buffer_.p + sizeof h + b.tokens.size() * sizeof(int32_t), packed, size_t(packed_));
    h.checksum = checksum_of(buffer_.p, record_);
    std::memcpy(buffer_.p, &h, sizeof h);
    const ssize_t wrote = ::pwrite(file_.fd, buffer_.p, size_t(record_), offset(slot));
    if (wrote != record_)
      throw BackendError("disk tier: writing a record of " + path_ + " failed: " +
                         (wrote < 0 ? std::strerror(errno) : "wrote " + std::to_string(wrote) + " bytes"));
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

  void invalidate_all() override {
    std::lock_guard<std::mutex> lock(read_mutex_);
    FileHeader h;
    std::memcpy(&h, header_.p, sizeof h);
    ++generation_;
    h.generation = generation_;
    h.checksum = 0;
    std::memcpy(header_.p, &h, sizeof h);
    h.checksum = checksum_of(header_.p, kAlign);
    std::memcpy(header_.p, &h, sizeof h);
    if (::pwrite(file_.fd, header_.p, size_t(kAlign), 0) != kAlign || ::fdatasync(file_.fd) != 0)
      throw BackendError("disk tier: clearing " + path_ + " failed (" + std::strerror(errno) +
                         "): its records may be served again by a later process; delete the file");
  }

 private:
  int64_t offset(int64_t slot) const { return kAlign + slot * record_; }

  void write_header(const std::string& identity) {
    std::memset(header_.p, 0, size_t(kAlign));
    FileHeader h{};
    std::memcpy(h.magic, kFileMagic, sizeof kFileMagic);
    h.identity_hash = identity_hash_, h.generation = generation_, h.record_bytes = record_;
    h.identity_bytes = int32_t(identity.size());
    std::memcpy(header_.p, &h, sizeof h);
    std::memcpy(header_.p + sizeof h, identity.data(), identity.size());
    h.checksum = checksum_of(header_.p, kAlign);
    std::memcpy(header_.p, &h, sizeof h);
    if (::pwrite(file_.fd, header_.p, size_t(kAlign), 0) != kAlign || ::fdatasync(file_.fd) != 0)
      throw BackendError("disk tier: cannot write " + path_ + "'s header: " + std::strerror(errno));
  }

  // An existing file: its header must check out and name this store's identity, else the file is
  // refused as it is, untouched.
  void adopt_header(const std::string& identity, int64_t size) {
    const auto refuse = [&](const std::string& why) {
      throw ArgumentError("options.disk_path", path_ + " " + why + ": nothing in it was changed; give another path, or "
                                                                   "delete the file to start an empty disk tier there");
    };
    if (size < kAlign || ::pread(file_.fd, header_.p, size_t(kAlign), 0) != kAlign)
      refuse("is not a kvforge disk tier (shorter than its header)");
    FileHeader h;
    std::memcpy(&h, header_.p, sizeof h);
    if (std::memcmp(h.magic, kFileMagic, sizeof kFileMagic) != 0)
      refuse("is not a disk tier of this kvforge (another file, or an older kvforge's disk tier without identities)");
    const uint64_t stored = h.checksum;
    FileHeader zeroed = h;
    zeroed.checksum = 0;
    std::memcpy(header_.p, &zeroed, sizeof zeroed);
    const bool intact = checksum_of(header_.p, kAlign) == stored;
    std::memcpy(header_.p, &h, sizeof h);
    if (!intact || h.identity_bytes < 0 || h.identity_bytes > kMaxIdentity) refuse("has a header that does not check out");
    const std::string theirs(reinterpret_cast<const char*>(header_.p + sizeof h), size_t(h.identity_bytes));
    if (theirs != identity || h.record_bytes != record_)  // the text decides; its hash is what records carry
      refuse("holds the blocks of {" + theirs + "}, not of this manager's {" + identity + "}");
    generation_ = h.generation;
  }

  // Reads a record into `buffer` and checks it whole; false for anything short of a record this store
  // wrote intact in its current generation (one a write is replacing at the same time included).
  bool load(int64_t slot, StoredBlock& b, unsigned char* buffer) const {
    if (::pread(file_.fd, buffer, size_t(record_), offset(slot)) != record_) return false;
    Header h;
    std::memcpy(&h, buffer, sizeof h);
    if (std::memcmp(h.magic, kRecordMagic, sizeof kRecordMagic) != 0 || h.packed_bytes != packed_ || h.tokens != tokens_ ||
        h.identity_hash != identity_hash_ || h.generation != generation_)
      return false;
    const uint64_t stored = h.checksum;
    h.checksum = 0;
    std::memcpy(buffer, &h, sizeof h);
    if (checksum_of(buffer, record_) != stored) return false;
    b.key = h.key, b.parent = h.parent, b.salt = h.salt, b.priority = h.priority;
    b.tokens.resize(size_t(h.tokens));
    std::memcpy(b.tokens.data(), buffer + sizeof h, b.tokens.size() * sizeof(int32_t));
    return true;
  }

  std::string path_;
  LockedFile file_;
  int64_t records_, packed_;
  int32_t tokens_;
  int64_t record_;
  uint64_t identity_hash_;
  uint64_t generation_ = 1;
  Aligned buffer_;       // write's
  Aligned read_buffer_;  // read's and scan's, which may run on another thread than write
  Aligned header_;       // the file's header block, as last read or written
  std::mutex read_mutex_;
};

}  // namespace

int64_t file_store_record_bytes(int64_t packed_bytes, int32_t block_tokens) {
  const int64_t bytes = int64_t(sizeof(Header)) + int64_t(block_tokens) * 4 + packed_bytes;
  return (bytes + kAlign - 1) / kAlign * kAlign;
}

int64_t file_store_record_offset(int64_t slot, int64_t packed_bytes, int32_t block_tokens) {
  return kAlign + slot * file_store_record_bytes(packed_bytes, block_tokens);
}

std::unique_ptr<BlockStore> open_file_store(const std::string& path, int64_t records, int64_t packed_bytes,
                                            int32_t block_tokens, const std::string& identity) {
  if (records < 1) throw OutOfRangeError("disk_blocks", records, 1, INT32_MAX);
  return std::make_unique<FileBlockStore>(path, records, packed_bytes, block_tokens, identity);
}

}  // namespace kvforge
