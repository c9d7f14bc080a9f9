// The CUDA bench's cases: presets of shapes, device buffers, and each case's capacity, targets and
// inputs.
// Part of kvforge_cuda_bench (cuda_bench.cu includes it once, in this order).
#pragma once

namespace {

// ---- cases -----------------------------------------------------------------------------------------

struct Shape {
  std::string op;  // append_decode, append_prefill, gather
  int64_t n;
};

struct Preset {
  std::vector<Shape> float_shapes, quantized_shapes;
};

const std::map<std::string, Preset>& presets() {
  static const std::map<std::string, Preset> p = {
      {"full",
       {{{"append_decode", 64}, {"append_decode", 256}, {"append_prefill", 512}, {"append_prefill", 2048},
         {"append_prefill", 8192}, {"gather", 1024}, {"gather", 8192}, {"gather", 32768}},
        {{"append_decode", 256}, {"append_prefill", 8192}, {"gather", 8192}}}},
      // tools/gpu-check's: one decode, one prefill and one gather per variant, a few minutes in all.
      {"short",
       {{{"append_decode", 64}, {"append_prefill", 8192}, {"gather", 32768}},
        {{"append_decode", 256}, {"append_prefill", 8192}, {"gather", 8192}}}},
  };
  return p;
}

bool lazy(const VariantDescriptor& d) { return d.update == UpdateMode::lazy; }
int layers_per_op(const VariantDescriptor& d, const Shape& s) { return s.op == "gather" ? 1 : layers_per_append(d); }

// Device memory that frees itself.
struct DeviceBuffer {
  void* data = nullptr;
  int64_t bytes = 0;
  DeviceBuffer() = default;
  explicit DeviceBuffer(int64_t n) : bytes(n) { check(cudaMalloc(&data, size_t(std::max<int64_t>(n, 16))), "cudaMalloc"); }
  DeviceBuffer(DeviceBuffer&& o) noexcept : data(o.data), bytes(o.bytes) { o.data = nullptr; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(data, o.data);
    std::swap(bytes, o.bytes);
    return *this;
  }
  ~DeviceBuffer() {
    if (data) cudaFree(data);
  }
  template <class T> T* as() const { return static_cast<T*>(data); }
};

template <class T> DeviceBuffer upload(const std::vector<T>& host) {
  DeviceBuffer b(int64_t(host.size() * sizeof(T)));
  check(cudaMemcpy(b.data, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), "upload");
  return b;
}

std::vector<unsigned char> random_rows(int64_t bytes, uint32_t seed) {
  std::vector<unsigned char> out(static_cast<size_t>(bytes));
  std::mt19937 rng(seed);
  fill_small_values(out.data(), out.size(), rng);
  return out;
}

// One epoch's targets: where its tokens go (append), or which sequence it reads (gather).
struct Epoch {
  std::vector<int64_t> slots;
  std::vector<int32_t> rows, positions;
  int64_t row = 0;  // gather: the sequence (row, or its page list's index)
};

// A case's capacity and targets: `epochs` disjoint sets of targets, so that rotating through them
// (and through the layers) keeps the working set above L2.
struct Plan {
  CacheConfig config;
  std::vector<int32_t> pages;  // paged: every sequence's pages, pages_per_seq each
  int64_t pages_per_seq = 0;
  std::vector<Epoch> epochs;
  int64_t tokens = 0;  // appended per op
};

// Null when the variant cannot hold the shape (a contiguous model's max_seq_len, a ring's window).
std::unique_ptr<Plan> plan(const VariantDescriptor& d, const Shape& s, int epochs) {
  auto p = std::make_unique<Plan>();
  const bool decode = s.op == "append_decode", gather = s.op == "gather";
  const int64_t sequences = decode ? s.n : 1;
  const int64_t per_seq = decode ? epochs : gather ? s.n : s.n * epochs;
  if (d.addressing == Addressing::contiguous && per_seq > d.max_seq_len) return nullptr;
  if (d.addressing == Addressing::ring && per_seq > d.window) return nullptr;
  p->config.device = Device::cuda;
  p->config.rows = sequences;
  if (d.addressing == Addressing::contiguous) p->config.max_seq_len = per_seq;
  if (d.paged()) {
    p->pages_per_seq = (per_seq + d.page_size - 1) / d.page_size;
    p->config.pages = sequences * p->pages_per_seq;
    for (int64_t i = 0; i < p->config.pages; ++i) p->pages.push_back(int32_t(i));
    std::shuffle(p->pages.begin(), p->pages.end(), std::mt19937(1));  // as an allocator under churn
  }
  p->tokens = gather ? 0 : s.n;
  p->config.max_staged_tokens = std::max<int64_t>(s.n, sequences);
  auto slot_of = [&](int64_t seq, int64_t pos) {
    return int64_t(p->pages[size_t(seq * p->pages_per_seq + pos / d.page_size)]) * d.page_size + pos % d.page_size;
  };
  const int count = gather ? 1 : epochs;
  for (int e = 0; e < count; ++e) {
    Epoch ep;
    for (int64_t i = 0; i < s.n; ++i) {
      const int64_t seq = decode ? i : 0, pos = decode ? e : gather ? i : e * s.n + i;
      ep.rows.push_back(int32_t(seq));
      ep.positions.push_back(int32_t(pos));
      if (d.paged()) ep.slots.push_back(slot_of(seq, pos));
    }
    p->epochs.push_back(std::move(ep));
  }
  return p;
}

// The same targets on the device.
struct DeviceEpoch {
  DeviceBuffer slots, rows, positions;
  TokenTargets targets(const VariantDescriptor& d, int64_t n) const {
    if (d.paged()) return TokenTargets::paged(IndexView{slots.data, DType::i64, Device::cuda, n});
    return TokenTargets::row_positions(IndexView{rows.data, DType::i32, Device::cuda, n},
                                       IndexView{positions.data, DType::i32, Device::cuda, n});
  }
  Target target(const VariantDescriptor& d) const {
    return Target{d.paged() ? slots.as<const int64_t>() : nullptr, rows.as<const int32_t>(), positions.as<const int32_t>(),
                  d.page_size, d.addressing == Addressing::ring ? d.window : 0};
  }
};

DeviceEpoch to_device(const Epoch& e) {
  DeviceEpoch out;
  if (!e.slots.empty()) out.slots = upload(e.slots);
  out.rows = upload(e.rows);
  out.positions = upload(e.positions);
  return out;
}

}  // namespace
