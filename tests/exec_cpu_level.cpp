// CpuExec's vector hooks (exec_cpu_levels.hpp) compiled for one x86-64 level (KVF_TEST_LEVEL, with that
// level's -march), for test_code_rows.cpp and test_attend_tiles.cpp to run where the CPU has the level. The library's kernels get it the same way:
// a generated file per level (cpu_ops.hpp).
#include "exec_cpu_levels.hpp"

#include "kvforge/backends/cpu/exec_cpu.hpp"

#define KVF_TEST_CAT2(a, b) a##b
#define KVF_TEST_CAT(a, b) KVF_TEST_CAT2(a, b)

namespace kvtest {
namespace {

using Exec = kvforge::detail::CpuExec<KVF_TEST_LEVEL>;

template <class Code> void encode_from(kvforge::DType in, Code* dst, const void* src, float scale, int n) {
  static_assert(kvforge::detail::code_rows::width<KVF_TEST_LEVEL, Code>() > 1,
                "this file must be compiled with its level's -march");
  switch (in) {
    case kvforge::DType::bf16: return Exec::encode_code_row(dst, static_cast<const kvforge::bf16*>(src), scale, n);
    case kvforge::DType::f16: return Exec::encode_code_row(dst, static_cast<const kvforge::fp16*>(src), scale, n);
    default: return Exec::encode_code_row(dst, static_cast<const float*>(src), scale, n);
  }
}

}  // namespace

void KVF_TEST_CAT(encode_code_row_v, KVF_TEST_LEVEL)(kvforge::DType code, kvforge::DType in, void* dst, const void* src,
                                                     float scale, int n) {
  switch (code) {
    case kvforge::DType::i8: return encode_from(in, static_cast<int8_t*>(dst), src, scale, n);
    case kvforge::DType::f8e4m3: return encode_from(in, static_cast<kvforge::fp8_e4m3*>(dst), src, scale, n);
    default: return encode_from(in, static_cast<kvforge::fp8_e5m2*>(dst), src, scale, n);
  }
}

void KVF_TEST_CAT(decode_code_row_v, KVF_TEST_LEVEL)(kvforge::DType code, float* dst, const void* src, float scale, int n) {
  static_assert(kvforge::detail::code_rows::decode_width<KVF_TEST_LEVEL, int8_t>() > 1,
                "this file must be compiled with its level's -march");
  switch (code) {
    case kvforge::DType::i8: return Exec::decode_code_row(dst, static_cast<const int8_t*>(src), scale, n);
    case kvforge::DType::f8e4m3: return Exec::decode_code_row(dst, static_cast<const kvforge::fp8_e4m3*>(src), scale, n);
    default: return Exec::decode_code_row(dst, static_cast<const kvforge::fp8_e5m2*>(src), scale, n);
  }
}

bool KVF_TEST_CAT(attend_scores_v, KVF_TEST_LEVEL)(float* scores, int ss, const float* q, int qs, const float* keys,
                                                  int ks, int rows, int nb, int kw) {
  return Exec::attend_scores(scores, ss, q, qs, keys, ks, rows, nb, kw);
}

bool KVF_TEST_CAT(attend_exp_sum_v, KVF_TEST_LEVEL)(float* s, int n, float m, float& sum) {
  return Exec::attend_exp_sum(s, n, m, sum);
}

bool KVF_TEST_CAT(attend_accumulate_v, KVF_TEST_LEVEL)(float* acc, int as, const float* w, int ws, const float* values,
                                                      int vs, int rows, int nb, int vw) {
  return Exec::attend_accumulate(acc, as, w, ws, values, vs, rows, nb, vw);
}

}  // namespace kvtest
