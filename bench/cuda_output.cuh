// The CUDA bench's output and tuner: JSON records with the device's facts, and --tune, which writes
// the `cuda` section of specs/tuning/<model>.yaml.
// Part of kvforge_cuda_bench (cuda_bench.cu includes it once, in this order).
#pragma once

namespace {

// ---- output ----------------------------------------------------------------------------------------

std::string number(double x) {
  if (!std::isfinite(x)) return "null";
  char b[64];
  std::snprintf(b, sizeof b, "%.4f", x);
  return b;
}

std::string quoted(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (c == '\n') out += "\\n";
    else if (static_cast<unsigned char>(c) >= 0x20) out += c;
  }
  return out + "\"";
}

std::string timing_json(const Timing& t) {
  return "{\"eager_us\": " + number(t.eager_us) + ", \"graph_us\": " + number(t.graph_us) + ", \"host_us\": " +
         number(t.host_us) + (t.graph_error.empty() ? "" : ", \"graph_error\": " + quoted(t.graph_error)) + "}";
}

struct DeviceInfo {
  std::string name;
  int sms = 0, sm_clock_mhz = 0, memory_clock_mhz = 0;
  int64_t l2_bytes = 0, memory_bytes = 0;
};

DeviceInfo device_info() {
  DeviceInfo info;
  int dev = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, dev), "cudaGetDeviceProperties");
  info.name = prop.name;
  info.sms = prop.multiProcessorCount;
  info.l2_bytes = prop.l2CacheSize;
  info.memory_bytes = int64_t(prop.totalGlobalMem);
  int khz = 0;
  if (cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, dev) == cudaSuccess) info.sm_clock_mhz = khz / 1000;
  if (cudaDeviceGetAttribute(&khz, cudaDevAttrMemoryClockRate, dev) == cudaSuccess) info.memory_clock_mhz = khz / 1000;
  return info;
}

void write_json(const std::string& path, const DeviceInfo& info, const std::string& preset, bool cold, const Timing& empty,
                const std::vector<Record>& records) {
  std::ofstream out(path);
  out << "{\n  \"kind\": \"kvforge_cuda_bench\",\n  \"preset\": " << quoted(preset) << ",\n  \"cold\": " << (cold ? "true" : "false")
      << ",\n  \"torch_version\": " << quoted(torch_version())
      << ",\n  \"device\": {\"name\": " << quoted(info.name) << ", \"sms\": " << info.sms
      << ", \"sm_clock_mhz\": " << info.sm_clock_mhz << ", \"memory_clock_mhz\": " << info.memory_clock_mhz
      << ", \"l2_bytes\": " << info.l2_bytes << ", \"memory_bytes\": " << info.memory_bytes << "},\n  \"empty_kernel\": "
      << timing_json(empty) << ",\n  \"records\": [";
  for (size_t i = 0; i < records.size(); ++i) {
    const Record& r = records[i];
    out << (i ? ",\n" : "\n") << "    {\"variant\": " << quoted(r.variant) << ", \"op\": " << quoted(r.op) << ", \"n\": " << r.n
        << ", \"bytes\": " << r.bytes << ", \"coded\": " << (r.coded ? "true" : "false")
        << ", \"check\": " << quoted(r.check) << ", \"d2d_us\": " << number(r.d2d_us)
        << ", \"lazy_host\": {\"append_us\": " << number(r.append_host_us) << ", \"commit_us\": " << number(r.commit_host_us)
        << "}"
        << ", \"kvforge\": " << timing_json(r.kvforge) << ", \"untuned\": " << timing_json(r.untuned)
        << ", \"step\": " << timing_json(r.step) << ", \"commit\": " << timing_json(r.commit)
        << ", \"reference\": " << timing_json(r.reference)
        << ", \"naive\": " << timing_json(r.naive) << ", \"twin\": " << timing_json(r.twin) << ", \"torch\": {";
    for (size_t f = 0; f < r.torch.size(); ++f)
      out << (f ? ", " : "") << quoted(r.torch[f].first) << ": " << number(r.torch[f].second);
    out << "}, \"torch_note\": " << quoted(r.torch_note) << "}";
  }
  out << "\n  ]\n}\n";
}

// ---- tuning ----------------------------------------------------------------------------------------

// Replaces the `cuda:` section of a tuning file (keeping everything else), or starts the file.
// One launch shape --tune measures: Tuning's cuda fields.
struct LaunchShape {
  int block_threads, items_per_thread;
  bool operator<(const LaunchShape& o) const {
    return block_threads != o.block_threads ? block_threads < o.block_threads : items_per_thread < o.items_per_thread;
  }
};

void write_cuda_tuning(const std::string& path, const std::string& model, LaunchShape best, const std::string& why) {
  std::vector<std::string> kept;
  {
    std::ifstream in(path);
    bool in_cuda = false;
    for (std::string line; std::getline(in, line);) {
      if (line.rfind("cuda:", 0) == 0) {
        in_cuda = true;
        continue;
      }
      if (in_cuda && (line.empty() || line[0] == ' ' || line[0] == '#')) continue;
      in_cuda = false;
      kept.push_back(line);
    }
  }
  if (kept.empty()) kept.push_back("model: " + model);
  std::ofstream out(path);
  for (const std::string& line : kept) out << line << "\n";
  out << "cuda:\n  # " << why << "\n  block_threads: " << best.block_threads
      << "\n  items_per_thread: " << best.items_per_thread << "\n";
}

int tune(const std::string& model, const std::string& out_dir, Timer& timer) {
  std::vector<const VariantEntry*> variants;
  for (const VariantEntry& e : registry().variants()) {
    const VariantDescriptor& d = *e.descriptor;
    if (std::string(d.model) == model && !d.is_hybrid() && (d.storage == d.input || d.quantized())) variants.push_back(&e);
  }
  if (variants.empty()) {
    std::fprintf(stderr, "kvforge_cuda_bench: --tune=%s: no float or quantized variant of that model is registered\n", model.c_str());
    return 2;
  }
  const std::vector<Shape> shapes = {{"append_decode", 64}, {"append_prefill", 2048}, {"gather", 8192}};
  std::vector<LaunchShape> candidates;
  for (int threads : {64, 128, 256, 512, 1024})
    for (int items : {1, 2, 4, 8}) candidates.push_back({threads, items});
  std::map<LaunchShape, double> log_sum;
  int measured = 0;
  for (const VariantEntry* e : variants)
    for (const Shape& s : shapes) {
      const VariantDescriptor& d = *e->descriptor;
      const std::unique_ptr<Plan> p = plan(d, s, 1);
      if (!p) continue;
      CacheConfig config = p->config;
      config.stream = timer.stream;
      auto cache = e->create(config);
      if (d.quant == Quant::per_tensor)
        for (int l = 0; l < d.layers; ++l) cache->set_tensor_scale(l, 0.0625f, 0.125f);
      const int64_t row_bytes = int64_t(d.heads) * d.head_dim * dtype_size(d.input);
      const DeviceBuffer k = upload(random_rows(s.n * row_bytes, 1)), v = upload(random_rows(s.n * row_bytes, 2));
      const DeviceEpoch target = to_device(p->epochs[0]);
      const DeviceBuffer pages = d.paged() ? upload(p->pages) : DeviceBuffer(16);
      GatherRange range;
      range.end = s.n;
      if (d.paged()) range.pages = IndexView{pages.data, DType::i32, Device::cuda, p->pages_per_seq};
      auto op = [&](int i) {
        const int layer = i % d.layers;
        if (s.op == "gather")
          cache->gather(layer, range, TensorView::contiguous(k.data, d.input, Device::cuda, d.heads, s.n, d.head_dim),
                        TensorView::contiguous(v.data, d.input, Device::cuda, d.heads, s.n, d.head_dim));
        else
          cache->append(lazy(d) ? 0 : layer, TensorView::contiguous(k.data, d.input, Device::cuda, s.n, d.heads, d.head_dim),
                        TensorView::contiguous(v.data, d.input, Device::cuda, s.n, d.heads, d.head_dim), target.targets(d, s.n));
        cache->commit();
      };
      for (const LaunchShape& c : candidates) {
        Tuning t = d.tuning;
        t.cuda_block_threads = c.block_threads;
        t.cuda_items_per_thread = c.items_per_thread;
        cache->set_tuning(t);
        Timing timing;
        timer.eager(op, timing);
        log_sum[c] += std::log(timing.eager_us);
      }
      ++measured;
    }
  const LaunchShape fallback{int(Tuning{}.cuda_block_threads), int(Tuning{}.cuda_items_per_thread)};
  LaunchShape best = fallback;
  for (const auto& [c, sum] : log_sum)
    if (sum < log_sum[best]) best = c;
  const double ratio = std::exp((log_sum[best] - log_sum[fallback]) / std::max(measured, 1));
  char why[256];
  std::snprintf(why, sizeof why,
                "written by kvforge_cuda_bench --tune=%s on %s: %zu candidates over %d (variant, shape) pairs; the "
                "winner's geometric-mean time is %.3f of the default's",
                model.c_str(), device_info().name.c_str(), candidates.size(), measured, ratio);
  const std::string path = out_dir + "/" + model + ".yaml";
  write_cuda_tuning(path, model, best, why);
  std::printf("%s\nwrote cuda.block_threads: %d, cuda.items_per_thread: %d to %s\n", why, best.block_threads,
              best.items_per_thread, path.c_str());
  return 0;
}

}  // namespace
