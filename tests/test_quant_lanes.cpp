// The CUDA write's quantizer and gather, run on host lanes: the chunked quantizer's coverage of a
// token's elements and its codes, and one token through Ops' quantize and dequantize with a CUDA
// item's lanes emulated on threads, both against the independent reference quantizer; and an fp8
// index key coded over a warp's lanes, against vLLM's bytes.
#include <random>

#include "emulated_lanes.hpp"
#include "indexer_reference.hpp"
#include "record_traits.hpp"
#include "kvforge/detail/quant_ops.hpp"
#include "kvforge/detail/quant_chunks.hpp"
#include "kvforge/detail/write_ops.hpp"
#include "kvforge/backends/cpu/exec_cpu.hpp"
#include "quant_reference.hpp"

namespace kvtest {
namespace {

// The CUDA write's chunked quantizer (quant_chunks.hpp), run lane by lane on the host: its lanes
// cover each element of a token exactly once, a head's chunks lie in one aligned group of lanes (the
// group its scale is reduced over), and its per-chunk amax and packed encode give the reference's
// per-head scales and codes. A GPU runs the same steps, with shuffles for the group reduction.
template <class Store, class In, int H, int D, int MaxLanes = 32> void check_chunked_quantizer(DType storage, uint32_t seed) {
  using Chunks = detail::QuantChunks<Store, In, H, D, MaxLanes>;
  static_assert(Chunks::kUsable);
  ASSERT_LE(Chunks::L, MaxLanes);
  ASSERT_LE(Chunks::Lh, 32) << "a head's group reduces inside one warp";
  ASSERT_EQ(32 % Chunks::Lh, 0) << "a head's group never straddles two warps";
  std::vector<int> covered(static_cast<size_t>(H) * D, 0);
  for (int p = 0; p < Chunks::Q; ++p)
    for (int lane = 0; lane < Chunks::L; ++lane)
      for (int k = 0; k < Chunks::K; ++k) {
        int h, c;
        if (!Chunks::chunk_at(lane, p, k, h, c)) continue;
        ASSERT_EQ(lane / Chunks::Lh, h - p * Chunks::P) << "head " << h << " outside its lane group";
        for (int i = 0; i < Chunks::V; ++i) ++covered[size_t(h) * D + size_t(c) * Chunks::V + i];
      }
  for (size_t e = 0; e < covered.size(); ++e) ASSERT_EQ(covered[e], 1) << "element " << e;

  std::mt19937 rng(seed);
  std::vector<In> x(static_cast<size_t>(H) * D);
  std::vector<float> xf(x.size());
  for (size_t e = 0; e < x.size(); ++e) {
    const float value = std::ldexp(std::uniform_real_distribution<float>(-1.0f, 1.0f)(rng), int(e % 7) - 3);
    x[e] = from_float<In>(e == 5 ? INFINITY : value);  // a non-finite value counts 0 toward amax
    xf[e] = to_float(x[e]);
  }
  std::vector<Store> codes(x.size());  // operator new aligns it to 16 bytes
  const float qmax = ref_qmax(storage);
  for (int p = 0; p < Chunks::Q; ++p) {
    // The group reduction: every lane's chunk amax, then the maximum over the lanes of each head.
    std::vector<uint32_t> head_amax(static_cast<size_t>(H), 0);
    for (int lane = 0; lane < Chunks::L; ++lane)
      for (int k = 0; k < Chunks::K; ++k) {
        int h, c;
        if (Chunks::chunk_at(lane, p, k, h, c))
          head_amax[h] = std::max(head_amax[h], Chunks::amax(Chunks::load(x.data(), D, h, c)));
      }
    for (int lane = 0; lane < Chunks::L; ++lane)
      for (int k = 0; k < Chunks::K; ++k) {
        int h, c;
        if (!Chunks::chunk_at(lane, p, k, h, c)) continue;
        const float scale = to_float(detail::dynamic_scale<Store, float>(head_amax[h]));
        Chunks::encode(codes.data(), D, h, c, Chunks::load(x.data(), D, h, c), detail::ScaleDivisor(scale));
      }
  }
  for (int h = 0; h < H; ++h) {
    float amax = 0;
    for (int i = 0; i < D; ++i)
      if (std::isfinite(xf[size_t(h) * D + i])) amax = std::max(amax, std::fabs(xf[size_t(h) * D + i]));
    const float scale = ref_scale(DType::f32, amax, qmax);
    for (int i = 0; i < D; ++i) {
      const size_t e = size_t(h) * D + i;
      ASSERT_EQ(code_byte(codes[e]), ref_encode(storage, xf[e] / scale)) << "head " << h << " element " << i;
    }
  }
}

TEST(ChunkedQuantizer, CoversEveryElementOnceAndMatchesTheReference) {
  check_chunked_quantizer<int8_t, bf16, 8, 128>(DType::i8, 1);       // llama3-8b: 16 chunks a head, 2 heads a pass
  check_chunked_quantizer<fp8_e4m3, bf16, 5, 96>(DType::f8e4m3, 2);  // 12 chunks: every 8th lane takes two
  check_chunked_quantizer<fp8_e5m2, fp16, 3, 256>(DType::f8e5m2, 3); // 32 chunks: a head fills the warp
  check_chunked_quantizer<int8_t, bf16, 2, 512>(DType::i8, 4);       // 64 chunks: two per lane
  check_chunked_quantizer<int8_t, float, 7, 64>(DType::i8, 5);       // 16 chunks of 4 floats, 7 heads
  check_chunked_quantizer<int8_t, bf16, 1, 8>(DType::i8, 6);         // one chunk, one lane
  // Rows of chunks no power of two, at a bf16 token's width: groups of 8 lanes, many heads a pass.
  static_assert(detail::QuantChunks<int8_t, bf16, 32, 96, 256>::L == 256, "32 heads of 12 chunks fill 256 lanes");
  static_assert(detail::QuantChunks<int8_t, bf16, 32, 96, 256>::Q == 1, "in one pass");
  check_chunked_quantizer<int8_t, bf16, 32, 96, 256>(DType::i8, 11);       // phi-3-mini: 12 chunks, 32 heads
  check_chunked_quantizer<fp8_e4m3, bf16, 20, 80, 256>(DType::f8e4m3, 12);  // 10 chunks, a last pass part empty
  // Items wider than a warp (per-head and per-tensor scales): a pass covers more heads.
  check_chunked_quantizer<int8_t, bf16, 8, 128, 256>(DType::i8, 7);     // llama3-8b: 8 heads, 128 lanes, one pass
  check_chunked_quantizer<fp8_e4m3, bf16, 32, 128, 256>(DType::f8e4m3, 8);  // 16 heads a pass, two passes
  check_chunked_quantizer<int8_t, bf16, 7, 64, 256>(DType::i8, 9);      // 4 heads a pass, the last pass 3
  check_chunked_quantizer<int8_t, bf16, 5, 96, 256>(DType::i8, 10);     // 12 chunks: one head a pass, as at 32
}

// A quantized layout of any shape, as a spec could give it (ops.hpp reads these members).
template <class Store, class In, class ScaleT, Quant Q, int H, int D, int G = 0, bool TensorScaled = false>
struct ChunkedTraits {
  using storage_t = Store;
  using input_t = In;
  using scale_t = ScaleT;
  static constexpr int heads = H, head_dim = D, page_size = 0, window = 0, quant_group = G;
  static constexpr bool tensor_scaled = TensorScaled;
  static constexpr Addressing addressing = Addressing::contiguous;
  static constexpr Axis axes[] = {Axis::row, Axis::seq, Axis::head, Axis::dim};
  static constexpr Quant quant = Q;
};

template <class T> struct IsScaleZero : std::false_type {};
template <class S> struct IsScaleZero<ScaleZero<S>> : std::true_type {};

// A scale's initial value, to be overwritten; ue8m0 and e4m3 have no from_float.
template <class Scale> Scale scale_from_float(float x) {
  if constexpr (IsScaleZero<Scale>::value) return Scale{from_float<decltype(Scale::scale)>(x), from_float<decltype(Scale::zero)>(x)};
  else if constexpr (std::is_same_v<Scale, ue8m0>) return ue8m0{uint8_t(x > 0 ? 127 : 0xff)};
  else if constexpr (std::is_same_v<Scale, fp8_e4m3>) return fp8_e4m3{detail::E4M3::encode(x)};
  else return from_float<Scale>(x);
}

// One token through the CUDA write's quantizer (QuantOps::quantize_token_chunked, as its item body calls
// it; or, for a shape that takes it, the element path quantize_token) and back through its gather
// (dequantize_token_chunked, or decode_head per head), its lanes emulated, against the reference
// quantizer: codes, every stored scale, and the values read back.
template <class Traits, class Exec = EmulatedCudaExec>
void check_chunked_token(DType storage, DType input, DType scale_dtype, uint32_t seed) {
  using O = detail::QuantOps<Traits, Exec>;
  using Store = typename Traits::storage_t;
  using In = typename Traits::input_t;
  using Scale = typename Traits::scale_t;
  constexpr int H = Traits::heads, D = Traits::head_dim;
  VariantDescriptor d{};
  d.heads = H, d.head_dim = D, d.storage = storage, d.input = input, d.quant = Traits::quant, d.scale = scale_dtype;
  d.quant_group = Traits::quant_group;
  d.tensor_scaled = Traits::tensor_scaled;
  const int groups = ref_groups(d);
  std::mt19937 rng(seed);
  std::vector<In> x(static_cast<size_t>(H) * D);
  std::vector<float> xf(x.size());
  for (size_t e = 0; e < x.size(); ++e) {
    // Heads of different magnitudes, so that per-head and per-token scales differ.
    const float value = std::ldexp(std::uniform_real_distribution<float>(-1.0f, 1.0f)(rng), int(e / D % 5) - 2);
    x[e] = from_float<In>(e == 3 ? NAN : value);
    xf[e] = to_float(x[e]);
  }
  // A per-tensor scale; or a second level so small that the largest heads' group scales pass e4m3's 448
  // and saturate, while the smallest heads' do not.
  const float tensor_scale = Traits::tensor_scaled ? 0x1p-12f : 0.03125f;
  const float under = Traits::tensor_scaled ? tensor_scale : 1.0f;
  constexpr int kValues = kValuesPerElement<Store>;  // 2 for packed 4-bit codes
  std::vector<Store> codes(x.size() / kValues);
  std::vector<Scale> scales(static_cast<size_t>(H) * groups, scale_from_float<Scale>(Traits::quant == Quant::per_tensor ? tensor_scale : -1.0f));
  const bool converged = EmulatedLanes::run(O::kTokenLanes, [&](int lane) {
    if constexpr (O::kChunkedQuant) {
      typename O::ChunkRegs regs{};  // chunks past the row stay unread, as on the device
      if constexpr (O::Chunks::kPreload) O::load_chunks(regs, x.data(), D, lane, 0);
      O::quantize_token_chunked(regs, codes.data(), D, scales.data(), groups, under, x.data(), D, lane);
    } else {
      O::quantize_token(codes.data(), D / kValues, scales.data(), groups, under, x.data(), D, lane, O::kTokenLanes);
    }
  });
  ASSERT_TRUE(converged) << "the lanes did not all reach the same reductions";
  const RefToken want = ref_quantize(d, xf, tensor_scale);
  const int stored_scales = Traits::quant == Quant::per_group ? H * ref_groups(d) : Traits::quant == Quant::per_token_head ? H : 1;
  for (int h = 0; h < stored_scales; ++h) {
    if constexpr (IsScaleZero<Scale>::value) {
      ASSERT_EQ(to_float(scales[size_t(h)].scale), want.scales[size_t(h)]) << "scale " << h;
      ASSERT_EQ(to_float(scales[size_t(h)].zero), want.zeros[size_t(h)]) << "zero point " << h;
    } else {
      ASSERT_EQ(to_float(scales[size_t(h)]), want.scales[size_t(h)]) << "scale " << h;
    }
  }
  for (size_t e = 0; e < x.size(); ++e) {
    const uint8_t stored = code_byte(codes[e / kValues]);
    ASSERT_EQ(kValues == 1 ? stored : (stored >> (4 * (e % 2))) & 0xf, want.codes[e]) << "element " << e;
  }
  // And back, as the CUDA gather reads it: the token's K from `codes`, its V from a second copy.
  std::vector<Store> both(codes);
  both.insert(both.end(), codes.begin(), codes.end());
  std::vector<In> k_out(x.size()), v_out(x.size());
  const Scale* scale = scales.data();
  ASSERT_TRUE(EmulatedLanes::run(O::kTokenLanes, [&](int lane) {
    const int64_t scale_head = Traits::quant == Quant::per_token ? 0 : groups;
    if constexpr (O::kChunkedQuant) {
      O::dequantize_token_chunked(k_out.data(), D, v_out.data(), D, both.data(), D, int64_t(x.size()), scale, scale,
                                  scale_head, under, under, lane);
    } else {
      for (int h = 0; h < H; ++h) {
        const Store* k_row = both.data() + h * (D / kValues);
        O::decode_head(k_out.data() + h * D, k_row, scale + h * scale_head, under, lane, O::kTokenLanes);
        O::decode_head(v_out.data() + h * D, k_row + codes.size(), scale + h * scale_head, under, lane, O::kTokenLanes);
      }
    }
  }));
  for (size_t e = 0; e < x.size(); ++e) {
    ASSERT_TRUE(same_float(to_float(k_out[e]), want.gathered[e])) << "K element " << e;
    ASSERT_TRUE(same_float(to_float(v_out[e]), want.gathered[e])) << "V element " << e;
  }
}

TEST(ChunkedQuantizer, TokenAcrossEmulatedLanesMatchesTheReference) {
  // llama3-8b's shape in each granularity: 8 heads over 128 lanes, one chunk of K and one of V a lane,
  // a per-token scale reduced across the item's four warps.
  check_chunked_token<ChunkedTraits<int8_t, bf16, float, Quant::per_token, 8, 128>>(DType::i8, DType::bf16, DType::f32, 1);
  check_chunked_token<ChunkedTraits<int8_t, bf16, bf16, Quant::per_token_head, 8, 128>>(DType::i8, DType::bf16, DType::bf16, 2);
  check_chunked_token<ChunkedTraits<fp8_e4m3, bf16, float, Quant::per_tensor, 8, 128>>(DType::f8e4m3, DType::bf16, DType::f32, 3);
  // Too many chunks to hold: a pass at a time, and a per-token scale's two sweeps.
  check_chunked_token<ChunkedTraits<int8_t, float, float, Quant::per_token, 8, 128>>(DType::i8, DType::f32, DType::f32, 4);
  check_chunked_token<ChunkedTraits<fp8_e5m2, fp16, float, Quant::per_token_head, 6, 256>>(DType::f8e5m2, DType::f16, DType::f32, 5);
  // Two chunks a lane, uneven lanes (12 chunks over 8), and a last pass half empty (7 heads).
  check_chunked_token<ChunkedTraits<int8_t, bf16, float, Quant::per_token_head, 2, 512>>(DType::i8, DType::bf16, DType::f32, 6);
  check_chunked_token<ChunkedTraits<fp8_e4m3, bf16, bf16, Quant::per_token, 5, 96>>(DType::f8e4m3, DType::bf16, DType::bf16, 7);
  check_chunked_token<ChunkedTraits<int8_t, fp16, float, Quant::per_token_head, 7, 64>>(DType::i8, DType::f16, DType::f32, 8);
  // 32 heads over 256 lanes (eight warps), two passes, per token and per head.
  check_chunked_token<ChunkedTraits<int8_t, bf16, float, Quant::per_token, 32, 128>>(DType::i8, DType::bf16, DType::f32, 9);
  check_chunked_token<ChunkedTraits<fp8_e4m3, bf16, bf16, Quant::per_token_head, 32, 128>>(DType::f8e4m3, DType::bf16, DType::bf16, 10);
  // 12 chunks a head (head_dim 96), 32 heads over 256 lanes in groups of 8: a per-token scale over eight
  // warps, a per-head one over each group of 8.
  check_chunked_token<ChunkedTraits<int8_t, bf16, float, Quant::per_token, 32, 96>>(DType::i8, DType::bf16, DType::f32, 11);
  check_chunked_token<ChunkedTraits<int8_t, bf16, float, Quant::per_token_head, 32, 96>>(DType::i8, DType::bf16, DType::f32, 12);
}

TEST(ChunkedQuantizer, PerGroupScalesAcrossEmulatedLanesMatchTheReference) {
  // MXFP8 on llama3-8b's shape: 4 groups of 32 a head, each reduced over 4 lanes of its head's 16.
  check_chunked_token<ChunkedTraits<fp8_e4m3, bf16, ue8m0, Quant::per_group, 8, 128, 32>>(DType::f8e4m3, DType::bf16,
                                                                                           DType::ue8m0, 21);
  // 16 of fp16 a group (2 chunks), bf16 scales; fp32 inputs, 4 chunks a group.
  check_chunked_token<ChunkedTraits<int8_t, fp16, bf16, Quant::per_group, 2, 64, 16>>(DType::i8, DType::f16, DType::bf16, 22);
  check_chunked_token<ChunkedTraits<int8_t, float, float, Quant::per_group, 4, 64, 16>>(DType::i8, DType::f32, DType::f32, 23);
  // A whole warp a head (32 chunks), groups of 128 over 16 lanes, 3 heads in passes of 8 lanes-groups.
  check_chunked_token<ChunkedTraits<fp8_e5m2, bf16, float, Quant::per_group, 3, 256, 128>>(DType::f8e5m2, DType::bf16,
                                                                                          DType::f32, 24);
  // 32 heads of 32, two passes; and 12 chunks a head (head_dim 96): no whole groups of lanes, so the
  // element path, its groups reduced over the lanes that stride the row.
  check_chunked_token<ChunkedTraits<int8_t, bf16, ue8m0, Quant::per_group, 32, 32, 16>>(DType::i8, DType::bf16, DType::ue8m0, 25);
  check_chunked_token<ChunkedTraits<int8_t, bf16, float, Quant::per_group, 5, 96, 32>>(DType::i8, DType::bf16, DType::f32, 26);
  static_assert(!detail::Ops<ChunkedTraits<int8_t, bf16, float, Quant::per_group, 5, 96, 32>, EmulatedCudaExec>::kChunkedQuant);
}

TEST(ChunkedQuantizer, PackedCodesTakeTheElementPathAcrossEmulatedLanes) {
  // 4-bit codes, two a byte: each lane takes pairs of a row. MXFP4 on llama3-8b's shape; int4 per head
  // and per group; fp4 per token over an odd count of heads.
  check_chunked_token<ChunkedTraits<fp4_e2m1x2, bf16, ue8m0, Quant::per_group, 8, 128, 32>>(DType::f4e2m1, DType::bf16,
                                                                                             DType::ue8m0, 31);
  check_chunked_token<ChunkedTraits<int4x2, fp16, bf16, Quant::per_group, 2, 64, 16>>(DType::i4, DType::f16, DType::bf16, 32);
  check_chunked_token<ChunkedTraits<int4x2, bf16, float, Quant::per_token_head, 3, 96>>(DType::i4, DType::bf16, DType::f32, 33);
  check_chunked_token<ChunkedTraits<fp4_e2m1x2, float, float, Quant::per_token, 5, 16>>(DType::f4e2m1, DType::f32, DType::f32, 34);
  static_assert(!detail::Ops<ChunkedTraits<fp4_e2m1x2, bf16, ue8m0, Quant::per_group, 8, 128, 32>, EmulatedCudaExec>::kChunkedQuant);
  // Groups as wide as the warp's pass (int4 per 64: 32 bytes), and wider (fp4 per 128: two passes).
  check_chunked_token<ChunkedTraits<int4x2, bf16, bf16, Quant::per_group, 3, 64, 64>>(DType::i4, DType::bf16, DType::bf16, 35);
  check_chunked_token<ChunkedTraits<fp4_e2m1x2, bf16, float, Quant::per_group, 2, 256, 128>>(DType::f4e2m1, DType::bf16,
                                                                                             DType::f32, 36);
}

TEST(ChunkedQuantizer, ZeroPointCodesAcrossEmulatedLanesAndOneLaneMatchTheReference) {
  // uint4 around each group's zero point (lmdeploy's int4): per head, as the default spec stores it, and
  // per group of 16, 32 and 128 (wider than a warp's pass of pairs); on a CUDA item's emulated lanes,
  // each group's range reduced over them, and on the CPU's one lane, which stages the whole token.
  using ZeroBf16 = ScaleZero<bf16>;
  using ZeroF32 = ScaleZero<float>;
  check_chunked_token<ChunkedTraits<uint4x2, bf16, ZeroBf16, Quant::per_token_head, 8, 128>>(DType::u4, DType::bf16, DType::bf16_zero, 61);
  check_chunked_token<ChunkedTraits<uint4x2, fp16, ZeroBf16, Quant::per_group, 2, 64, 16>>(DType::u4, DType::f16, DType::bf16_zero, 62);
  check_chunked_token<ChunkedTraits<uint4x2, float, ZeroF32, Quant::per_group, 3, 96, 32>>(DType::u4, DType::f32, DType::f32_zero, 63);
  check_chunked_token<ChunkedTraits<uint4x2, bf16, ZeroBf16, Quant::per_group, 2, 256, 128>>(DType::u4, DType::bf16, DType::bf16_zero, 64);
  using OneLane = detail::CpuExec<2>;
  check_chunked_token<ChunkedTraits<uint4x2, bf16, ZeroBf16, Quant::per_token_head, 8, 128>, OneLane>(DType::u4, DType::bf16, DType::bf16_zero, 65);
  check_chunked_token<ChunkedTraits<uint4x2, fp16, ZeroBf16, Quant::per_group, 2, 64, 16>, OneLane>(DType::u4, DType::f16, DType::bf16_zero, 66);
  check_chunked_token<ChunkedTraits<uint4x2, float, ZeroF32, Quant::per_group, 3, 96, 32>, OneLane>(DType::u4, DType::f32, DType::f32_zero, 67);
}

TEST(ChunkedQuantizer, TensorScaledGroupsAcrossEmulatedLanesMatchTheReference) {
  // NVFP4 on llama3-8b's shape: e4m3 scales per 16 under a tensor scale, on the element path; and e4m3
  // scales under a tensor scale over fp8 codes, which the chunked path takes (2 lanes a group).
  check_chunked_token<ChunkedTraits<fp4_e2m1x2, bf16, fp8_e4m3, Quant::per_group, 8, 128, 16, true>>(
      DType::f4e2m1, DType::bf16, DType::f8e4m3, 41);
  check_chunked_token<ChunkedTraits<fp8_e4m3, bf16, fp8_e4m3, Quant::per_group, 4, 64, 16, true>>(
      DType::f8e4m3, DType::bf16, DType::f8e4m3, 42);
  static_assert(detail::Ops<ChunkedTraits<fp8_e4m3, bf16, fp8_e4m3, Quant::per_group, 4, 64, 16, true>,
                            EmulatedCudaExec>::kChunkedQuant);
}

// The CPU write's tile path (several tokens of a head-major row at once, WriteOps::quantize_tile) for
// zero-point codes: each token's codes, scales and zero points as the reference gives them. Only layouts
// whose positions lie inside a head's run take it (JetStream's, FlashInfer's HND); the default spec's
// NHD pages do not, and a variant over HND failed to compile before the path knew zero points.
TEST(ZeroPointTile, EachTokenOfATileMatchesTheReference) {
  using Traits = ChunkedTraits<uint4x2, bf16, ScaleZero<bf16>, Quant::per_group, 3, 64, 16>;
  using Write = detail::WriteOps<Traits, detail::CpuExec<2>>;
  constexpr int H = 3, D = 64, G = D / 16, n = 4;
  VariantDescriptor d{};
  d.heads = H, d.head_dim = D, d.storage = DType::u4, d.input = DType::bf16, d.quant = Quant::per_group;
  d.scale = DType::bf16_zero, d.quant_group = 16;
  std::mt19937 rng(71);
  std::vector<std::vector<bf16>> x(n, std::vector<bf16>(size_t(H) * D));
  std::vector<std::vector<uint4x2>> codes(n, std::vector<uint4x2>(size_t(H) * D / 2));
  std::vector<std::vector<ScaleZero<bf16>>> scales(n, std::vector<ScaleZero<bf16>>(size_t(H) * G));
  uint4x2* dst[n];
  ScaleZero<bf16>* scale[n];
  const bf16* src[n];
  const float tensor[n] = {1.0f, 1.0f, 1.0f, 1.0f};
  for (int j = 0; j < n; ++j) {
    for (auto& v : x[size_t(j)]) v = from_float<bf16>(std::uniform_real_distribution<float>(-2.0f, 6.0f)(rng) * float(j + 1));
    dst[j] = codes[size_t(j)].data(), scale[j] = scales[size_t(j)].data(), src[j] = x[size_t(j)].data();
  }
  Write::quantize_tile(dst, 0, D / 2, scale, G, tensor, src, D, n);
  for (int j = 0; j < n; ++j) {
    std::vector<float> xf(x[size_t(j)].size());
    for (size_t e = 0; e < xf.size(); ++e) xf[e] = to_float(x[size_t(j)][e]);
    const RefToken want = ref_quantize(d, xf, 1.0f);
    for (int g = 0; g < H * G; ++g) {
      ASSERT_EQ(to_float(scales[size_t(j)][size_t(g)].scale), want.scales[size_t(g)]) << "token " << j << " group " << g;
      ASSERT_EQ(to_float(scales[size_t(j)][size_t(g)].zero), want.zeros[size_t(g)]) << "token " << j << " group " << g;
    }
    for (size_t e = 0; e < xf.size(); ++e)
      ASSERT_EQ((codes[size_t(j)][e / 2].bits >> (4 * (e % 2))) & 0xf, want.codes[e]) << "token " << j << " element " << e;
  }
}

// DeepSeek-V3.2's index key of 256 values (record_traits.hpp) coded on a CUDA item's 32 lanes, emulated
// (PartRecord::encode, as the CUDA write calls it): a group of 128 over 16 lanes, 8 values each, its amax
// one reduction over them; vLLM's bytes (indexer_reference.hpp) at every scale edge.
TEST(IndexKeyOnEmulatedLanes, AWarpCodesVllmsBytesAtEachScaleEdge) {
  using Key = detail::PartRecord<IndexKeyTraits<256>>;
  for (const std::vector<float>& x : ref_index_edge_keys()) {
    const RefRecord want = ref_index_key(x, DType::f32);
    std::vector<uint8_t> codes(256, 0xee), scales(8, 0xee);
    ASSERT_TRUE(EmulatedLanes::run(32, [&](int lane) {
      Key::encode<EmulatedCudaExec, 32>(x.data(), x.data() + Key::D, codes.data(), codes.data() + Key::kSplit, scales.data(),
                                        lane);
    }));
    ASSERT_EQ(codes, std::vector<uint8_t>(want.bytes.begin(), want.bytes.begin() + 256)) << "amax " << x[0];
    ASSERT_EQ(scales, std::vector<uint8_t>(want.bytes.begin() + 256, want.bytes.end())) << "amax " << x[0];
  }
}

// One CPU lane's amaxes over a whole token (row_codecs.hpp's group_amaxes: pairs of neighbours folded
// for groups of up to 16, a loop a group otherwise), against a loop over each group's values
// in floats: the largest finite |x|, 0 for a group of none. Inputs are random bit patterns, so infinities,
// NaNs and subnormals all occur; rows are strided (src_head past D).
template <class In, int H, int D, int G> void check_group_amaxes(uint32_t seed) {
  constexpr int64_t src_head = D + 8;
  std::mt19937 rng(seed);
  std::vector<In> x(static_cast<size_t>(H) * src_head);
  for (int rep = 0; rep < 50; ++rep) {
    for (In& v : x) {
      const uint32_t bits = rng();
      if constexpr (sizeof(In) == 2) v = In{uint16_t(bits)};
      else std::memcpy(&v, &bits, 4);
    }
    std::vector<uint32_t> amax(static_cast<size_t>(H) * (D / G), 0xdeadbeefu);
    detail::group_amaxes<H, D, G, detail::CpuExec<2>>(amax.data(), x.data(), src_head);
    for (int h = 0; h < H; ++h)
      for (int g = 0; g < D / G; ++g) {
        float m = 0.0f;
        for (int i = 0; i < G; ++i) {
          const float v = to_float(x[size_t(h) * src_head + size_t(g) * G + i]);
          if (std::isfinite(v)) m = std::max(m, std::fabs(v));
        }
        uint32_t want;
        std::memcpy(&want, &m, 4);
        ASSERT_EQ(amax[size_t(h) * (D / G) + g], want) << "head " << h << ", group " << g << ", round " << rep;
      }
  }
}

TEST(OneLaneGroupAmaxes, EqualALoopOverEachGroupsFiniteValues) {
  check_group_amaxes<bf16, 8, 128, 16>(51);    // NVFP4 on llama3-8b's shape: folded
  check_group_amaxes<fp16, 2, 64, 8>(52);
  check_group_amaxes<float, 3, 64, 2>(53);
  check_group_amaxes<bf16, 4, 64, 32>(56);     // MXFP4's groups: a loop a group
  check_group_amaxes<bf16, 3, 96, 96>(54);     // a per_token_head row of 96: a loop a group
  check_group_amaxes<float, 128, 192, 16>(55); // 24576 values, past the folded path's buffer
}

}  // namespace
}  // namespace kvtest
