// The 8-bit row encoder and decoder of each vector level (code_rows_level.cpp, compiled once a level): n values of
// dtype `in` (bf16, f16 or f32) at src into codes of dtype `code` (i8, f8e4m3 or f8e5m2) of
// value / scale at dst; and back, n codes at src into fp32 values times scale at dst.
#pragma once

#include "kvforge/dtype.hpp"

namespace kvtest {

void encode_code_row_v3(kvforge::DType code, kvforge::DType in, void* dst, const void* src, float scale, int n);
void encode_code_row_v4(kvforge::DType code, kvforge::DType in, void* dst, const void* src, float scale, int n);
void decode_code_row_v3(kvforge::DType code, float* dst, const void* src, float scale, int n);
void decode_code_row_v4(kvforge::DType code, float* dst, const void* src, float scale, int n);

}  // namespace kvtest
