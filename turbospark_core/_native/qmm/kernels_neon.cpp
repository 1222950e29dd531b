// NEON (Advanced SIMD) kernels for aarch64: Linux arm64 (Graviton, Ampere, ...) and Apple
// silicon. Advanced SIMD is part of every ARMv8-A CPU, so this file needs no flags beyond
// -ffp-contract=off (every tile rounds alike) and no run-time check; it uses nothing past
// plain armv8-a (half-precision scales convert with FCVTL, which is base ARMv8). Checked for
// correctness under emulation (tests/native_kernels); not yet timed on arm64 hardware.
//
// Quantized rows (y = x @ dequantize(w).T): every weight is dequantized to fma(q, scale, bias)
// and a row's sum is the plain dot product of the dequantized row with x.
// - 8-bit in groups of 16k and 4-bit in groups of 32k: sixteen one-byte codes at a time go
//   through TBL lookups that put each code in its own 32-bit lane (four TBLs, four converts and
//   four FMAs for sixteen weights). 4-bit bytes hold weights 2i (low nibble) and 2i+1 (high
//   nibble), so each 32 values of x are read as their 16 even then their 16 odd ones.
//   (Per-group tables of the sixteen 4-bit values, AVX-512's design, cost as many instructions
//   per weight on NEON - four TBLs and eight zips to assemble floats from byte planes - plus
//   twelve to build each group's table and four registers per weight row.)
// - mxfp4: the same bytes, each e2m1 code's value looked up by TBL in a constant table (four
//   byte planes of kFp4) and multiplied by its group's power-of-two scale.
// - every other layout (2/3/5/6 bits, 4-bit in groups of 8 or 16, 8-bit in groups of 8): eight
//   values at a time from exactly their BITS bytes, broadcast, shifted per lane and masked.
// R weight rows and MT rows of x are computed together: a chunk of weights is decoded once for
// all MT rows, an x vector loaded once for all R weight rows (see row_blocks for the shapes).
//
// Summation order (the invariant): every product y[m, n] has one accumulator of four lanes, and
// FMAs go into it in the same sequence whatever tile computes it: chunk by chunk, and within a
// chunk vector by vector (4-bit: the four vectors of even values, then the four of odd ones).
// The lanes are then summed as (l0 + l1) + (l2 + l3) (FADDP twice: four accumulators reduced
// together give each the same tree as one alone). Which decoder runs depends only on the
// layout. So a row of x gets the same bits whatever rows share its tile, whatever weight-row
// block or thread chunk computes it: a batched row equals the row alone, bit for bit.
//
// GEMM for many rows of x: panels of 16 weight rows dequantized once and transposed to
// [K][16], a 4 x 16 register tile per four rows of x (one FMA chain per output along k, so a
// row's result does not depend on the others either).
#include <arm_neon.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels.h"

namespace tsq {
namespace {

inline float scale_at(const void* p, int type, int64_t i) {
  if (type == kF32) return static_cast<const float*>(p)[i];
  if (type == kE8M0) return e8m0_to_float(static_cast<const uint8_t*>(p)[i]);
  const uint16_t h = static_cast<const uint16_t*>(p)[i];
  if (type == kF16) return vgetq_lane_f32(vcvt_f32_f16(vreinterpret_f16_u16(vdup_n_u16(h))), 0);
  const uint32_t bits = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Scales (or biases) [first, first + n) as float32 into out.
void to_f32(const void* p, int type, int64_t first, int64_t n, float* out) {
  if (type == kF32) {
    std::memcpy(out, static_cast<const float*>(p) + first, sizeof(float) * n);
    return;
  }
  if (type == kE8M0) {
    for (int64_t i = 0; i < n; i++) out[i] = e8m0_to_float(static_cast<const uint8_t*>(p)[first + i]);
    return;
  }
  const uint16_t* h = static_cast<const uint16_t*>(p) + first;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const uint16x4_t v = vld1_u16(h + i);
    vst1q_f32(out + i, type == kF16 ? vcvt_f32_f16(vreinterpret_f16_u16(v)) : vreinterpretq_f32_u32(vshll_n_u16(v, 16)));
  }
  for (; i < n; i++) out[i] = scale_at(p, type, first + i);
}

// The four lanes summed as (l0 + l1) + (l2 + l3).
inline float hsum(float32x4_t v) {
  const float32x4_t p = vpaddq_f32(v, v);
  return vgetq_lane_f32(vpaddq_f32(p, p), 0);
}

// n < 4 floats from p into the low lanes (the others zero), and back.
inline float32x4_t load_part(const float* p, int64_t n) {
  float t[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  std::memcpy(t, p, sizeof(float) * n);
  return vld1q_f32(t);
}
inline void store_part(float* p, int64_t n, float32x4_t v) {
  float t[4];
  vst1q_f32(t, v);
  std::memcpy(p, t, sizeof(float) * n);
}
// floats [i, i + 4) of a row of n (fewer at its end: zeros past it)
inline float32x4_t load4(const float* p, int64_t i, int64_t n) {
  return n - i >= 4 ? vld1q_f32(p + i) : load_part(p + i, n - i);
}
inline void store4(float* p, int64_t i, int64_t n, float32x4_t v) {
  if (n - i >= 4) {
    vst1q_f32(p + i, v);
  } else {
    store_part(p + i, n - i, v);
  }
}

// e^x (Cephes' expf polynomial, within ~1 ulp; inputs clamped to +-88.3), lane by lane:
// a value's result does not depend on its lane or its neighbours.
inline float32x4_t exp_ps(float32x4_t x) {
  x = vminq_f32(vmaxq_f32(x, vdupq_n_f32(-88.3762626647949f)), vdupq_n_f32(88.3762626647949f));
  const float32x4_t n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(1.44269504088896341f)));
  float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(0.693359375f));
  r = vfmsq_f32(r, n, vdupq_n_f32(-2.12194440e-4f));
  float32x4_t p = vdupq_n_f32(1.9875691500E-4f);
  p = vfmaq_f32(vdupq_n_f32(1.3981999507E-3f), p, r);
  p = vfmaq_f32(vdupq_n_f32(8.3334519073E-3f), p, r);
  p = vfmaq_f32(vdupq_n_f32(4.1665795894E-2f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.6666665459E-1f), p, r);
  p = vfmaq_f32(vdupq_n_f32(5.0000001201E-1f), p, r);
  p = vfmaq_f32(vaddq_f32(r, vdupq_n_f32(1.0f)), p, vmulq_f32(r, r));
  // times 2^n: n (in [-128, 128]) added to the exponent in two halves so that 2^n never overflows
  const int32x4_t ni = vcvtq_s32_f32(n);
  const int32x4_t half = vshrq_n_s32(ni, 1);
  const float32x4_t a = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(half, vdupq_n_s32(127)), 23));
  const float32x4_t b = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(vsubq_s32(ni, half), vdupq_n_s32(127)), 23));
  return vmulq_f32(vmulq_f32(p, a), b);
}

template <class T>
inline T load_le(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Eight consecutive BITS-bit values from p (BITS bytes hold exactly eight, and exactly those
// are read) in 32-bit lanes: values 0-3 in lo, 4-7 in hi.
template <int BITS>
inline void unpack8(const uint8_t* p, uint32x4_t& lo, uint32x4_t& hi) {
  if constexpr (BITS == 8) {
    const uint16x8_t w = vmovl_u8(vld1_u8(p));
    lo = vmovl_u16(vget_low_u16(w));
    hi = vmovl_high_u16(w);
  } else if constexpr (BITS == 4) {
    const uint8x8_t b = vreinterpret_u8_u32(vdup_n_u32(load_le<uint32_t>(p)));
    // byte i holds values 2i (low nibble) and 2i+1: interleaved back into order
    const uint16x8_t w = vmovl_u8(vzip1_u8(vand_u8(b, vdup_n_u8(0xf)), vshr_n_u8(b, 4)));
    lo = vmovl_u16(vget_low_u16(w));
    hi = vmovl_high_u16(w);
  } else {
    uint64_t word;  // the BITS bytes as one little-endian word (no read past them, no branch)
    if constexpr (BITS == 2) {
      word = load_le<uint16_t>(p);
    } else if constexpr (BITS == 3) {
      word = load_le<uint16_t>(p) | (uint64_t)p[2] << 16;
    } else if constexpr (BITS == 5) {
      word = load_le<uint32_t>(p) | (uint64_t)p[4] << 32;
    } else {
      static_assert(BITS == 6);
      word = load_le<uint32_t>(p) | (uint64_t)load_le<uint16_t>(p + 4) << 32;
    }
    const int32x4_t shifts = {0, -BITS, -2 * BITS, -3 * BITS};  // right shifts
    const uint32x4_t mask = vdupq_n_u32((1u << BITS) - 1);
    lo = vandq_u32(vshlq_u32(vdupq_n_u32((uint32_t)word), shifts), mask);
    hi = vandq_u32(vshlq_u32(vdupq_n_u32((uint32_t)(word >> (4 * BITS))), shifts), mask);
  }
}

// y[(m0 + t) * ldy + n + r] = the lane sum of acc[r][t]; four at a time by pairwise adds
// (each sum the same (l0 + l1) + (l2 + l3) as hsum).
template <int R, int MT>
inline void store_sums(const float32x4_t (&acc)[R][MT], int64_t m0, float* y, int64_t ldy, int64_t n) {
  constexpr int NS = R * MT, FOURS = NS / 4 * 4;
  const float32x4_t* a = &acc[0][0];
  float out[NS];
#pragma GCC unroll 8
  for (int i = 0; i < FOURS; i += 4)
    vst1q_f32(out + i, vpaddq_f32(vpaddq_f32(a[i], a[i + 1]), vpaddq_f32(a[i + 2], a[i + 3])));
#pragma GCC unroll 4
  for (int i = FOURS; i < NS; i++) out[i] = hsum(a[i]);
  for (int r = 0; r < R; r++)
    for (int t = 0; t < MT; t++) y[(m0 + t) * ldy + n + r] = out[r * MT + t];
}

// Per-thread scratch: a block's scales and biases as float32; x as the 4-bit kernels read it.
struct Scratch {
  std::vector<float> scales, biases, xp;
};
Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

// ------------------------------------------------------------ decoders: a chunk of weights as floats
// Each decodes part p (of PARTS) of the CHUNK values of a row from value k on: VECS vectors of
// weights (affine: fma(q, scale, bias); mxfp4: kFp4[code] * scale) in the order x is read (as
// stored for all but Q4 and FP4, which read it split into evens and odds).

// Sixteen bytes (lanes of v) as four vectors of fma(byte, s, b): a TBL puts each byte in its own
// 32-bit lane (the other three bytes zero), then a convert and an FMA.
struct Widen {
  uint8x16_t idx[4];
  Widen() {
    alignas(16) uint8_t t[16];
    for (int v = 0; v < 4; v++) {
      for (int i = 0; i < 16; i++) t[i] = i % 4 == 0 ? (uint8_t)(4 * v + i / 4) : (uint8_t)0xff;  // 0xff: a zero byte
      idx[v] = vld1q_u8(t);
    }
  }
  inline void operator()(uint8x16_t v, float32x4_t s, float32x4_t b, float32x4_t (&w)[4]) const {
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) w[j] = vfmaq_f32(b, vcvtq_f32_u32(vreinterpretq_u32_u8(vqtbl1q_u8(v, idx[j]))), s);
  }
};

// 4-bit, groups of 32k: thirty-two values from sixteen bytes. Byte i holds values 2i (low nibble) and
// 2i+1 (high nibble): part 0 is the chunk's 16 even values, part 1 its 16 odd ones, and x is read
// split the same way (split_even_odd).
struct Q4 {
  static constexpr int BITS = 4, CHUNK = 32, PARTS = 2, VECS = 4, SMALL_R = 3;
  static constexpr bool EVEN_ODD = true;
  Widen widen;
  inline void operator()(const uint8_t* row, int64_t k, int part, float32x4_t s, float32x4_t b,
                         float32x4_t (&w)[4]) const {
    const uint8x16_t bytes = vld1q_u8(row + k / 2);
    widen(part == 0 ? vandq_u8(bytes, vdupq_n_u8(0xf)) : vshrq_n_u8(bytes, 4), s, b, w);
  }
};

// mxfp4 (4-bit e2m1 codes in groups of 32, power-of-two scales, no biases): bytes as Q4's; each
// code's value is looked up in kFp4 held as four byte planes (byte j of every value's float in
// one register: four TBLs, then two rounds of zips assemble the floats) and multiplied by the
// scale (exact: the same bits as the portable kernel's kFp4[code] * scale).
struct FP4 {
  static constexpr int BITS = 4, CHUNK = 32, PARTS = 2, VECS = 4, SMALL_R = 2;  // 3 rows spill here
  static constexpr bool EVEN_ODD = true;
  uint8x16_t plane[4];
  FP4() {
    alignas(16) uint8_t t[16];
    for (int j = 0; j < 4; j++) {
      for (int i = 0; i < 16; i++) {
        uint32_t bits;
        std::memcpy(&bits, &kFp4[i], 4);
        t[i] = (uint8_t)(bits >> (8 * j));
      }
      plane[j] = vld1q_u8(t);
    }
  }
  inline void operator()(const uint8_t* row, int64_t k, int part, float32x4_t s, float32x4_t,
                         float32x4_t (&w)[4]) const {
    const uint8x16_t bytes = vld1q_u8(row + k / 2);
    const uint8x16_t idx = part == 0 ? vandq_u8(bytes, vdupq_n_u8(0xf)) : vshrq_n_u8(bytes, 4);
    const uint8x16_t b0 = vqtbl1q_u8(plane[0], idx), b1 = vqtbl1q_u8(plane[1], idx);
    const uint8x16_t b2 = vqtbl1q_u8(plane[2], idx), b3 = vqtbl1q_u8(plane[3], idx);
    const uint16x8_t lo0 = vreinterpretq_u16_u8(vzip1q_u8(b0, b1)), lo1 = vreinterpretq_u16_u8(vzip2q_u8(b0, b1));
    const uint16x8_t hi0 = vreinterpretq_u16_u8(vzip1q_u8(b2, b3)), hi1 = vreinterpretq_u16_u8(vzip2q_u8(b2, b3));
    w[0] = vmulq_f32(vreinterpretq_f32_u16(vzip1q_u16(lo0, hi0)), s);
    w[1] = vmulq_f32(vreinterpretq_f32_u16(vzip2q_u16(lo0, hi0)), s);
    w[2] = vmulq_f32(vreinterpretq_f32_u16(vzip1q_u16(lo1, hi1)), s);
    w[3] = vmulq_f32(vreinterpretq_f32_u16(vzip2q_u16(lo1, hi1)), s);
  }
};

// 8-bit, groups of 16k: sixteen values from sixteen bytes, in order.
struct Q8 {
  static constexpr int BITS = 8, CHUNK = 16, PARTS = 1, VECS = 4, SMALL_R = 3;
  static constexpr bool EVEN_ODD = false;
  Widen widen;
  inline void operator()(const uint8_t* row, int64_t k, int, float32x4_t s, float32x4_t b, float32x4_t (&w)[4]) const {
    widen(vld1q_u8(row + k), s, b, w);
  }
};

// Any width, any group (a multiple of 8): eight values from BITS bytes, in order.
template <int B>
struct Packed {
  static constexpr int BITS = B, CHUNK = 8, PARTS = 1, VECS = 2, SMALL_R = 4;
  static constexpr bool EVEN_ODD = false;
  inline void operator()(const uint8_t* row, int64_t k, int, float32x4_t s, float32x4_t b, float32x4_t (&w)[2]) const {
    uint32x4_t lo, hi;
    unpack8<B>(row + k * B / 8, lo, hi);
    w[0] = vfmaq_f32(b, vcvtq_f32_u32(lo), s);
    w[1] = vfmaq_f32(b, vcvtq_f32_u32(hi), s);
  }
};

// x rows with each 32 values split into the 16 even then the 16 odd ones (Q4's and FP4's order).
void split_even_odd(const float* x, int64_t M, int64_t K, float* xp) {
  for (int64_t m = 0; m < M; m++) {
    for (int64_t j = 0; j < K; j += 32) {
      const float* src = x + m * K + j;
      float* dst = xp + m * K + j;
      for (int i = 0; i < 16; i += 4) {
        const float32x4_t a = vld1q_f32(src + 2 * i), b = vld1q_f32(src + 2 * i + 4);
        vst1q_f32(dst + i, vuzp1q_f32(a, b));
        vst1q_f32(dst + 16 + i, vuzp2q_f32(a, b));
      }
    }
  }
}

// ------------------------------------------------------------ quantized rows
// y[m0..m0+MT, n..n+R]: each part of a chunk is decoded for the R weight rows, then each x vector
// is loaded once and multiplied into all R rows' accumulators. One accumulator per product, its
// FMAs in chunk order and within a chunk in vector order, whatever R and MT are. (Every loop over
// the accumulators is unrolled so that they live in registers.)
template <class Dec, int R, int MT>
void block(const Dec& dec, const QMat& q, const float* xp, const float* sf, const float* bf, int64_t m0, float* y,
           int64_t ldy, int64_t n) {
  constexpr int V = Dec::VECS;
  const int64_t groups = q.K / q.group;
  const uint8_t* w[R];
  const float* x[MT];
  float32x4_t acc[R][MT];
#pragma GCC unroll 8
  for (int r = 0; r < R; r++) w[r] = q.w + (n + r) * (q.K * Dec::BITS / 8);
#pragma GCC unroll 8
  for (int t = 0; t < MT; t++) x[t] = xp + (m0 + t) * q.K;
#pragma GCC unroll 8
  for (int r = 0; r < R; r++)
#pragma GCC unroll 8
    for (int t = 0; t < MT; t++) acc[r][t] = vdupq_n_f32(0.0f);
  for (int64_t g = 0; g < groups; g++) {
    float32x4_t scale[R], bias[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
      scale[r] = vdupq_n_f32(sf[r * groups + g]);
      bias[r] = vdupq_n_f32(bf[r * groups + g]);
    }
    for (int64_t k = g * q.group; k < (g + 1) * q.group; k += Dec::CHUNK) {
#pragma GCC unroll 2
      for (int part = 0; part < Dec::PARTS; part++) {
        float32x4_t wv[R][V];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) dec(w[r], k, part, scale[r], bias[r], wv[r]);
#pragma GCC unroll 8
        for (int t = 0; t < MT; t++)
#pragma GCC unroll 4
          for (int v = 0; v < V; v++) {
            const float32x4_t xv = vld1q_f32(x[t] + k + 4 * (part * V + v));
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) acc[r][t] = vfmaq_f32(acc[r][t], wv[r][v], xv);
          }
      }
    }
  }
  store_sums<R, MT>(acc, m0, y, ldy, n);
}

// Weight rows [n, n1) in blocks of R: scales/biases converted once per block, then every tile
// of x rows passes over the block: R = Dec::SMALL_R for up to 3 rows of x (3 or 4 weight rows,
// so a row of x has as many FMA chains), tiles of 2 and 1 x rows; else R = 2 with tiles of 8 x
// rows (one weight row at a time: 8 accumulators), 4, 2 and 1. These shapes keep every
// accumulator, decoded weight and constant in registers (no spills in the inner loops of
// GCC 12's -O3 code, checked on its assembly); the results do not depend on them.
template <class Dec, int R>
void row_blocks(const Dec& dec, const QMat& q, const float* x, int64_t M, float* y, int64_t ldy, int64_t n1,
                int64_t& n) {
  const int64_t groups = q.K / q.group;
  Scratch& s = scratch();
  s.scales.resize(R * groups);
  s.biases.resize(R * groups);
  for (; n + R <= n1; n += R) {
    to_f32(q.scales, q.scale_type, n * groups, R * groups, s.scales.data());
    if (q.fp4) {
      // no biases: e2m1 values times the scale
    } else if (q.biases != nullptr) {
      to_f32(q.biases, q.scale_type, n * groups, R * groups, s.biases.data());
    } else {
      for (int64_t i = 0; i < R * groups; i++) s.biases[i] = symmetric_bias(q, s.scales[i]);
    }
    const float *sf = s.scales.data(), *bf = s.biases.data();
    int64_t m = 0;
    auto tile = [&](auto mt) {
      constexpr int MT = decltype(mt)::value;
      for (; m + MT <= M; m += MT) {
        if constexpr (MT == 8) {
          for (int r = 0; r < R; r++) block<Dec, 1, 8>(dec, q, x, sf + r * groups, bf + r * groups, m, y, ldy, n + r);
        } else {
          block<Dec, R, MT>(dec, q, x, sf, bf, m, y, ldy, n);
        }
      }
    };
    if constexpr (R <= 2) tile(std::integral_constant<int, 8>{});
    if constexpr (R <= 2) tile(std::integral_constant<int, 4>{});
    tile(std::integral_constant<int, 2>{});
    tile(std::integral_constant<int, 1>{});
  }
}

template <class Dec>
void rows_with(const QMat& q, const float* x, int64_t M, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  static const Dec dec;  // constants, built once
  const float* xk = x;
  if constexpr (Dec::EVEN_ODD) {
    Scratch& s = scratch();
    s.xp.resize(M * q.K);
    split_even_odd(x, M, q.K, s.xp.data());
    xk = s.xp.data();
  }
  int64_t n = n0;
  if (M <= 3) row_blocks<Dec, Dec::SMALL_R>(dec, q, xk, M, y, ldy, n1, n);
  row_blocks<Dec, 2>(dec, q, xk, M, y, ldy, n1, n);
  row_blocks<Dec, 1>(dec, q, xk, M, y, ldy, n1, n);
}

// Rows [n0, n1) dequantized: the same values fma(q, scale, bias) as the row kernels use.
template <int BITS>
void dequant_bits(const QMat& q, float* dst, int64_t n0, int64_t n1) {
  const Packed<BITS> dec;
  const int64_t groups = q.K / q.group, row_bytes = q.K * BITS / 8;
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t* row = q.w + n * row_bytes;
    float* out = dst + (n - n0) * q.K;
    for (int64_t g = 0; g < groups; g++) {
      const float sv = scale_at(q.scales, q.scale_type, n * groups + g);
      const float32x4_t s = vdupq_n_f32(sv);
      const float32x4_t b = vdupq_n_f32(q.biases ? scale_at(q.biases, q.scale_type, n * groups + g) : symmetric_bias(q, sv));
      for (int64_t k = g * q.group; k < (g + 1) * q.group; k += 8) {
        float32x4_t w[2];
        dec(row, k, 0, s, b, w);
        vst1q_f32(out + k, w[0]);
        vst1q_f32(out + k + 4, w[1]);
      }
    }
  }
}

// ------------------------------------------------------------ GEMM (many rows of x)
constexpr int64_t GEMM_NB = 16;  // weight rows per panel: four vectors of a k's weights
constexpr int GEMM_MR = 4;       // rows of x per register tile: 16 accumulators

// Rows [k, k + 4) of four weight rows (stride ld) into the panel's [k][16] layout at column j.
inline void transpose4(const float* in, int64_t ld, float* out) {
  const float32x4_t r0 = vld1q_f32(in), r1 = vld1q_f32(in + ld), r2 = vld1q_f32(in + 2 * ld), r3 = vld1q_f32(in + 3 * ld);
  const float32x4_t t0 = vtrn1q_f32(r0, r1), t1 = vtrn2q_f32(r0, r1), t2 = vtrn1q_f32(r2, r3), t3 = vtrn2q_f32(r2, r3);
  const float64x2_t d0 = vreinterpretq_f64_f32(t0), d1 = vreinterpretq_f64_f32(t1);
  const float64x2_t d2 = vreinterpretq_f64_f32(t2), d3 = vreinterpretq_f64_f32(t3);
  vst1q_f32(out, vreinterpretq_f32_f64(vzip1q_f64(d0, d2)));
  vst1q_f32(out + GEMM_NB, vreinterpretq_f32_f64(vzip1q_f64(d1, d3)));
  vst1q_f32(out + 2 * GEMM_NB, vreinterpretq_f32_f64(vzip2q_f64(d0, d2)));
  vst1q_f32(out + 3 * GEMM_NB, vreinterpretq_f32_f64(vzip2q_f64(d1, d3)));
}

// c[i][j] += b[j] * x[i][k + L] for one k: the panel's row k + L times lane L of each x vector.
// (Every loop over the accumulators is unrolled, so they live in registers: GCC otherwise keeps
// the array in memory and stores it every iteration.)
template <int MR, int L>
inline void gemm_step(float32x4_t (&c)[MR][4], const float32x4_t (&a)[MR], const float* b) {
  float32x4_t bv[4];
#pragma GCC unroll 4
  for (int j = 0; j < 4; j++) bv[j] = vld1q_f32(b + 4 * j);
#pragma GCC unroll 4
  for (int i = 0; i < MR; i++)
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) c[i][j] = vfmaq_laneq_f32(c[i][j], bv[j], a[i], L);
}

template <int MR>
void gemm_tile(const float* x, int64_t ldx, const float* panel, int64_t K, float* y, int64_t ldy, int64_t cols) {
  float32x4_t c[MR][4];
#pragma GCC unroll 4
  for (int i = 0; i < MR; i++)
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) c[i][j] = vdupq_n_f32(0.0f);
  for (int64_t k = 0; k < K; k += 4) {
    float32x4_t a[MR];
#pragma GCC unroll 4
    for (int i = 0; i < MR; i++) a[i] = vld1q_f32(x + i * ldx + k);
    const float* b = panel + k * GEMM_NB;
    gemm_step<MR, 0>(c, a, b);
    gemm_step<MR, 1>(c, a, b + GEMM_NB);
    gemm_step<MR, 2>(c, a, b + 2 * GEMM_NB);
    gemm_step<MR, 3>(c, a, b + 3 * GEMM_NB);
  }
#pragma GCC unroll 4
  for (int i = 0; i < MR; i++)
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++)
      if (4 * j < cols) store4(y + i * ldy, 4 * j, cols, c[i][j]);
}

struct GemmScratch {
  std::vector<float> rows, panel;
};
GemmScratch& gemm_scratch() {
  thread_local GemmScratch s;
  return s;
}

}  // namespace

void rows_neon(const QMat& q, const float* x, int64_t M, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  if (q.fp4) return rows_with<FP4>(q, x, M, y, ldy, n0, n1);  // groups of 32 (qmm.cpp checks)
  switch (q.bits) {
    case 2: return rows_with<Packed<2>>(q, x, M, y, ldy, n0, n1);
    case 3: return rows_with<Packed<3>>(q, x, M, y, ldy, n0, n1);
    case 4:
      if (q.group % 32 == 0) return rows_with<Q4>(q, x, M, y, ldy, n0, n1);
      return rows_with<Packed<4>>(q, x, M, y, ldy, n0, n1);
    case 5: return rows_with<Packed<5>>(q, x, M, y, ldy, n0, n1);
    case 6: return rows_with<Packed<6>>(q, x, M, y, ldy, n0, n1);
    default:
      if (q.group % 16 == 0) return rows_with<Q8>(q, x, M, y, ldy, n0, n1);
      return rows_with<Packed<8>>(q, x, M, y, ldy, n0, n1);
  }
}

void dequant_neon(const QMat& q, float* dst, int64_t n0, int64_t n1) {
  if (q.fp4) return dequant_scalar(q, dst, n0, n1);  // mxfp4 panels: the portable kernel, as on x86
  switch (q.bits) {
    case 2: return dequant_bits<2>(q, dst, n0, n1);
    case 3: return dequant_bits<3>(q, dst, n0, n1);
    case 4: return dequant_bits<4>(q, dst, n0, n1);
    case 5: return dequant_bits<5>(q, dst, n0, n1);
    case 6: return dequant_bits<6>(q, dst, n0, n1);
    default: return dequant_bits<8>(q, dst, n0, n1);
  }
}

void gemm_neon(const QMat& q, const float* x, int64_t M, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  if (q.K % 4 != 0) return rows_neon(q, x, M, y, ldy, n0, n1);  // not reached from qmm.cpp (K % 16 == 0 there)
  GemmScratch& s = gemm_scratch();
  s.rows.resize(GEMM_NB * q.K);
  s.panel.resize(GEMM_NB * q.K);
  for (int64_t p0 = n0; p0 < n1; p0 += GEMM_NB) {
    const int64_t cols = std::min(GEMM_NB, n1 - p0);
    dequant_neon(q, s.rows.data(), p0, p0 + cols);
    if (cols < GEMM_NB) std::fill(s.rows.begin() + cols * q.K, s.rows.end(), 0.0f);
    for (int64_t k = 0; k < q.K; k += 4)
      for (int64_t j = 0; j < GEMM_NB; j += 4) transpose4(s.rows.data() + j * q.K + k, q.K, s.panel.data() + k * GEMM_NB + j);
    const float* panel = s.panel.data();
    int64_t m = 0;
    for (; m + GEMM_MR <= M; m += GEMM_MR) gemm_tile<GEMM_MR>(x + m * q.K, q.K, panel, q.K, y + m * ldy + p0, ldy, cols);
    switch (M - m) {
      case 3: gemm_tile<3>(x + m * q.K, q.K, panel, q.K, y + m * ldy + p0, ldy, cols); break;
      case 2: gemm_tile<2>(x + m * q.K, q.K, panel, q.K, y + m * ldy + p0, ldy, cols); break;
      case 1: gemm_tile<1>(x + m * q.K, q.K, panel, q.K, y + m * ldy + p0, ldy, cols); break;
      default: break;
    }
  }
}

// ------------------------------------------------------------ attention (one query)
namespace {

constexpr int64_t MAX_HEAD = 512;  // head sizes beyond go to the scalar kernel

// Scores of KEYS keys (rows kr[i]) against the scaled query qs (padded with zeros to a
// multiple of four): per key two accumulators (even and odd chunks of four; the partial
// chunk of a head size that is not a multiple of four goes to the one its index gives),
// summed as hsum(acc0 + acc1). Each key's score is the same computed alone or beside others.
template <int KEYS>
inline void scores(const float* qs, int64_t D, const float* const (&kr)[KEYS], float (&out)[KEYS]) {
  const int64_t full = D / 4;
  float32x4_t a0[KEYS], a1[KEYS];
#pragma GCC unroll 4
  for (int i = 0; i < KEYS; i++) a0[i] = a1[i] = vdupq_n_f32(0.0f);
  int64_t c = 0;
  for (; c + 2 <= full; c += 2) {
    const float32x4_t q0 = vld1q_f32(qs + 4 * c), q1 = vld1q_f32(qs + 4 * c + 4);
#pragma GCC unroll 4
    for (int i = 0; i < KEYS; i++) {
      a0[i] = vfmaq_f32(a0[i], q0, vld1q_f32(kr[i] + 4 * c));
      a1[i] = vfmaq_f32(a1[i], q1, vld1q_f32(kr[i] + 4 * c + 4));
    }
  }
  if (c < full) {  // an odd count of full chunks: the last one (an even index)
    const float32x4_t qv = vld1q_f32(qs + 4 * c);
#pragma GCC unroll 4
    for (int i = 0; i < KEYS; i++) a0[i] = vfmaq_f32(a0[i], qv, vld1q_f32(kr[i] + 4 * c));
    c++;
  }
  if (c * 4 < D) {  // the partial chunk, into the accumulator of its index's parity
    const float32x4_t qv = vld1q_f32(qs + 4 * c);
#pragma GCC unroll 4
    for (int i = 0; i < KEYS; i++) {
      const float32x4_t kv = load_part(kr[i] + 4 * c, D - 4 * c);
      if (c & 1) {
        a1[i] = vfmaq_f32(a1[i], qv, kv);
      } else {
        a0[i] = vfmaq_f32(a0[i], qv, kv);
      }
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < KEYS; i++) out[i] = hsum(vaddq_f32(a0[i], a1[i]));
}

// y[d0, d0 + 4 NV) = sum_t p[t] v[t][d0 ..] * inv, NV vectors of accumulators in registers,
// keys in order (one FMA chain per output value: the same for any block split).
template <int NV>
void weigh_values(const AttnRow& a, const float* p, int64_t d0, float inv, float* y) {
  float32x4_t acc[NV];
#pragma GCC unroll 16
  for (int i = 0; i < NV; i++) acc[i] = vdupq_n_f32(0.0f);
  for (int64_t t = 0; t < a.T; t++) {
    if (p[t] == 0.0f) continue;  // masked (or underflowed): adds exact zeros
    const float32x4_t w = vdupq_n_f32(p[t]);
    const float* vr = a.v + t * a.vs + d0;
#pragma GCC unroll 16
    for (int i = 0; i < NV; i++) acc[i] = vfmaq_f32(acc[i], w, vld1q_f32(vr + 4 * i));
  }
  const float32x4_t iv = vdupq_n_f32(inv);
#pragma GCC unroll 16
  for (int i = 0; i < NV; i++) vst1q_f32(y + d0 + 4 * i, vmulq_f32(acc[i], iv));
}

}  // namespace

void attend_neon(const AttnRow& a, float* p, float* y) {
  const int64_t D = a.D, Dv = a.Dv;
  if (D > MAX_HEAD || Dv > MAX_HEAD) return attend_scalar(a, p, y);
  alignas(16) float qs[MAX_HEAD + 4] = {};
  const float32x4_t sc = vdupq_n_f32(a.scale);
  for (int64_t d = 0; d < D; d += 4) vst1q_f32(qs + d, vmulq_f32(load4(a.q, d, D), sc));
  float m = -INFINITY;
  auto keep = [&](int64_t t, float s) {
    if (a.hidden(t)) {
      p[t] = -INFINITY;
    } else {
      p[t] = s;
      m = std::max(m, s);
    }
  };
  // four keys at a time (eight FMA chains); keys past the causal limit are not read
  const int64_t live = std::min(a.T, a.visible);
  int64_t t = 0;
  for (; t + 4 <= live; t += 4) {
    const float* const kr[4] = {a.k + t * a.ks, a.k + (t + 1) * a.ks, a.k + (t + 2) * a.ks, a.k + (t + 3) * a.ks};
    float s[4];
    scores<4>(qs, D, kr, s);
    for (int i = 0; i < 4; i++) keep(t + i, s[i]);
  }
  for (; t < live; t++) {
    const float* const kr[1] = {a.k + t * a.ks};
    float s[1];
    scores<1>(qs, D, kr, s);
    keep(t, s[0]);
  }
  for (; t < a.T; t++) p[t] = -INFINITY;
  // the exponentials four at a time (hidden keys: exact zeros); the sum key by key, in order, so a
  // query's result does not depend on where padding puts its keys
  const float32x4_t mv = vdupq_n_f32(m), none = vdupq_n_f32(-INFINITY);
  for (int64_t i = 0; i < a.T; i += 4) {
    const float32x4_t s = load4(p, i, a.T);
    const uint32x4_t hidden = vceqq_f32(s, none);
    store4(p, i, a.T, vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(exp_ps(vsubq_f32(s, mv))), hidden)));
  }
  float sum = 0.0f;
  for (int64_t i = 0; i < a.T; i++) sum += p[i];
  const float inv = 1.0f / sum;
  // the values in blocks of up to 64 (accumulators in registers), the partial vector lane by lane
  int64_t d = 0;
  for (; d + 64 <= Dv; d += 64) weigh_values<16>(a, p, d, inv, y);
  if (Dv - d >= 32) {
    weigh_values<8>(a, p, d, inv, y);
    d += 32;
  }
  if (Dv - d >= 16) {
    weigh_values<4>(a, p, d, inv, y);
    d += 16;
  }
  if (Dv - d >= 8) {
    weigh_values<2>(a, p, d, inv, y);
    d += 8;
  }
  if (Dv - d >= 4) {
    weigh_values<1>(a, p, d, inv, y);
    d += 4;
  }
  for (; d < Dv; d++) {
    float acc = 0.0f;
    for (int64_t i = 0; i < a.T; i++)
      if (p[i] != 0.0f) acc = std::fma(p[i], a.v[i * a.vs + d], acc);
    y[d] = acc * inv;
  }
}

// ------------------------------------------------------------ rms norm, gated activations
void rms_norm_neon(const float* x, int64_t xs, const float* w, float* y, int64_t rows, int64_t D, float eps) {
  for (int64_t r = 0; r < rows; r++) {
    const float* xr = x + r * xs;
    // chunk c of four values into accumulator c % 4, summed as hsum((a0 + a1) + (a2 + a3))
    float32x4_t a0 = vdupq_n_f32(0.0f), a1 = a0, a2 = a0, a3 = a0;
    int64_t d = 0;
    for (; d + 16 <= D; d += 16) {
      const float32x4_t v0 = vld1q_f32(xr + d), v1 = vld1q_f32(xr + d + 4);
      const float32x4_t v2 = vld1q_f32(xr + d + 8), v3 = vld1q_f32(xr + d + 12);
      a0 = vfmaq_f32(a0, v0, v0);
      a1 = vfmaq_f32(a1, v1, v1);
      a2 = vfmaq_f32(a2, v2, v2);
      a3 = vfmaq_f32(a3, v3, v3);
    }
    for (int j = 0; d < D; d += 4, j++) {  // up to three chunks left, the last maybe partial
      const float32x4_t v = load4(xr, d, D);
      if (j == 0) {
        a0 = vfmaq_f32(a0, v, v);
      } else if (j == 1) {
        a1 = vfmaq_f32(a1, v, v);
      } else {
        a2 = vfmaq_f32(a2, v, v);
      }
    }
    const float ss = hsum(vaddq_f32(vaddq_f32(a0, a1), vaddq_f32(a2, a3)));
    const float32x4_t inv = vdupq_n_f32(1.0f / std::sqrt(ss / (float)D + eps));
    for (d = 0; d < D; d += 4) {
      const float32x4_t v = vmulq_f32(load4(xr, d, D), inv);
      store4(y + r * D, d, D, w ? vmulq_f32(v, load4(w, d, D)) : v);
    }
  }
}

void silu_mul_neon(const float* g, int64_t gs, const float* u, int64_t us, float* y, int64_t rows, int64_t n) {
  const float32x4_t one = vdupq_n_f32(1.0f);
  for (int64_t r = 0; r < rows; r++) {
    for (int64_t i = 0; i < n; i += 4) {
      const float32x4_t a = load4(g + r * gs, i, n);
      const float32x4_t e = exp_ps(vnegq_f32(a));
      store4(y + r * n, i, n, vmulq_f32(vdivq_f32(a, vaddq_f32(one, e)), load4(u + r * us, i, n)));
    }
  }
}

void gelu_tanh_mul_neon(const float* g, int64_t gs, const float* u, int64_t us, float* y, int64_t rows, int64_t n) {
  const float32x4_t one = vdupq_n_f32(1.0f), two = vdupq_n_f32(2.0f);
  const float32x4_t c = vdupq_n_f32(0.7978845608028654f), k = vdupq_n_f32(0.044715f);
  for (int64_t r = 0; r < rows; r++) {
    for (int64_t i = 0; i < n; i += 4) {
      const float32x4_t a = load4(g + r * gs, i, n);
      const float32x4_t z = vmulq_f32(c, vfmaq_f32(a, vmulq_f32(k, a), vmulq_f32(a, a)));
      // 0.5 (1 + tanh(z)) = sigmoid(2 z): no cancellation for either sign of z
      const float32x4_t t = vdivq_f32(one, vaddq_f32(one, exp_ps(vmulq_f32(two, vnegq_f32(z)))));
      store4(y + r * n, i, n, vmulq_f32(vmulq_f32(a, t), load4(u + r * us, i, n)));
    }
  }
}

// ------------------------------------------------------------ quantized KV rows
namespace {

template <int BITS>
void kv_dequant(const uint8_t* w, const float* sf, const float* bf, int64_t D, int group, float* out) {
  for (int64_t g = 0; g < D / group; g++) {
    const float32x4_t s = vdupq_n_f32(sf[g]), b = vdupq_n_f32(bf[g]);
    for (int64_t j = g * group; j < (g + 1) * group; j += 8) {
      uint32x4_t lo, hi;
      unpack8<BITS>(w + j * BITS / 8, lo, hi);
      vst1q_f32(out + j, vfmaq_f32(b, vcvtq_f32_u32(lo), s));
      vst1q_f32(out + j + 4, vfmaq_f32(b, vcvtq_f32_u32(hi), s));
    }
  }
}

// The normalized Walsh-Hadamard transform of D (a power of two, >= 8) floats in place, in the
// scalar kernel's stage order (h = 1, 2 inside each vector, then across vectors): the same bits.
void wht(float* v, int64_t D) {
  const uint32x4_t even_lanes = {~0u, 0u, ~0u, 0u};
  for (int64_t i = 0; i < D; i += 4) {
    float32x4_t a = vld1q_f32(v + i);
    // h = 1: lanes (0, 1) and (2, 3) -> (a + b, a - b)
    float32x4_t sw = vrev64q_f32(a);
    a = vbslq_f32(even_lanes, vaddq_f32(a, sw), vsubq_f32(sw, a));
    // h = 2: lanes (0, 2) and (1, 3)
    sw = vextq_f32(a, a, 2);
    a = vcombine_f32(vget_low_f32(vaddq_f32(a, sw)), vget_high_f32(vsubq_f32(sw, a)));
    vst1q_f32(v + i, a);
  }
  for (int64_t h = 4; h < D; h <<= 1) {
    for (int64_t i = 0; i < D; i += 2 * h) {
      for (int64_t j = i; j < i + h; j += 4) {
        const float32x4_t a = vld1q_f32(v + j), c = vld1q_f32(v + j + h);
        vst1q_f32(v + j, vaddq_f32(a, c));
        vst1q_f32(v + j + h, vsubq_f32(a, c));
      }
    }
  }
  const float32x4_t norm = vdupq_n_f32(1.0f / std::sqrt((float)D));
  for (int64_t i = 0; i < D; i += 4) vst1q_f32(v + i, vmulq_f32(vld1q_f32(v + i), norm));
}

}  // namespace

void kv_row_neon(const uint8_t* w, const void* scales, const void* biases, int scale_type, int64_t D, int group,
                 int bits, bool rotate, float* out) {
  constexpr int64_t MAX_GROUPS = 64;
  const int64_t groups = D / group;
  if (groups > MAX_GROUPS || group % 8 != 0) return kv_row_scalar(w, scales, biases, scale_type, D, group, bits, rotate, out);
  float sf[MAX_GROUPS], bf[MAX_GROUPS];
  to_f32(scales, scale_type, 0, groups, sf);
  if (biases) {
    to_f32(biases, scale_type, 0, groups, bf);
  } else {
    for (int64_t g = 0; g < groups; g++) bf[g] = -(float)(1 << (bits - 1)) * sf[g];
  }
  switch (bits) {
    case 2: kv_dequant<2>(w, sf, bf, D, group, out); break;
    case 3: kv_dequant<3>(w, sf, bf, D, group, out); break;
    case 4: kv_dequant<4>(w, sf, bf, D, group, out); break;
    case 5: kv_dequant<5>(w, sf, bf, D, group, out); break;
    case 6: kv_dequant<6>(w, sf, bf, D, group, out); break;
    default: kv_dequant<8>(w, sf, bf, D, group, out); break;
  }
  if (rotate) wht(out, D);
}

}  // namespace tsq
