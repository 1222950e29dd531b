// Quantized matmul kernels over MLX's affine layout (no MLX headers here).
//
// Layout (mx.quantize, affine): each weight row is a little-endian bit stream
// of K values of `bits` bits (value i at bit i*bits); scales and biases hold
// one entry per group of `group` values; w = q * scale + bias.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tsq {

enum ScaleType : int { kF32 = 0, kF16 = 1, kBF16 = 2 };

struct QMat {
  const uint8_t* w;      // [N, K * bits / 8] bytes
  const void* scales;    // [N, K / group]
  const void* biases;    // [N, K / group]
  int scale_type;        // ScaleType
  int64_t N, K;
  int group, bits;
};

// y[m, n] for n in [n0, n1), all m < M; x is [M, K] row-major, y is [M, ldy].
using RowsFn = void (*)(const QMat&, const float* x, int64_t M, float* y, int64_t ldy, int64_t n0, int64_t n1);
// Dequantize rows [n0, n1) into dst ([n1 - n0, K] row-major floats).
using DequantFn = void (*)(const QMat&, float* dst, int64_t n0, int64_t n1);

void rows_scalar(const QMat&, const float*, int64_t, float*, int64_t, int64_t, int64_t);
void dequant_scalar(const QMat&, float*, int64_t, int64_t);
#if defined(__x86_64__) || defined(_M_X64)
void rows_avx2(const QMat&, const float*, int64_t, float*, int64_t, int64_t, int64_t);
void dequant_avx2(const QMat&, float*, int64_t, int64_t);
#endif

float half_to_float(uint16_t h);
float load_scale(const void* p, int type, int64_t i);

}  // namespace tsq
