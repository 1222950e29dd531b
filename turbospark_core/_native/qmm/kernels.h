// Quantized matmul kernels over MLX's affine layout (no MLX headers here).
//
// Layout (mx.quantize, affine): each weight row is a little-endian bit stream
// of K values of `bits` bits (value i at bit i*bits); scales and biases hold
// one entry per group of `group` values; w = q * scale + bias.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <vector>

namespace tsq {

// Cache-line aligned storage: a 64-byte load that straddles two lines costs
// about twice an aligned one, and the small-M kernels are bound by x's loads.
template <class T>
struct Aligned64 {
  using value_type = T;
  Aligned64() = default;
  template <class U>
  Aligned64(const Aligned64<U>&) {}
  T* allocate(std::size_t n) {
    void* p = std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64);
    if (p == nullptr) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, std::size_t) { std::free(p); }
  bool operator==(const Aligned64&) const { return true; }
  bool operator!=(const Aligned64&) const { return false; }
};
using Floats = std::vector<float, Aligned64<float>>;

enum ScaleType : int { kF32 = 0, kF16 = 1, kBF16 = 2, kE8M0 = 3 };  // kE8M0: uint8 exponents 2^(e - 127) (mxfp4)

// mxfp4's e2m1 values by code (sign bit 3); a weight is kFp4[code] times its group's scale.
inline constexpr float kFp4[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                   -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// Constant tables of the x86 unpacks of 2/3/5/6-bit values into LANES 32-bit lanes (8: AVX2, 16:
// AVX-512): lane i takes the 4 bytes from byte BITS * i / 8 of a 16-byte load broadcast to every
// 128-bit lane (a byte shuffle) and shifts them right by BITS * i % 8, leaving value i in its low
// BITS bits. Constant data, not a function-local static: a static's guard inside a kernel's loop
// is a possible call, and made the compiler keep the accumulators on the stack.
template <int BITS, int LANES>
struct Spread {
  static constexpr std::array<int8_t, 4 * LANES> shuf = [] {
    std::array<int8_t, 4 * LANES> a{};
    for (int i = 0; i < LANES; i++)
      for (int j = 0; j < 4; j++) a[4 * i + j] = (int8_t)std::min(15, BITS * i / 8 + j);
    return a;
  }();
  static constexpr std::array<int32_t, LANES> shift = [] {
    std::array<int32_t, LANES> a{};
    for (int i = 0; i < LANES; i++) a[i] = BITS * i % 8;
    return a;
  }();
};

struct QMat {
  const uint8_t* w;      // [N, K * bits / 8] bytes
  const void* scales;    // [N, K / group]
  const void* biases;    // [N, K / group]; null: symmetric, every bias is -2^(bits-1) * its scale
  int scale_type;        // ScaleType
  int64_t N, K;
  int group, bits;
  bool fp4 = false;      // mxfp4: 4-bit e2m1 codes times kE8M0 scales, no biases
};

// y[m, n] for n in [n0, n1), all m < M; x is [M, K] row-major, y is [M, ldy].
using RowsFn = void (*)(const QMat&, const float* x, int64_t M, float* y, int64_t ldy, int64_t n0, int64_t n1);
// Dequantize rows [n0, n1) into dst ([n1 - n0, K] row-major floats).
using DequantFn = void (*)(const QMat&, float* dst, int64_t n0, int64_t n1);

// One query of attention: y = softmax(scale * q . k_t over visible keys) . v, keys t < visible
// whose mask entry is true (mask may be null); k/v rows at strides ks/vs (floats), unit stride
// inside a row. p is scratch for T scores. A query's result depends on nothing else.
struct AttnRow {
  const float* q;
  const float* k;
  const float* v;
  const bool* mask;
  int64_t ks, vs, ms, T, D, Dv, visible;
  float scale;
  // whether key t gets no weight: past the causal limit, or false in the mask
  bool hidden(int64_t t) const { return t >= visible || (mask && !mask[t * ms]); }
};
using AttendFn = void (*)(const AttnRow&, float* p, float* y);
// n queries over one head's keys and values (rows[i] share k, v, their strides, T, D, Dv and the
// scale; each has its own q, mask and visible): ys[i] gets exactly what attend(rows[i]) gives.
// p is scratch for n * T scores. A set without its own kernel answers them one by one.
using AttendManyFn = void (*)(const AttnRow* rows, float* const* ys, int64_t n, float* p);
// A few queries split over threads (a decode step with fewer kv heads than threads): each part of
// the keys scored apart, each part of the value dims summed apart, every query's result bit for bit
// what attend_many gives it. Scores: keys [t0, t1) (t0 a multiple of 16) of rows[i] into p + i * T
// (-inf where hidden), the largest of them into top[i] (-inf: none). Values: dims [d0, d1) of
// ys[i] (d0 a multiple of 16, d1 too or the head's end) from the scores of all keys in p and each
// query's largest score top[i]; e is scratch for n * T weights. Both false where the head's sizes
// have no such kernel (nothing written).
using AttendScoresFn = bool (*)(const AttnRow* rows, int64_t n, int64_t t0, int64_t t1, float* p, float* top);
using AttendValuesFn = bool (*)(const AttnRow* rows, float* const* ys, int64_t n, const float* p, const float* top,
                                int64_t d0, int64_t d1, float* e);
template <AttendFn F>
void attend_each(const AttnRow* rows, float* const* ys, int64_t n, float* p) {
  for (int64_t i = 0; i < n; i++) F(rows[i], p, ys[i]);
}

void attend_scalar(const AttnRow&, float*, float*);

// y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w (w may be null) for rows r < rows of D values.
using RmsNormFn = void (*)(const float* x, int64_t x_stride, const float* w, float* y, int64_t rows, int64_t D, float eps);
// y[r, i] = act(g) * u with g = gate[r, i], u = up[r, i]: rows of n values at the given row strides;
// act is silu (g * sigmoid(g)) or gelu_tanh (0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3)))).
using GatedFn = void (*)(const float* gate, int64_t gs, const float* up, int64_t us, float* y, int64_t rows, int64_t n);
void rms_norm_scalar(const float*, int64_t, const float*, float*, int64_t, int64_t, float);
void silu_mul_scalar(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t);
void gelu_tanh_mul_scalar(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t);
void rows_scalar(const QMat&, const float*, int64_t, float*, int64_t, int64_t, int64_t);
void dequant_scalar(const QMat&, float*, int64_t, int64_t);
#if defined(__x86_64__) || defined(_M_X64)
void rows_avx2(const QMat&, const float*, int64_t, float*, int64_t, int64_t, int64_t);
void dequant_avx2(const QMat&, float*, int64_t, int64_t);
void attend_avx2(const AttnRow&, float*, float*);
void attend_avx512(const AttnRow&, float*, float*);
// AVX-512: heads up to 128 wide score each block of sixteen keys for all n queries while the block
// is in the core's cache, and add each block of values to every query's output likewise.
void attend_many_avx512(const AttnRow*, float* const*, int64_t, float*);
bool attend_scores_avx512(const AttnRow*, int64_t, int64_t, int64_t, float*, float*);
bool attend_values_avx512(const AttnRow*, float* const*, int64_t, const float*, const float*, int64_t, int64_t, float*);
void rms_norm_avx2(const float*, int64_t, const float*, float*, int64_t, int64_t, float);
void silu_mul_avx2(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t);
void gelu_tanh_mul_avx2(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t);
void rms_norm_avx512(const float*, int64_t, const float*, float*, int64_t, int64_t, float);
void silu_mul_avx512(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t);
void gelu_tanh_mul_avx512(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t);
// AVX-512: 4-bit weights in groups of 32k, 2/3/5/6/8-bit in groups of 16k; other layouts go to rows_avx2.
void rows_avx512(const QMat&, const float*, int64_t, float*, int64_t, int64_t, int64_t);
// AVX-512, 5/6-bit weights: rows of a multiple of 64 values by multishift where the CPU has
// AVX512-VBMI; else, in groups of 32k, lookup tables or convert-and-FMA (equal results bit for bit),
// the faster on this CPU measured at first use. path: -1 that choice (default), 0 tables, 1 convert.
void avx512_force_path(int path);
// AVX-512: many rows of x (K a multiple of 16): panels of 64 weight rows dequantized and
// transposed once, a 6 x 64 register tile per six rows of x.
void gemm_avx512(const QMat&, const float*, int64_t, float*, int64_t, int64_t, int64_t);
void dequant_avx512(const QMat&, float*, int64_t, int64_t);
#endif
#if defined(__aarch64__)
// NEON (aarch64, no run-time check): every layout (4-bit in groups of 32k and 8-bit in groups of
// 16k widened by TBL lookups, mxfp4 by a TBL value table). GEMM: panels of 16 dequantized weight
// rows, 4 x 16 register tiles.
void rows_neon(const QMat&, const float*, int64_t, float*, int64_t, int64_t, int64_t);
void dequant_neon(const QMat&, float*, int64_t, int64_t);
void gemm_neon(const QMat&, const float*, int64_t, float*, int64_t, int64_t, int64_t);
void attend_neon(const AttnRow&, float*, float*);
void rms_norm_neon(const float*, int64_t, const float*, float*, int64_t, int64_t, float);
void silu_mul_neon(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t);
void gelu_tanh_mul_neon(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t);
#endif

// mx.argmax's choice in x[0, n) and its value: the first NaN, else the first of the largest values;
// {-inf, -1} where every value is -inf. (A later value wins when strictly greater, or NaN.)
struct ArgMax {
  float value;
  int64_t index;
};
using ArgMaxFn = ArgMax (*)(const float* x, int64_t n);
ArgMax argmax_scalar(const float*, int64_t);
// Whether `a` (found later in the row) takes the place of `best`.
inline bool argmax_takes(float a, float best) { return a != a ? best == best : a > best; }
#if defined(__x86_64__) || defined(_M_X64)
ArgMax argmax_avx512(const float*, int64_t);
#endif

// One cached key or value row: `D` values in MLX's affine bit stream `w` (groups of `group`,
// `bits` bits; `biases` null: symmetric), dequantized into `out`, and with `rotate` the
// normalized Walsh-Hadamard transform of length D (a power of two) applied after.
using KVRowFn = void (*)(const uint8_t* w, const void* scales, const void* biases, int scale_type, int64_t D,
                         int group, int bits, bool rotate, float* out);
void kv_row_scalar(const uint8_t*, const void*, const void*, int, int64_t, int, int, bool, float*);
#if defined(__x86_64__) || defined(_M_X64)
void kv_row_avx512(const uint8_t*, const void*, const void*, int, int64_t, int, int, bool, float*);
#endif
#if defined(__aarch64__)
void kv_row_neon(const uint8_t*, const void*, const void*, int, int64_t, int, int, bool, float*);
#endif

// Bytes of one scale (or bias) of this ScaleType.
inline int64_t scale_bytes(int type) { return type == kF32 ? 4 : type == kE8M0 ? 1 : 2; }
float half_to_float(uint16_t h);
float e8m0_to_float(uint8_t e);
float load_scale(const void* p, int type, int64_t i);
// The bias of group i: stored, or -2^(bits-1) * scale for a symmetric matrix (exact: a power of two).
inline float symmetric_bias(const QMat& q, float scale) { return -(float)(1 << (q.bits - 1)) * scale; }

}  // namespace tsq
