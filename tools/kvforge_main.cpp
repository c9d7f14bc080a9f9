// kvforge: list the variants this build registered, and run a short demo through the registry.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "kvforge/kvforge.hpp"

namespace {

const char* kUsage =
    "usage: kvforge <command> [options]\n"
    "\n"
    "commands:\n"
    "  list [--layout L] [--model M] [--dtype D]\n"
    "        the registered variants with their scales and bytes per token (K and V, all layers,\n"
    "        scales included)\n"
    "  demo [--variant NAME | --all]\n"
    "        drive one variant (default: every tiny bf16 and quantized variant; --all: every\n"
    "        registered variant) through prefill,\n"
    "        decode steps, commit and gather on the CPU backend, and check what comes back against\n"
    "        the input: exactly for float storage, within the documented bound for quantized\n"
    "        storage (int8, fp8, fp4, int4, FlashMLA records)\n"
    "  states [--model M]\n"
    "        for each paged variant of a hybrid model (linear_layers): a sequence's state, and\n"
    "        whether one page holds it in place (StatePool over the cache: one pool, one free\n"
    "        list); the smallest page that does, and the padding a state leaves in it; and the order\n"
    "        of a pool of its own (the layout's state_axes, outermost first)\n"
    "  cpu   the x86-64 level the CPU kernels run at, the widest this CPU supports, and the levels\n"
    "        this build has kernels for (CMake's KVFORGE_CPU_LEVELS); where it has several, the\n"
    "        environment variable KVFORGE_CPU_LEVEL=2|3|4 runs a narrower one\n"
    "  help  this text\n";

// A command line that names something the command does not take (an unknown option, a missing value,
// a layout no variant has): refused with exit status 2, so that a typo never runs the default quietly.
struct UsageError {
  std::string message;
};

std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

// The options after the command: `valued` ones take the next argument as their value, `flags` none.
struct Args {
  std::map<std::string, std::string> values;
  std::set<std::string> flags;
  std::string value(const std::string& name) const {
    const auto it = values.find(name);
    return it == values.end() ? "" : it->second;
  }
};

Args parse(int argc, char** argv, const std::vector<std::string>& valued, const std::vector<std::string>& flags) {
  Args a;
  const std::string command = argv[1];
  for (int i = 2; i < argc; ++i) {
    const std::string arg = argv[i];
    if (std::find(valued.begin(), valued.end(), arg) != valued.end()) {
      if (i + 1 == argc) throw UsageError{command + ": " + arg + " needs a value"};
      a.values[arg] = argv[++i];
    } else if (std::find(flags.begin(), flags.end(), arg) != flags.end()) {
      a.flags.insert(arg);
    } else {
      std::vector<std::string> allowed = valued;
      allowed.insert(allowed.end(), flags.begin(), flags.end());
      throw UsageError{command + ": unknown argument '" + arg + "' (allowed: " +
                       (allowed.empty() ? std::string("none") : joined(allowed)) + ")"};
    }
  }
  return a;
}

// A filter's value must name something registered; `field` reads one descriptor's name for it.
template <class Field>
void check_known(const char* command, const char* option, const std::string& value, Field field) {
  if (value.empty()) return;
  std::set<std::string> known;
  for (const auto& e : kvforge::registry().variants()) known.insert(field(*e.descriptor));
  if (!known.count(value))
    throw UsageError{std::string(command) + ": " + option + " '" + value + "' is no registered variant's (allowed: " +
                     joined({known.begin(), known.end()}) + ")"};
}

int list(int argc, char** argv) {
  const Args args = parse(argc, argv, {"--layout", "--model", "--dtype"}, {});
  kvforge::VariantQuery q;
  q.layout = args.value("--layout");
  q.model = args.value("--model");
  const std::string dtype = args.value("--dtype");
  check_known("list", "--layout", q.layout, [](const kvforge::VariantDescriptor& d) { return std::string(d.layout); });
  check_known("list", "--model", q.model, [](const kvforge::VariantDescriptor& d) { return std::string(d.model); });
  check_known("list", "--dtype", dtype, [](const kvforge::VariantDescriptor& d) { return std::string(d.storage_name()); });
  const auto& all = kvforge::registry().variants();
  size_t width = 7, storage_width = 12;  // a record format's name may be longer than a dtype's
  for (const auto& e : all) {
    width = std::max(width, std::strlen(e.descriptor->name));
    storage_width = std::max(storage_width, std::strlen(e.descriptor->storage_name()));
  }
  std::printf("%-*s  %-10s  %-6s  %-*s  %-44s  %11s\n", int(width), "variant", "addressing", "update", int(storage_width),
              "storage", "scales", "bytes/token");
  int shown = 0;
  for (const auto* e : kvforge::registry().select(q)) {
    const auto& d = *e->descriptor;
    if (!dtype.empty() && dtype != d.storage_name()) continue;
    // As kvforge-codegen's list says it: "per_group 16 fp8_e4m3 x fp32 tensor separate".
    std::string scales = d.quantized() ? std::string(kvforge::name_of(d.quant)) +
                                             (d.quant_group ? " " + std::to_string(d.quant_group) : "") + " " +
                                             std::string(kvforge::dtype_name(kvforge::scale_value_dtype(d.scale))) +
                                             (kvforge::is_zero_point_scale(d.scale) ? " + zero" : "") +
                                             (d.tensor_scaled ? " x fp32 tensor" : "") +
                                             " " + kvforge::name_of(d.scale_placement)
                                       : "-";
    if (d.is_hybrid()) {  // the column shows each layer group's layout instead
      scales.clear();
      for (int g = 0; g < d.hybrid->num_groups; ++g)
        scales += std::string(g ? ", " : "") + d.hybrid->groups[g].name + ": " + d.hybrid->groups[g].member->layout;
    }
    std::printf("%-*s  %-10s  %-6s  %-*s  %-44s  %11lld\n", int(width), d.name,
                d.is_hybrid() ? "hybrid" : kvforge::name_of(d.addressing),
                d.update == kvforge::UpdateMode::lazy ? "lazy" : "eager",
                int(storage_width), d.storage_name(), scales.c_str(),
                static_cast<long long>(d.bytes_per_token));
    ++shown;
  }
  std::printf("%d of %zu registered variants\n", shown, all.size());
  return 0;
}

// Float storage must give back exactly what went in. Quantized storage is held to its documented
// bound for inputs in [-32, 32), at a scale of at most 32 / qmax (a per-tensor one set so, a dynamic
// one at most so, times scale_round_up where ue8m0 or e4m3 round it up): half
// a scale step for int8, int4 and uint4 (whose scale spans the inputs' range, not their amax; plus bf16
// rounding of the result), half the float grid's spacing
// (relative 2^-4 for e4m3, 2^-3 for e5m2, 2^-2 for e2m1, whose subnormal step is half its scale).
float tolerance(const kvforge::VariantDescriptor& d, float want) {
  using kvforge::DType;
  // A record format's parts each within their own bound (the demo's values are within 32 of zero).
  if (d.coded_records()) return d.record_format->error_bound(std::fabs(want), 32.0f) + 0.0625f;
  if (!d.quantized()) return 0.0f;
  const float round_up = kvforge::scale_round_up(d.scale);
  if (d.storage == DType::i8) return 0.5f * round_up * 32.0f / 127.0f + 0.0625f;
  if (d.storage == DType::i4) return 0.5f * round_up * 32.0f / 7.0f + 0.0625f;
  if (d.storage == DType::u4) return 0.5f * 64.0f / 15.0f + 0.0625f;  // a range of at most 64 in 15 steps
  if (d.storage == DType::f4e2m1) return std::fabs(want) * 0.25f + 0.25f * round_up * 32.0f / 6.0f + 0.0625f;
  return std::fabs(want) * (d.storage == DType::f8e4m3 ? 0.0625f : 0.125f) + 0.0625f;
}

// Prefill into each of 2 sequences, decode a few more tokens, gather everything back and compare.
bool demo_one(const kvforge::VariantEntry& e) {
  using namespace kvforge;
  const VariantDescriptor& d = *e.descriptor;
  // Every size below follows from the descriptor: positions from the model's max_seq_len, pages from
  // the page size, the readable range from the window.
  const int num_rows = 2;
  const int total = std::min(48, d.max_seq_len), prefill = total - std::min(8, total / 2);
  const int per_row = d.paged() ? (total + d.page_size - 1) / d.page_size : 0;  // pages one row needs
  CacheConfig cfg;
  cfg.rows = num_rows;
  cfg.max_seq_len = d.addressing == Addressing::contiguous ? total : 0;
  cfg.pages = d.paged() ? num_rows * per_row + 2 : 0;
  cfg.max_staged_tokens = num_rows * total;
  auto cache = e.create(cfg);
  // The inputs below lie in [-32, 32): a per-tensor scale that holds them, or a second-level one under
  // which the largest group's scale is e4m3's largest value (NVFP4's calibration).
  if (d.takes_tensor_scale()) {
    const float scale = 32.0f / quant_max(d.storage) / (d.tensor_scaled && d.scale == DType::f8e4m3 ? quant_max(d.scale) : 1.0f);
    for (int layer = 0; layer < d.layers; ++layer) cache->set_tensor_scale(layer, scale, scale);
  }
  const int H = d.heads, D = d.head_dim, esize = dtype_size(d.input);
  const int readable = d.window ? std::min(total, d.window) : total;
  std::mt19937 rng(7);
  std::vector<std::vector<unsigned char>> k(num_rows), v(num_rows);  // per row: [total, H, D] in the input dtype
  for (int r = 0; r < num_rows; ++r) {
    k[r].resize(size_t(total) * H * D * esize);
    v[r].resize(k[r].size());
    // Small integers are exact in every float dtype, so the comparison can be bitwise.
    for (size_t i = 0; i < k[r].size() / esize; ++i) {
      const float kv[2] = {float(int(rng() % 64) - 32), float(int(rng() % 64) - 32)};
      for (int which = 0; which < 2; ++which) {
        store_float(d.input, kv[which], (which ? v[r] : k[r]).data() + i * esize);
      }
    }
  }
  // Each row owns distinct pages, handed out from the top of the pool down so that page order differs
  // from position order.
  std::vector<int32_t> pages(size_t(num_rows) * std::max(per_row, 1), 0);  // row r's page list at r * per_row
  for (int r = 0; r < num_rows; ++r)
    for (int j = 0; j < per_row; ++j) pages[size_t(r) * per_row + j] = int32_t(cfg.pages - 1 - (r * per_row + j));
  auto run_step = [&](int first, int count) {
    std::vector<unsigned char> kb, vb;
    std::vector<int32_t> rows, positions;
    std::vector<int64_t> slots;
    for (int r = 0; r < num_rows; ++r)
      for (int p = first; p < first + count; ++p) {
        kb.insert(kb.end(), k[r].begin() + size_t(p) * H * D * esize, k[r].begin() + size_t(p + 1) * H * D * esize);
        vb.insert(vb.end(), v[r].begin() + size_t(p) * H * D * esize, v[r].begin() + size_t(p + 1) * H * D * esize);
        rows.push_back(r);
        positions.push_back(p);
        if (d.paged()) slots.push_back(int64_t(pages[size_t(r) * per_row + p / d.page_size]) * d.page_size + p % d.page_size);
      }
    const int64_t n = int64_t(rows.size());
    const TokenTargets t = d.paged() ? TokenTargets::paged(IndexView::of(slots.data(), n))
                                     : TokenTargets::row_positions(IndexView::of(rows.data(), n), IndexView::of(positions.data(), n));
    for (int layer = 0; layer < d.layers; ++layer)
      cache->append(layer, TensorView::contiguous(kb.data(), d.input, Device::cpu, n, H, D),
                    TensorView::contiguous(vb.data(), d.input, Device::cpu, n, H, D), t);
    cache->commit();
  };
  run_step(0, prefill);
  for (int p = prefill; p < total; ++p) run_step(p, 1);
  bool ok = true;
  std::vector<unsigned char> ko(size_t(H) * readable * D * esize), vo(ko.size());
  for (int r = 0; r < num_rows; ++r) {
    GatherRange g;
    g.row = r;
    g.pages = IndexView::of(pages.data() + size_t(r) * per_row, per_row);
    g.begin = total - readable;
    g.end = total;
    cache->gather(d.layers - 1, g, TensorView::contiguous(ko.data(), d.input, Device::cpu, H, readable, D),
                  TensorView::contiguous(vo.data(), d.input, Device::cpu, H, readable, D));
    for (int h = 0; h < H; ++h)
      for (int j = 0; j < readable; ++j)
        for (int x = 0; x < D; ++x) {
          const size_t src = ((size_t(g.begin + j) * H + h) * D + x) * esize, dst = ((size_t(h) * readable + j) * D + x) * esize;
          for (int which = 0; which < 2; ++which) {
            const float want = kvforge::load_float(d.input, (which ? v[r] : k[r]).data() + src);
            const float got = kvforge::load_float(d.input, (which ? vo : ko).data() + dst);
            ok = ok && std::fabs(got - want) <= tolerance(d, want);
          }
        }
  }
  const MemoryReport m = cache->memory();
  std::printf("%-44s %s  storage %9lld B  runtime overhead %6lld B (%.2f%%)\n", d.name, ok ? "ok  " : "FAIL",
              static_cast<long long>(m.storage_bytes), static_cast<long long>(m.overhead_bytes()),
              100.0 * double(m.overhead_bytes()) / double(m.storage_bytes));
  return ok;
}

int demo(int argc, char** argv) {
  const Args args = parse(argc, argv, {"--variant"}, {"--all"});
  const std::string name = args.value("--variant");
  if (!name.empty() && args.flags.count("--all")) throw UsageError{"demo: give --variant NAME or --all, not both"};
  std::vector<const kvforge::VariantEntry*> chosen;
  if (!name.empty()) {
    chosen.push_back(&kvforge::registry().at(name));
  } else if (args.flags.count("--all")) {
    for (const auto& e : kvforge::registry().variants()) chosen.push_back(&e);
  } else {
    kvforge::VariantQuery q;
    q.model = "tiny";
    for (const auto* e : kvforge::registry().select(q))
      if (e->descriptor->storage == kvforge::DType::bf16 || e->descriptor->quantized()) chosen.push_back(e);
  }
  std::printf("demo: 2 sequences, prefill up to 40 tokens, decode up to 8 steps (fewer where max_seq_len is\n"
              "      smaller), every layer; gather the last layer back\n");
  int failed = 0, skipped = 0;
  for (const auto* e : chosen) {
    if (e->descriptor->is_hybrid()) {  // its pages are per layer group, so slots need the sequence manager
      std::printf("%-44s skipped: hybrid; its pages are per layer group, so it is driven through\n"
                  "%-44s HybridSequenceManager, which tests/test_memory.cpp checks\n", e->descriptor->name, "");
      ++skipped;
      continue;
    }
    failed += !demo_one(*e);
  }
  std::printf("demo: %zu variants, %d failed, %d skipped\n", chosen.size() - skipped, failed, skipped);
  return failed ? 1 : 0;
}

int states(int argc, char** argv) {
  const Args args = parse(argc, argv, {"--model"}, {});
  kvforge::VariantQuery q;
  q.model = args.value("--model");
  check_known("states", "--model", q.model, [](const kvforge::VariantDescriptor& d) { return std::string(d.model); });
  size_t width = 7;
  for (const auto& e : kvforge::registry().variants()) width = std::max(width, std::strlen(e.descriptor->name));
  std::printf("%-*s  %12s  %6s  %12s  %5s  %10s  %12s  %8s  %s\n", int(width), "variant", "state bytes", "page", "page bytes",
              "fits", "fits from", "page bytes", "padding", "own pool order");
  int shown = 0;
  for (const auto* e : kvforge::registry().select(q)) {
    const auto& d = *e->descriptor;
    if (!d.states || !d.paged() || d.is_hybrid()) continue;
    int64_t state = 0;  // the parts' own bytes, over every linear layer
    for (const kvforge::StatePart& p : kvforge::state_parts(d)) {
      int64_t n = kvforge::dtype_size(p.dtype);
      for (int64_t x : p.shape) n *= x;
      state += n * d.states->num_linear;
    }
    const int64_t need = kvforge::state_page_size(d), at = need * d.bytes_per_token;
    const std::string order = std::string(name_of(d.state_axes[0])) + "," + name_of(d.state_axes[1]) + "," + name_of(d.state_axes[2]);
    std::printf("%-*s  %12lld  %6d  %12lld  %5s  %10lld  %12lld  %7.1f%%  %s\n", int(width), d.name,
                static_cast<long long>(state), d.page_size, static_cast<long long>(d.page_size * d.bytes_per_token),
                need && need <= d.page_size ? "yes" : "no", static_cast<long long>(need), static_cast<long long>(at),
                at ? 100.0 * double(at - state) / double(at) : 0.0, order.c_str());
    ++shown;
  }
  std::printf("%d variants of hybrid models; padding: the share of the smallest page that fits which a state leaves unused\n",
              shown);
  return 0;
}

int cpu() {
  const std::vector<int> built = kvforge::cpu_levels_built();
  std::string levels;
  for (int level : built) levels += (levels.empty() ? "" : ", ") + kvforge::cpu_level_name(level);
  std::printf("running: %s\nsupported: %s\nbuilt: %s\n", kvforge::cpu_level_name(kvforge::cpu_level()).c_str(),
              kvforge::cpu_level_name(kvforge::cpu_level_supported()).c_str(), levels.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string cmd = argc > 1 ? argv[1] : "help";
  try {
    if (cmd == "list") return list(argc, argv);
    if (cmd == "demo") return demo(argc, argv);
    if (cmd == "states") return states(argc, argv);
    if (cmd == "cpu") {
      parse(argc, argv, {}, {});
      return cpu();
    }
    if (cmd == "help" || cmd == "--help" || cmd == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    std::fprintf(stderr, "kvforge: unknown command '%s'\n%s", cmd.c_str(), kUsage);
    return 2;
  } catch (const UsageError& e) {
    std::fprintf(stderr, "kvforge: %s\n(kvforge help lists every command and its options)\n", e.message.c_str());
    return 2;
  } catch (const kvforge::Error& e) {
    std::fprintf(stderr, "kvforge: %s\n", e.what());
    return 1;
  }
}
