// libFuzzer target over the sequence manager's operation stream: the fuzzer's bytes choose the variant
// and every operation of the model-based harness; any disagreement with the model, broken invariant,
// or sanitizer report is a crash. Built by -DKVFORGE_FUZZ=ON with clang (see tools/fuzz-short).
#include <cstdio>
#include <cstdlib>

#include "sequence_model.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvtest;
  static const std::vector<const VariantEntry*> variants = [] {
    std::vector<const VariantEntry*> out;
    for (const auto& e : registry().variants())
      if (e.descriptor->paged() && std::string(e.descriptor->model) == "tiny") out.push_back(&e);
    return out;
  }();
  if (variants.empty() || size < 2) return 0;
  ByteChoices choices(data, size);
  const VariantEntry& e = *variants[choices.below(uint32_t(variants.size()))];
  try {
    const int32_t window = choices.below(3) == 0 ? int32_t(e.descriptor->page_size + choices.below(40)) : 0;
    const bool prefix_caching = choices.below(4) != 0, promote_ahead = choices.below(2) == 0;
    SequenceModel model(e, 128 / e.descriptor->page_size * 2 + 4, 8, prefix_caching, window, promote_ahead);
    for (int i = 0; i < 400 && !choices.exhausted(); ++i) model.random_op(choices);
    model.verify();
  } catch (const ModelMismatch& m) {
    std::fprintf(stderr, "kvforge fuzz: %s\n", m.what());
    std::abort();
  } catch (const StateError& s) {
    std::fprintf(stderr, "kvforge fuzz: invariant broken: %s\n", s.what());
    std::abort();
  }
  return 0;
}
