// CpuExec's vector hooks of each vector level (exec_cpu_level.cpp, compiled once a level):
//   - the 8-bit row encoder: n values of dtype `in` (bf16, f16 or f32) at src into codes of dtype `code`
//     (i8, f8e4m3 or f8e5m2) of value / scale at dst; and back, n codes at src into fp32 values times
//     scale at dst (test_code_rows.cpp);
//   - attention's block products (test_attend_tiles.cpp): scores[r * ss + j] = q[r * qs, +kw) .
//     keys[j * ks, +kw); s[j] = e^(s[j] - m) and their sum; and acc[r * as + e] += sum over j of
//     w[r * ws + j] * values[j * vs + e]; each false where the level takes the portable loop.
#pragma once

#include "kvforge/dtype.hpp"

namespace kvtest {

void encode_code_row_v3(kvforge::DType code, kvforge::DType in, void* dst, const void* src, float scale, int n);
void encode_code_row_v4(kvforge::DType code, kvforge::DType in, void* dst, const void* src, float scale, int n);
void decode_code_row_v3(kvforge::DType code, float* dst, const void* src, float scale, int n);
void decode_code_row_v4(kvforge::DType code, float* dst, const void* src, float scale, int n);
bool attend_scores_v3(float* scores, int ss, const float* q, int qs, const float* keys, int ks, int rows, int nb, int kw);
bool attend_scores_v4(float* scores, int ss, const float* q, int qs, const float* keys, int ks, int rows, int nb, int kw);
bool attend_exp_sum_v3(float* s, int n, float m, float& sum);
bool attend_exp_sum_v4(float* s, int n, float m, float& sum);
bool attend_accumulate_v3(float* acc, int as, const float* w, int ws, const float* values, int vs, int rows, int nb, int vw);
bool attend_accumulate_v4(float* acc, int as, const float* w, int ws, const float* values, int vs, int rows, int nb, int vw);

}  // namespace kvtest
