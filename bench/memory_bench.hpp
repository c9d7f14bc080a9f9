// Benchmarks of the memory manager, the serving simulator (memory_bench.cpp), chat traces through the
// prefix cache's tiers (multiturn_bench.cpp) and state slots (state_bench.cpp), registered beside
// the operation matrix by kvforge_bench's main.
#pragma once

namespace kvforge_bench {

// The variant the memory benchmarks run on; kvforge_bench times a copy of its offload's bytes beside them.
inline constexpr const char* kMemoryVariant = "vllm_paged_nhd.llama3_8b.bf16";

void register_memory_benchmarks();  // memory/...: allocator, step metadata, offload and restore
// memory/multiturn...: chat traces through the prefix cache's tiers (multiturn_bench.cpp); `documents`:
// also the trace of conversations over documents of their own (memory/multiturn_documents/...).
void register_multiturn_benchmarks(bool documents);
void register_simulations();        // simulate/<variant>: one per paged bf16 layout of the tiny model
void register_state_benchmarks();         // memory/state/<record>/<op>: StatePool against a copy (state_bench.cpp)
void register_disk_tier_benchmarks();     // memory/disk/...: promotion from the disk tier, prefetch (disk_tier_bench.cpp)
void register_promote_ahead_benchmarks();  // memory/host/...: host-tier promotion copied ahead (promote_ahead_bench.cpp)

}  // namespace kvforge_bench
