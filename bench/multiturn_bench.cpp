// The multi-turn chat traces of kvforge_bench: which prompt tokens a prefill can skip with the prefix
// cache's tiers below the device (host, disk) against today's free-on-evict cache, what vLLM's block
// hash costs, and hybrid models' prefix reuse from state checkpoints (bench/RESULTS.md §15, §16).
#include <benchmark/benchmark.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kvforge/kvforge.hpp"
#include "memory_bench.hpp"

namespace kvforge_bench {
namespace {

using namespace kvforge;

// How a conversation opens: what its first prompt holds before any turn.
enum class ChatOpening { shared_system_prompt, own_document };

// A multi-turn chat trace, the memory manager alone (no K/V is written: this measures which tokens a
// prefill can skip). 160 conversations, each opening with `opening`: one of four 200-token system
// prompts, or a 2000-token document of its own (LMCache's long-document question answering); a
// turn adds about 100 user tokens to the conversation's history and about 60 answer tokens, and the
// next turn goes to a conversation drawn at random, so a conversation returns after the traffic of
// others. The device pool holds about a tenth of the working set (the histories); `host_factor`
// gives the host tier that many times the device pool (0: no tier, evicted blocks are freed, as
// before tiers), and `disk_factor` a disk tier of that many (a file in /tmp). Counters: the share of
// prompt blocks looked up that each tier served (hit_device, hit_host, hit_disk), prompt tokens,
// tokens served from the cache (prefill saved), blocks demoted and promoted, and KV events recorded
// per second of the manager's own time.
// every > 0: a hybrid model, whose linear layers' states are checkpointed at every every-th block
// boundary (StateSlots; as many checkpoints as the device pool has boundaries): a prompt shares its
// cached prefix only up to its longest checkpointed boundary. Prefill runs in chunks that end on
// boundaries and the answer one token a step, each followed by a checkpoint, as an engine in vLLM's
// "align" mode schedules them. Counters add the checkpoints taken and held, and the cached tokens
// that went unshared for want of one. `states`: where the state and its checkpoints lie: a pool of their
// own, or pages of the device pool itself (StatePool over the cache: one pool, one free list), where
// checkpoints and cached K/V blocks compete for pages and an allocation short of pages takes the
// oldest checkpoints; `pages_grown` adds a page per checkpoint record to the pool, for equal memory
// where a state is a page. `scheme`: how blocks are keyed (block_hash.hpp); manager_us_per_turn is the
// manager's own time a turn, which vLLM's SHA-256 keys add to.
enum class StatesAt { own_pool, pages, pages_grown };

void run_multiturn(benchmark::State& state, const VariantEntry* e, ChatOpening opening, int host_factor, int disk_factor,
                   int every, BlockHashScheme scheme, StatesAt states_at) {
  const bool states_in_pages = states_at != StatesAt::own_pool;
  const int P = e->descriptor->page_size;
  for (auto _ : state) {
    std::mt19937 rng(3);
    std::lognormal_distribution<double> user_len(4.6, 0.5), answer_len(4.1, 0.5);
    const int conversations = 160, turns = 1200;
    std::vector<std::vector<int32_t>> history(static_cast<size_t>(conversations));
    const int64_t opening_tokens = opening == ChatOpening::shared_system_prompt ? 200 : 2000;
    for (int c = 0; c < conversations; ++c) {
      std::vector<int32_t>& h = history[size_t(c)];
      if (opening == ChatOpening::shared_system_prompt) {
        h.assign(size_t(opening_tokens), int32_t(1000 + c % 4));
      } else {
        for (int64_t i = 0; i < opening_tokens; ++i) h.push_back(int32_t(rng() % 30000));
      }
    }
    // Working set: the histories after their expected turns (the opening + 7.5 * 160 tokens each).
    const int64_t working_set = int64_t(conversations) * (opening_tokens + turns / conversations * 160);
    CacheConfig cfg;
    cfg.pages = std::max<int64_t>(64, working_set / 10 / P);
    // Checkpoint records, one per boundary of the device pool (Qwen3-Next-80B's state is a page of
    // 3,168 tokens of its K/V, so pages_grown holds what a pool of its own beside the pages would).
    const int64_t base_pages = cfg.pages, checkpoints = every > 0 ? base_pages / every : 0;
    if (states_at == StatesAt::pages_grown) cfg.pages += checkpoints;
    auto cache = e->create(cfg);
    SequenceManagerOptions o;
    o.host_blocks = int32_t(cfg.pages * host_factor);
    o.kv_events = true;
    o.block_hash = scheme;
    const std::string disk = "/tmp/kvforge_multiturn_" + std::to_string(::getpid()) + ".blocks";
    std::remove(disk.c_str());
    if (disk_factor > 0) o.disk_path = disk, o.disk_blocks = cfg.pages * disk_factor;
    SequenceManager m(*cache, o);
    std::unique_ptr<StatePool> states;
    std::unique_ptr<StateSlots> slots;
    const int64_t boundary = int64_t(every) * P;
    if (every > 0) {
      const std::vector<StatePart> record{{"h", {4}, DType::f32}};
      states = states_in_pages ? std::make_unique<StatePool>(record, 1, *cache, checkpoints)
                               : std::make_unique<StatePool>(record, 1, StatePoolConfig{Device::cpu, 1, checkpoints});
      slots = std::make_unique<StateSlots>(m, *states, every);
    }
    int64_t most_taken = 0;  // states_in_pages: the most device pages the state and checkpoints held
    int64_t prompt_tokens = 0, saved = 0, events = 0, refused = 0;
    double seconds = 0;
    for (int t = 0; t < turns; ++t) {
      const int c = int(rng() % uint32_t(conversations));
      std::vector<int32_t>& h = history[size_t(c)];
      for (int i = int(user_len(rng)); i > 0; --i) h.push_back(int32_t(rng() % 30000));
      if (int64_t(h.size()) + 600 > base_pages * P)  // the same trace in either pool
        h.erase(h.begin() + opening_tokens, h.begin() + opening_tokens + int64_t(h.size()) / 2);
      const auto t0 = std::chrono::steady_clock::now();
      std::vector<int32_t> answer;
      for (int i = int(answer_len(rng)); i > 0; --i) answer.push_back(int32_t(rng() % 30000));
      try {
        if (slots) {
          const int64_t first = std::min<int64_t>(int64_t(h.size()), (slots->reusable_prefix(h) / boundary + 1) * boundary);
          saved += slots->add(t, std::vector<int32_t>(h.begin(), h.begin() + first));
        } else {
          saved += m.add(t, h);
        }
      } catch (const CapacityError&) {
        ++refused;
        continue;
      }
      prompt_tokens += int64_t(h.size());
      if (slots) {
        // The forward of each chunk, then its checkpoint: the prompt to each boundary, the answer a token at a time.
        const auto forward = [&] {
          m.step({t});
          slots->checkpoint(t);
          most_taken = std::max<int64_t>(most_taken, m.taken_pages());
        };
        forward();
        for (int64_t at = m.length(t); at < int64_t(h.size()); at = m.length(t)) {
          m.append(t, std::vector<int32_t>(h.begin() + at, h.begin() + std::min<int64_t>(int64_t(h.size()), slots->next_boundary(t))));
          forward();
        }
        for (int32_t token : answer) {
          m.append(t, {token});
          forward();
        }
        slots->free(t);
      } else {
        m.step({t});
        m.append(t, answer);
        m.step({t});
        m.free(t);
      }
      h.insert(h.end(), answer.begin(), answer.end());
      events += int64_t(m.take_kv_events().size());
      seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    const SequenceStats& st = m.stats();
    state.counters["prompt_tokens"] = double(prompt_tokens);
    state.counters["saved_tokens"] = double(saved);
    state.counters["saved_fraction"] = prompt_tokens ? double(saved) / double(prompt_tokens) : 0;
    state.counters["device_pages"] = double(cfg.pages);
    if (states_in_pages) state.counters["state_pages_most"] = double(most_taken);
    if (slots) state.counters["reclaimed"] = double(slots->stats().reclaimed);
    state.counters["demoted_blocks"] = double(st.demoted_blocks);
    state.counters["promoted_blocks"] = double(st.promoted_blocks);
    state.counters["promoted_bytes"] = double(st.promoted_blocks * cache->packed_page_bytes());
    state.counters["events_per_s"] = seconds > 0 ? double(events) / seconds : 0;
    state.counters["manager_us_per_turn"] = 1e6 * seconds / turns;
    state.counters["refused"] = double(refused);
    state.counters["disk_writes"] = double(st.disk_writes);
    state.counters["disk_reads"] = double(st.disk_reads);
    // Where each prefix hit came from: of the full prompt blocks looked up, the share each tier served.
    const double lookups = double(st.prefix_hits + st.prefix_misses);
    state.counters["hit_device"] = lookups ? double(st.prefix_hits - st.promoted_blocks) / lookups : 0;
    state.counters["hit_host"] = lookups ? double(st.promoted_blocks - st.disk_reads) / lookups : 0;
    state.counters["hit_disk"] = lookups ? double(st.disk_reads) / lookups : 0;
    if (slots) {
      state.counters["checkpoints"] = double(slots->stats().checkpoints);
      state.counters["checkpoints_held"] = double(slots->checkpoints_held());
      state.counters["checkpoint_capacity"] = double(states->config().checkpoints);
      state.counters["capped_tokens"] = double(slots->stats().capped_tokens);
    }
    std::remove(disk.c_str());
  }
}

}  // namespace

void register_multiturn_benchmarks(bool documents) {
  const VariantEntry* chat = &registry().at("vllm_paged_nhd.tiny.bf16");
  // A trace through each set of tiers: none (free on evict), host 1x and 4x, host 1x with disk 10x.
  const auto through_tiers = [chat](const std::string& trace, ChatOpening opening) {
    for (const auto& [host_factor, disk_factor] : {std::pair{0, 0}, {1, 0}, {4, 0}, {1, 10}})
      benchmark::RegisterBenchmark(("memory/" + trace + "/host:" + std::to_string(host_factor) + "x/disk:" +
                                    std::to_string(disk_factor) + "x").c_str(),
                                   run_multiturn, chat, opening, host_factor, disk_factor, 0, BlockHashScheme::kvforge,
                                   StatesAt::own_pool)
          ->Iterations(1)
          ->UseRealTime();
  };
  through_tiers("multiturn", ChatOpening::shared_system_prompt);
  // The same trace keyed as vLLM keys blocks: what its hash costs the manager, beside host:4x above.
  benchmark::RegisterBenchmark("memory/multiturn/host:4x/disk:0x/hash:vllm_sha256_cbor", run_multiturn, chat,
                               ChatOpening::shared_system_prompt, 4, 0, 0, BlockHashScheme::vllm_sha256_cbor,
                               StatesAt::own_pool)
      ->Iterations(1)
      ->UseRealTime();
  for (int every : {1, 4, 16, 64})
    for (const auto& [at, suffix] : {std::pair{StatesAt::own_pool, ""}, {StatesAt::pages, "/in_pages"},
                                     {StatesAt::pages_grown, "/in_pages_grown"}})
      benchmark::RegisterBenchmark(("memory/multiturn_hybrid/every:" + std::to_string(every) + suffix).c_str(),
                                   run_multiturn, chat, ChatOpening::shared_system_prompt, 0, 0, every,
                                   BlockHashScheme::kvforge, at)
          ->Iterations(1)
          ->UseRealTime();
  // Conversations over documents of their own: nothing is shared between them, so what a cache saves
  // is what it kept of each conversation while the others went by. 2.4 times the tokens, and its disk
  // tier's run takes about 11 s here.
  if (documents) through_tiers("multiturn_documents", ChatOpening::own_document);
}

}  // namespace kvforge_bench
