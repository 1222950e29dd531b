// AVX-512 kernels for 2/3/5/6/8-bit weights in groups of 16k and 4-bit in groups of 32k;
// this file alone is compiled with -mavx512f -mavx512bw -mavx512vl -mavx512dq
// -mfma -mf16c and only called after a run-time check. Other layouts go to the
// AVX2 kernels.
//
// 2-6 bits: each group's 2^bits possible weights scale*q + bias are one to four
// registers (a lookup table), so a weight is one permute away from its float
// value: no integer-to-float conversion, no separate scale or bias term, and
// the sum is the plain dot product of the dequantized row with x (4-bit reads
// bytes as even/odd nibbles, other widths a shuffle per sixteen). 8-bit (and
// 5/6-bit where converting measured faster, or in groups of sixteen): each
// sixteen integers converted and dequantized with one FMA. R weight rows and
// MT rows of x are computed together (R * MT <= 16), so each weight is decoded
// once for all MT rows and 4+ FMA chains hide the latency. 5/6-bit rows of a
// multiple of 64 values on a CPU with AVX512-VBMI: unpacked by byte permute and
// multishift, each group's scale and bias applied to its sums (multishift_block).
// Every tile sums a row's products in the same order, so a row of x gets the
// same result whatever rows share its product (a batched row equals the row
// alone, bit for bit).
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

#include "kernels.h"

namespace tsq {
namespace {

constexpr int64_t PREFETCH_BYTES = 4096;

// Attention reads the cache's key and value rows in order, but the hardware prefetchers stop at
// each 4 KiB page of its buffers: the first query over a block of rows asks for the row 8 KiB
// ahead of each (into L2). Decode attention from memory on Zen 4, heads of 64 (3 kv heads, 320
// keys): 25 -> 22 us; of 128 (2 kv heads): 36 -> 28 us. A lone query of a head wider than 128
// (attend_chunks) gained nothing and goes without.
constexpr int64_t ROW_AHEAD_BYTES = 8192;
inline void prefetch_ahead(const float* row, int64_t stride, int64_t t, int64_t T, int64_t bytes) {
  const int64_t ahead = std::max<int64_t>(1, ROW_AHEAD_BYTES / (4 * stride));
  if (t + ahead >= T) return;
  const char* p = reinterpret_cast<const char*>(row + ahead * stride);
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
}

inline __mmask16 tail16(int64_t i, int64_t n) {
  return n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
}
inline __m512 load16(const float* p, int64_t i, int64_t n) { return _mm512_maskz_loadu_ps(tail16(i, n), p + i); }
inline void store16(float* p, int64_t i, int64_t n, __m512 v) { _mm512_mask_storeu_ps(p + i, tail16(i, n), v); }

// e^x (Cephes' expf polynomial, within ~1 ulp; inputs clamped to +-88.3)
inline __m512 exp_ps(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-88.3762626647949f)), _mm512_set1_ps(88.3762626647949f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500E-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// Horizontal sums of N <= 16 accumulators at once: lane j of the result is
// _mm512_reduce_add_ps(v[j]), summed by the same tree (lanes i + i^8, then i^4,
// i^2, i^1), so bit for bit equal; lanes from N on are zero. Pairs of vectors
// share each shuffle and add: about 3 instructions a sum instead of 8.
template <int N>
inline __m512 reduce_lanes(const __m512* v) {
  static_assert(1 <= N && N <= 16);
  const __m512 zero = _mm512_setzero_ps();
  auto at = [&](const __m512* a, int i, int n) { return i < n ? a[i] : zero; };
  __m512 u[8], w[4], x[2];
  // lanes 0-7: v[2k]'s i + i^8, lanes 8-15: v[2k + 1]'s
#pragma GCC unroll 8
  for (int k = 0; k < 8; k++) {
    if (2 * k >= N) break;
    const __m512 a = v[2 * k], b = at(v, 2 * k + 1, N);
    u[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
  constexpr int NU = (N + 1) / 2, NW = (N + 3) / 4, NX = (N + 7) / 8;
  // 128-bit block c of w[m]: v[4m + c]'s partial sums (i + i^4)
#pragma GCC unroll 4
  for (int m = 0; m < NW; m++) {
    const __m512 a = u[2 * m], b = at(u, 2 * m + 1, NU);
    w[m] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
  }
  // block c of x[h]: elements 0-1 v[8h + c]'s (i + i^2), elements 2-3 v[8h + 4 + c]'s
#pragma GCC unroll 2
  for (int h = 0; h < NX; h++) {
    const __m512 a = w[2 * h], b = at(w, 2 * h + 1, NW);
    x[h] = _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE));
  }
  const __m512 a = x[0], b = at(x, 1, NX);
  const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
  // z's lane 4c + e holds v[4e + c]'s sum
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, z);
}

// y[(m0 + t) * ldy + n + r] = the sum of acc[r][t] (as _mm512_reduce_add_ps) plus extra's, when given.
template <int R, int MT>
inline void store_sums(const __m512 (&acc)[R][MT], int64_t m0, float* y, int64_t ldy, int64_t n,
                       const __m512 (*extra)[MT] = nullptr) {
  static_assert(R * MT <= 16);
  alignas(64) float out[16], add[16];
  _mm512_store_ps(out, reduce_lanes<R * MT>(&acc[0][0]));
  if (extra != nullptr) _mm512_store_ps(add, reduce_lanes<R * MT>(&extra[0][0]));
  for (int r = 0; r < R; r++)
    for (int t = 0; t < MT; t++)
      y[(m0 + t) * ldy + n + r] = extra != nullptr ? out[r * MT + t] + add[r * MT + t] : out[r * MT + t];
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
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
    const __m256i v = _mm256_maskz_loadu_epi16(m, h + i);
    const __m512 f = type == kF16 ? _mm512_cvtph_ps(v) : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
    _mm512_mask_storeu_ps(out + i, m, f);
  }
}

// Per-thread scratch: rows' scales and biases as float32, x as the kernels read it
// (each row of K floats starts on a cache line when K is a multiple of 16).
struct Scratch {
  std::vector<float> scales, biases, xsum;
  Floats xp;
};
Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

// x rows with each 32 values split into the 16 even then the 16 odd ones: a
// byte of 4-bit weights holds value 2t (low nibble) and 2t+1 (high nibble).
void split_even_odd(const float* x, int64_t M, int64_t K, float* xp) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  for (int64_t m = 0; m < M; m++) {
    for (int64_t j = 0; j < K; j += 32) {
      const __m512 a = _mm512_loadu_ps(x + m * K + j), b = _mm512_loadu_ps(x + m * K + j + 16);
      _mm512_storeu_ps(xp + m * K + j, _mm512_permutex2var_ps(a, even, b));
      _mm512_storeu_ps(xp + m * K + j + 16, _mm512_permutex2var_ps(a, odd, b));
    }
  }
}

// FP4: mxfp4 codes, each group's table its e2m1 values times the group's scale (no bias)
template <int R, int MT, bool FP4 = false>
void q4_block(const QMat& q, const float* xp, const float* sf, const float* bf, int64_t m0, float* y, int64_t ldy,
              int64_t n) {
  const int64_t groups = q.K / q.group, row_bytes = q.K / 2;
  const __m512 iota = FP4 ? _mm512_loadu_ps(kFp4) : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 acc[R][MT];
  for (int r = 0; r < R; r++)
    for (int t = 0; t < MT; t++) acc[r][t] = _mm512_setzero_ps();
  __m512 lut[R];
  // one flat loop over 32-value chunks (a group's table is rebuilt at its first chunk; no division)
  for (int64_t k = 0, g = -1, next = 0; k < q.K; k += 32) {
    if (k == next) {
      g++;
      next += q.group;
      for (int r = 0; r < R; r++)
        lut[r] = FP4 ? _mm512_mul_ps(iota, _mm512_set1_ps(sf[r * groups + g]))
                     : _mm512_fmadd_ps(iota, _mm512_set1_ps(sf[r * groups + g]), _mm512_set1_ps(bf[r * groups + g]));
    }
    {
      __m512 we[R], wo[R];
      for (int r = 0; r < R; r++) {
        const __m512i b = _mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(q.w + (n + r) * row_bytes + k / 2)));
        we[r] = _mm512_permutexvar_ps(b, lut[r]);  // the permute reads the low 4 bits
        wo[r] = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), lut[r]);
      }
      for (int t = 0; t < MT; t++) {
        const __m512 xe = _mm512_load_ps(xp + (m0 + t) * q.K + k), xo = _mm512_load_ps(xp + (m0 + t) * q.K + k + 16);
        for (int r = 0; r < R; r++) acc[r][t] = _mm512_fmadd_ps(wo[r], xo, _mm512_fmadd_ps(we[r], xe, acc[r][t]));
      }
    }
  }
  store_sums<R, MT>(acc, m0, y, ldy, n);
}

// Sixteen values from p (2 * BITS bytes) in the low BITS bits of 32-bit lanes (higher bits:
// neighbours); no load passes end, the end of the weight buffer.
template <int BITS>
inline __m512i unpack16(const uint8_t* p, const uint8_t* end) {
  const __m512i shuf = _mm512_loadu_si512(Spread<BITS, 16>::shuf.data());
  const __m512i shift = _mm512_loadu_si512(Spread<BITS, 16>::shift.data());
  if (p + 16 <= end) [[likely]] {  // one broadcast load (no shuffle-port work)
    return _mm512_srlv_epi32(
        _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), shuf),
        shift);
  }
  const __m128i raw = _mm_maskz_loadu_epi8((__mmask16)((1u << (2 * BITS)) - 1), p);
  return _mm512_srlv_epi32(_mm512_shuffle_epi8(_mm512_broadcast_i32x4(raw), shuf), shift);
}

// Sixteen codes of a `BITS`-bit (2/3/5/6/8) row from p (no load passes end) as floats.
template <int BITS>
inline __m512 codes16(const uint8_t* p, const uint8_t* end) {
  if constexpr (BITS == 8) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  } else {
    return _mm512_cvtepi32_ps(_mm512_and_si512(unpack16<BITS>(p, end), _mm512_set1_epi32((1 << BITS) - 1)));
  }
}

// One group's 2^BITS dequantized values scale * q + bias, as one to four tables of sixteen.
template <int BITS>
struct Lut {
  static constexpr int TABLES = BITS <= 4 ? 1 : 1 << (BITS - 4);
  // table k's codes: 16 k .. 16 k + 15 (repeated below sixteen values)
  static constexpr std::array<float, 16 * TABLES> iota = [] {
    std::array<float, 16 * TABLES> a{};
    for (int i = 0; i < 16 * TABLES; i++) a[i] = (float)(i % (1 << BITS));
    return a;
  }();
  __m512 t[TABLES];
  void set(float scale, float bias) {
    const __m512 s = _mm512_set1_ps(scale), b = _mm512_set1_ps(bias);
    for (int k = 0; k < TABLES; k++) t[k] = _mm512_fmadd_ps(_mm512_loadu_ps(iota.data() + 16 * k), s, b);
  }
  __m512 operator()(__m512i idx) const {
    if constexpr (TABLES == 1) {
      return _mm512_permutexvar_ps(idx, t[0]);  // reads the low 4 bits
    } else if constexpr (TABLES == 2) {
      return _mm512_permutex2var_ps(t[0], idx, t[1]);  // the low 5 bits
    } else {
      const __m512 lo = _mm512_permutex2var_ps(t[0], idx, t[1]), hi = _mm512_permutex2var_ps(t[2], idx, t[3]);
      return _mm512_mask_blend_ps(_mm512_test_epi32_mask(idx, _mm512_set1_epi32(32)), lo, hi);
    }
  }
};

template <int BITS, int R, int MT>
void lut_block(const QMat& q, const float* x, const float* sf, const float* bf, int64_t m0, float* y, int64_t ldy,
               int64_t n) {
  const int64_t groups = q.K / q.group, row_bytes = q.K * BITS / 8;
  const uint8_t* end = q.w + q.N * row_bytes;
  __m512 acc[R][MT];
  for (int r = 0; r < R; r++)
    for (int t = 0; t < MT; t++) acc[r][t] = _mm512_setzero_ps();
  Lut<BITS> lut[R];
  // one flat loop over sixteen-value chunks (each row's tables rebuilt at a group's first chunk, no
  // division), so the accumulators stay in registers
  for (int64_t k = 0, g = -1, next = 0; k < q.K; k += 16) {
    if (k == next) {
      g++;
      next += q.group;
      for (int r = 0; r < R; r++) lut[r].set(sf[r * groups + g], bf[r * groups + g]);
    }
    __m512 w[R];
    for (int r = 0; r < R; r++) w[r] = lut[r](unpack16<BITS>(q.w + (n + r) * row_bytes + k * BITS / 8, end));
    for (int t = 0; t < MT; t++) {
      const __m512 xv = _mm512_load_ps(x + (m0 + t) * q.K + k);
      for (int r = 0; r < R; r++) acc[r][t] = _mm512_fmadd_ps(w[r], xv, acc[r][t]);
    }
  }
  store_sums<R, MT>(acc, m0, y, ldy, n);
}

// Weights converted: each sixteen integers are converted and dequantized with one FMA (scale * q +
// bias), once for all MT rows of x. 8-bit always; 5/6-bit in groups of sixteen (GGUF's Q6_K: a
// group is one chunk, so its lookup tables would be rebuilt for every sixteen weights), and in
// groups of 32k where this measured faster than the tables (converts_faster).
template <int BITS, int R, int MT>
void convert_block(const QMat& q, const float* x, const float* sf, const float* bf, int64_t m0, float* y, int64_t ldy,
                  int64_t n) {
  const int64_t row_bytes = q.K * BITS / 8;
  const uint8_t* end = q.w + q.N * row_bytes;
  __m512 acc[R][MT], scale[R], bias[R];
  for (int r = 0; r < R; r++)
    for (int t = 0; t < MT; t++) acc[r][t] = _mm512_setzero_ps();
  const int64_t groups = q.K / q.group;
  for (int64_t k = 0, g = -1, next = 0; k < q.K; k += 16) {
    if (k == next) {
      g++;
      next += q.group;
      for (int r = 0; r < R; r++) {
        scale[r] = _mm512_set1_ps(sf[r * groups + g]);
        bias[r] = _mm512_set1_ps(bf[r * groups + g]);
      }
    }
    __m512 w[R];
    for (int r = 0; r < R; r++)
      w[r] = _mm512_fmadd_ps(codes16<BITS>(q.w + (n + r) * row_bytes + k * BITS / 8, end), scale[r], bias[r]);
    for (int t = 0; t < MT; t++) {
      const __m512 xv = _mm512_load_ps(x + (m0 + t) * q.K + k);
      for (int r = 0; r < R; r++) acc[r][t] = _mm512_fmadd_ps(w[r], xv, acc[r][t]);
    }
  }
  store_sums<R, MT>(acc, m0, y, ldy, n);
}

// 5/6-bit weights in groups of 32k have two paths with the same results bit for bit (a table's
// entry is the same FMA, scale * q + bias, that the convert path runs): lookup tables (lut_block)
// or convert and FMA (convert_block). Which is faster depends on the CPU's 512-bit permutes (Zen 4:
// converting measured 1.3-1.4x the tables at 6 bits, about equal at 5), so the first product of a
// width times both on a block of weights in the core's cache and keeps the faster.
std::atomic<int> forced_path{-1};

template <int BITS>
bool measure_converts_faster() {
  constexpr int64_t N = 64, K = 1024, group = 64, groups = K / group;
  static_assert(N % 4 == 0);
  std::vector<uint8_t> w(N * K * BITS / 8);
  for (size_t i = 0; i < w.size(); i++) w[i] = (uint8_t)(i * 2654435761u >> 13);
  std::vector<float> sf(N * groups, 0.01f), bf(N * groups, -0.1f);
  Floats x(K, 0.5f);
  float y[N];
  const QMat q{w.data(), nullptr, nullptr, kF32, N, K, (int)group, BITS};
  double best[2] = {1e30, 1e30};
  for (int rep = 0; rep < 16; rep++) {
    for (int path = 0; path < 2; path++) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int64_t n = 0; n < N; n += 4) {
        const float *s = sf.data() + n * groups, *b = bf.data() + n * groups;
        if (path == 1) {
          convert_block<BITS, 4, 1>(q, x.data(), s, b, 0, y, N, n);
        } else {
          lut_block<BITS, 4, 1>(q, x.data(), s, b, 0, y, N, n);
        }
      }
      best[path] = std::min(best[path], std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
  }
  return best[1] < best[0];
}

template <int BITS>
bool converts_faster() {
  static const bool measured = measure_converts_faster<BITS>();
  const int forced = forced_path.load(std::memory_order_relaxed);
  return forced >= 0 ? forced == 1 : measured;
}

// ------------------------------------------------------------ 5/6 bits by multishift (AVX512-VBMI)
// Where the CPU has AVX512-VBMI (Ice Lake, Zen 4 and later), 5/6-bit rows whose length is a
// multiple of 64 are unpacked sixty-four values at a time: a byte permute gives each 64-bit word
// the BITS bytes of eight values and a multishift moves each value into a byte of its own, so
// 32-bit lane d holds values 4d .. 4d + 3 of the chunk (x is read permuted to match, split_four).
// Each group's scale multiplies the sum of its q * x, its bias the sum of its x (taken once per row
// of x): no table or dequantized weight per group. From L2, one core of Zen 4: 5-bit 11.0 -> 17.9
// GMAC/s (g32), 6-bit 9.3 -> 15.3 (g16) and 10.6 -> 16.3 (g32) against the paths above.
bool has_vbmi() {
  static const bool yes = __builtin_cpu_supports("avx512vbmi");
  return yes;
}

// Whether rows_bits<BITS> takes the multishift kernel for q (forced paths 0 and 1 keep the others).
template <int BITS>
bool multishifts(const QMat& q) {
  return (BITS == 5 || BITS == 6) && q.K % 64 == 0 && (q.group & (q.group - 1)) == 0 &&
         forced_path.load(std::memory_order_relaxed) < 0 && has_vbmi();
}

// The byte permute's and the multishift's controls: byte j of word w takes byte BITS * w + j, then
// the 8 bits from bit BITS * j of the word.
template <int BITS>
struct MultiShift {
  static constexpr std::array<int8_t, 64> perm = [] {
    std::array<int8_t, 64> a{};
    for (int i = 0; i < 64; i++) a[i] = (int8_t)(BITS * (i / 8) + i % 8);
    return a;
  }();
  static constexpr std::array<int8_t, 64> shift = [] {
    std::array<int8_t, 64> a{};
    for (int i = 0; i < 64; i++) a[i] = (int8_t)(BITS * (i % 8));
    return a;
  }();
};

// x rows with each 64 values as four vectors, vector b holding values 4d + b (lane d); and each row's
// group sums, xsum[m * K / group + g].
void split_four(const float* x, int64_t M, int64_t K, int group, float* xp, float* xsum) {
  alignas(64) static constexpr std::array<int32_t, 16> idx0 = [] {
    std::array<int32_t, 16> a{};
    for (int d = 0; d < 16; d++) a[d] = 4 * (d % 8);
    return a;
  }();
  const __m512i base = _mm512_load_si512(idx0.data());
  for (int64_t m = 0; m < M; m++) {
    const float* xr = x + m * K;
    for (int64_t k = 0; k < K; k += 64) {
      const __m512 a0 = _mm512_loadu_ps(xr + k), a1 = _mm512_loadu_ps(xr + k + 16), a2 = _mm512_loadu_ps(xr + k + 32),
                   a3 = _mm512_loadu_ps(xr + k + 48);
      for (int b = 0; b < 4; b++) {
        const __m512i i = _mm512_add_epi32(base, _mm512_set1_epi32(b));
        const __m512 lo = _mm512_permutex2var_ps(a0, i, a1), hi = _mm512_permutex2var_ps(a2, i, a3);
        _mm512_storeu_ps(xp + m * K + k + 16 * b, _mm512_shuffle_f32x4(lo, hi, 0x44));
      }
    }
    for (int64_t g = 0; g < K / group; g++) {
      __m512 sum = _mm512_setzero_ps();
      for (int64_t i = g * group; i < (g + 1) * group; i += 16) sum = _mm512_add_ps(sum, load16(xr, i, (g + 1) * group));
      xsum[m * (K / group) + g] = _mm512_reduce_add_ps(sum);
    }
  }
}

template <int BITS, int R, int MT>
__attribute__((target("avx512vbmi"))) void multishift_block(const QMat& q, const float* xp, const float* xsum,
                                                            const float* sf, const float* bf, int64_t m0, float* y,
                                                            int64_t ldy, int64_t n) {
  const int64_t groups = q.K / q.group, row_bytes = q.K * BITS / 8;
  const __m512i perm = _mm512_loadu_si512(MultiShift<BITS>::perm.data());
  const __m512i shift = _mm512_loadu_si512(MultiShift<BITS>::shift.data());
  // a chunk's scales: lane d's group is 4d / group of the chunk's first (groups of 64 and more: one)
  const int spans = q.group <= 64 ? 64 / q.group : 1;
  const __mmask16 first = (__mmask16)((1u << spans) - 1);
  const int lane_shift = __builtin_ctz((unsigned)q.group) - 2;  // 4d / group = d >> lane_shift
  const __m512i lane_group = q.group <= 64 ? _mm512_srlv_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,
                                                                11, 12, 13, 14, 15), _mm512_set1_epi32(lane_shift))
                                           : _mm512_setzero_si512();
  const int group_shift = __builtin_ctz((unsigned)q.group);
  constexpr __mmask64 chunk_bytes = (__mmask64)((1ull << (8 * BITS)) - 1);
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 iota16 = _mm512_add_ps(iota, _mm512_set1_ps(16.0f));
  const __m512i mask = _mm512_set1_epi32((1 << BITS) - 1);
  __m512 acc[R][MT];
  for (int r = 0; r < R; r++)
    for (int t = 0; t < MT; t++) acc[r][t] = _mm512_setzero_ps();
  for (int64_t k = 0; k < q.K; k += 64) {
    const int64_t g = k >> group_shift;
    for (int r = 0; r < R; r++) {
      const __m512i v = _mm512_multishift_epi64_epi8(
          shift, _mm512_permutexvar_epi8(perm, _mm512_maskz_loadu_epi8(chunk_bytes, q.w + (n + r) * row_bytes + k * BITS / 8)));
      __m512 w[4];  // the codes as floats
      for (int b = 0; b < 4; b++) {
        const __m512i c = b == 0 ? v : _mm512_srli_epi32(v, 8 * b);
        if constexpr (BITS == 5) {
          w[b] = _mm512_permutex2var_ps(iota, c, iota16);  // reads the low 5 bits
        } else {
          w[b] = _mm512_cvtepi32_ps(_mm512_and_si512(c, mask));
        }
      }
      const __m512 scale = _mm512_permutexvar_ps(lane_group, _mm512_maskz_loadu_ps(first, sf + r * groups + g));
      for (int t = 0; t < MT; t++) {
        const float* xt = xp + (m0 + t) * q.K + k;
        __m512 s = _mm512_mul_ps(w[0], _mm512_load_ps(xt));
        s = _mm512_fmadd_ps(w[1], _mm512_load_ps(xt + 16), s);
        s = _mm512_fmadd_ps(w[2], _mm512_load_ps(xt + 32), s);
        s = _mm512_fmadd_ps(w[3], _mm512_load_ps(xt + 48), s);
        acc[r][t] = _mm512_fmadd_ps(s, scale, acc[r][t]);
      }
    }
  }
  __m512 biased[R][MT];  // each group's bias times its sum of x
  for (int r = 0; r < R; r++)
    for (int t = 0; t < MT; t++) {
      __m512 e = _mm512_setzero_ps();
      for (int64_t g = 0; g < groups; g += 16)
        e = _mm512_fmadd_ps(load16(bf + r * groups, g, groups), load16(xsum + (m0 + t) * groups, g, groups), e);
      biased[r][t] = e;
    }
  store_sums<R, MT>(acc, m0, y, ldy, n, biased);
}

// Weight rows [n0, n1) in blocks of R: scales/biases converted once per block,
// then every tile of MT x rows passes over the block.
template <int BITS, int R>
void row_blocks(Scratch& s, const QMat& q, const float* x, const float* xsum, int64_t M, float* y, int64_t ldy,
                int64_t n1, int64_t& n) {
  const int64_t groups = q.K / q.group;
  // scales and biases are converted for SPAN rows at a time (a call per block of R rows cost
  // several percent of a decode step)
  constexpr int64_t SPAN = 64 / R * R;
  s.scales.resize(SPAN * groups);
  s.biases.resize(SPAN * groups);
  const int64_t row_bytes = q.K * BITS / 8, ahead = std::max<int64_t>(PREFETCH_BYTES / row_bytes, R);
  const int64_t srow = groups * scale_bytes(q.scale_type);  // scale bytes a row
  const bool direct = q.scale_type == kF32 && q.biases != nullptr;
  for (int64_t base = n, converted = n; n + R <= n1; n += R) {
    // weights stream from memory: ask for the rows a few blocks ahead while these compute, into L2
    // (prefetcht1): on Zen 4, decode measured 12-24% faster than prefetching into L1, where the
    // prefetches had competed with the kernel's own loads for L1's miss buffers
    if (n + ahead + R <= q.N) {
      const char* p = reinterpret_cast<const char*>(q.w + (n + ahead) * row_bytes);
      for (int64_t b = 0; b < R * row_bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
    }
    // and their scales and biases a span ahead, read in one burst when the span starts (their
    // misses had cost as much as a quarter of a decode step's products); a few lines a block, as
    // a burst of prefetches at the span's start is partly dropped
    if (n + SPAN + R <= q.N) {
      const int64_t first = (n + SPAN) * srow;
      for (int64_t b = 0; b < R * srow; b += 64) {
        _mm_prefetch(static_cast<const char*>(q.scales) + first + b, _MM_HINT_T0);
        if (q.biases != nullptr) _mm_prefetch(static_cast<const char*>(q.biases) + first + b, _MM_HINT_T0);
      }
    }
    if (direct) {
      // float32 scales and biases (GGUF's K-quants) are read where they are: copying them had cost
      // about 1% of a decode step
    } else if (n == converted) {
      const int64_t count = std::min(SPAN, (n1 - n) / R * R) * groups;
      to_f32(q.scales, q.scale_type, n * groups, count, s.scales.data());
      if (q.fp4) {
        // no biases: the tables are e2m1 values times the scale
      } else if (q.biases != nullptr) {
        to_f32(q.biases, q.scale_type, n * groups, count, s.biases.data());
      } else {
        for (int64_t i = 0; i < count; i++) s.biases[i] = symmetric_bias(q, s.scales[i]);
      }
      base = n;
      converted = n + count / groups;
    }
    const float* sf = direct ? static_cast<const float*>(q.scales) + n * groups : s.scales.data() + (n - base) * groups;
    const float* bf = direct ? static_cast<const float*>(q.biases) + n * groups : s.biases.data() + (n - base) * groups;
    int64_t m = 0;
    auto tile = [&](auto mt) {
      constexpr int MT = decltype(mt)::value;
      for (; m + MT <= M; m += MT) {
        if constexpr (BITS == 4) {
          if (q.fp4) {
            q4_block<R, MT, true>(q, x, sf, bf, m, y, ldy, n);
          } else {
            q4_block<R, MT>(q, x, sf, bf, m, y, ldy, n);
          }
        } else if constexpr (BITS == 8) {
          convert_block<8, R, MT>(q, x, sf, bf, m, y, ldy, n);
        } else if constexpr (BITS >= 5) {
          if (xsum != nullptr) {
            multishift_block<BITS, R, MT>(q, x, xsum, sf, bf, m, y, ldy, n);
          } else if (q.group == 16 || converts_faster<BITS>()) {
            convert_block<BITS, R, MT>(q, x, sf, bf, m, y, ldy, n);
          } else {
            lut_block<BITS, R, MT>(q, x, sf, bf, m, y, ldy, n);
          }
        } else {
          lut_block<BITS, R, MT>(q, x, sf, bf, m, y, ldy, n);
        }
      }
    };
    if constexpr (R <= 2) tile(std::integral_constant<int, 8>{});
    if constexpr (R <= 2) tile(std::integral_constant<int, 4>{});  // the rest: 4 + 2 + 1
    if constexpr (R <= 4) tile(std::integral_constant<int, 2>{});
    tile(std::integral_constant<int, 1>{});
  }
}

template <int BITS>
void rows_bits(const QMat& q, const float* x, int64_t M, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  Scratch& s = scratch();  // once a call: each thread-local lookup is a __tls_get_addr in a shared library
  // the kernels' loads of x are aligned: x as given where it starts on a cache line (no copy a
  // chunk), else copied
  const float* xk = x;
  const float* xsum = nullptr;  // the multishift kernel's group sums of x
  if (multishifts<BITS>(q)) {
    s.xp.resize(M * q.K);
    s.xsum.resize(M * (q.K / q.group));
    split_four(x, M, q.K, q.group, s.xp.data(), s.xsum.data());
    xk = s.xp.data();
    xsum = s.xsum.data();
  } else if (BITS == 4 || reinterpret_cast<uintptr_t>(x) % 64 != 0) {
    s.xp.resize(M * q.K);
    if constexpr (BITS == 4) {
      split_even_odd(x, M, q.K, s.xp.data());
    } else {
      std::memcpy(s.xp.data(), x, sizeof(float) * M * q.K);
    }
    xk = s.xp.data();
  }
  int64_t n = n0;
  // 1-3 x rows: four weight rows at once; more: two weight rows under tiles of up to eight x rows (measured best)
  if (M <= 3) row_blocks<BITS, 4>(s, q, xk, xsum, M, y, ldy, n1, n);
  row_blocks<BITS, 2>(s, q, xk, xsum, M, y, ldy, n1, n);
  row_blocks<BITS, 1>(s, q, xk, xsum, M, y, ldy, n1, n);
}

// ------------------------------------------------------------ dequantized rows (GEMM panels)
// Sixteen 4-bit codes from p (8 bytes: value 2t the low nibble of byte t, 2t + 1 its high one) as floats.
inline __m512 nibbles16(const uint8_t* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)), low = _mm_set1_epi8(0x0f);
  const __m128i pairs = _mm_unpacklo_epi8(_mm_and_si128(b, low), _mm_and_si128(_mm_srli_epi16(b, 4), low));
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(pairs));
}

// Rows [n0, n1) as floats into dst, sixteen values a multiply-add (scale * q + bias: the AVX2 and
// row kernels' arithmetic, so the same bits); the block's scales and biases converted at once.
template <int BITS>
void dequant_bits(const QMat& q, float* dst, int64_t n0, int64_t n1) {
  const int64_t groups = q.K / q.group, row_bytes = q.K * BITS / 8, count = (n1 - n0) * groups;
  const uint8_t* end = q.w + q.N * row_bytes;
  Scratch& s = scratch();
  s.scales.resize(count);
  s.biases.resize(count);
  to_f32(q.scales, q.scale_type, n0 * groups, count, s.scales.data());
  if (q.biases != nullptr) {
    to_f32(q.biases, q.scale_type, n0 * groups, count, s.biases.data());
  } else {
    for (int64_t i = 0; i < count; i++) s.biases[i] = symmetric_bias(q, s.scales[i]);
  }
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t* row = q.w + n * row_bytes;
    float* out = dst + (n - n0) * q.K;
    const float *sf = s.scales.data() + (n - n0) * groups, *bf = s.biases.data() + (n - n0) * groups;
    for (int64_t g = 0; g < groups; g++) {
      const __m512 scale = _mm512_set1_ps(sf[g]), bias = _mm512_set1_ps(bf[g]);
      for (int64_t k = g * q.group; k < (g + 1) * q.group; k += 16) {
        const __m512 codes = BITS == 4 ? nibbles16(row + k / 2) : codes16<BITS>(row + k * BITS / 8, end);
        _mm512_storeu_ps(out + k, _mm512_fmadd_ps(codes, scale, bias));
      }
    }
  }
}

// ------------------------------------------------------------ GEMM (many rows of x)
// Prefill chunks and long verifies: each panel of GEMM_NB weight rows is dequantized
// once (into floats, then transposed to [K][GEMM_NB] so a k's 64 weights are four
// vectors) and every GEMM_MR rows of x run a register tile over it: 24 accumulators,
// one broadcast of x and four FMAs per k and row, one FMA chain per output along k.
// The panel stays in L2 while every row of x passes over it; no packing of x.
constexpr int64_t GEMM_NB = 64;
constexpr int GEMM_MR = 6;

// 16 x 16 floats: rows r of `in` (stride ldi) become columns of `out` (stride ldo).
inline void transpose16(const float* in, int64_t ldi, float* out, int64_t ldo) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(in + i * ldi);
  for (int i = 0; i < 16; i += 2) {  // 2 x 2 blocks of single floats
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // pairs
    for (int j = 0; j < 2; j++) {
      r[i + j] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + j]), _mm512_castps_pd(t[i + j + 2])));
      r[i + j + 2] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + j]), _mm512_castps_pd(t[i + j + 2])));
    }
  }
  for (int i = 0; i < 16; i += 8) {  // 128-bit lanes
    for (int j = 0; j < 4; j++) {
      t[i + j] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0xDD);
    }
  }
  for (int j = 0; j < 8; j++) {  // 256-bit halves
    r[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xDD);
  }
  // r[j] now holds column (j's position in the network): map back to the natural order
  static constexpr int ORDER[16] = {0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15};
  for (int j = 0; j < 16; j++) _mm512_storeu_ps(out + ORDER[j] * ldo, r[j]);
}

template <int MR>
void gemm_tile(const float* x, int64_t ldx, const float* panel, int64_t K, float* y, int64_t ldy, int64_t cols) {
  __m512 c[MR][4];
  for (int i = 0; i < MR; i++)
    for (int j = 0; j < 4; j++) c[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k++) {
    const float* b = panel + k * GEMM_NB;
    const __m512 b0 = _mm512_load_ps(b), b1 = _mm512_load_ps(b + 16), b2 = _mm512_load_ps(b + 32),
                 b3 = _mm512_load_ps(b + 48);
#pragma GCC unroll 6
    for (int i = 0; i < MR; i++) {
      const __m512 a = _mm512_set1_ps(x[i * ldx + k]);
      c[i][0] = _mm512_fmadd_ps(a, b0, c[i][0]);
      c[i][1] = _mm512_fmadd_ps(a, b1, c[i][1]);
      c[i][2] = _mm512_fmadd_ps(a, b2, c[i][2]);
      c[i][3] = _mm512_fmadd_ps(a, b3, c[i][3]);
    }
  }
  for (int i = 0; i < MR; i++)
    for (int j = 0; j < 4; j++) store16(y + i * ldy + j * 16, 0, cols - j * 16 < 0 ? 0 : cols - j * 16, c[i][j]);
}

struct GemmScratch {
  Floats rows, panel;
};
GemmScratch& gemm_scratch() {
  thread_local GemmScratch s;
  return s;
}

}  // namespace

void gemm_avx512(const QMat& q, const float* x, int64_t M, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  GemmScratch& s = gemm_scratch();
  s.rows.resize(GEMM_NB * q.K);
  s.panel.resize(GEMM_NB * q.K);
  for (int64_t p0 = n0; p0 < n1; p0 += GEMM_NB) {
    const int64_t cols = std::min(GEMM_NB, n1 - p0);
    dequant_avx512(q, s.rows.data(), p0, p0 + cols);
    if (cols < GEMM_NB) std::fill(s.rows.begin() + cols * q.K, s.rows.end(), 0.0f);
    for (int64_t k = 0; k < q.K; k += 16)
      for (int64_t j = 0; j < GEMM_NB; j += 16)
        transpose16(s.rows.data() + j * q.K + k, q.K, s.panel.data() + k * GEMM_NB + j, GEMM_NB);
    const float* panel = s.panel.data();
    int64_t m = 0;
    for (; m + GEMM_MR <= M; m += GEMM_MR) gemm_tile<GEMM_MR>(x + m * q.K, q.K, panel, q.K, y + m * ldy + p0, ldy, cols);
    switch (M - m) {
      case 5: gemm_tile<5>(x + m * q.K, q.K, panel, q.K, y + m * ldy + p0, ldy, cols); break;
      case 4: gemm_tile<4>(x + m * q.K, q.K, panel, q.K, y + m * ldy + p0, ldy, cols); break;
      case 3: gemm_tile<3>(x + m * q.K, q.K, panel, q.K, y + m * ldy + p0, ldy, cols); break;
      case 2: gemm_tile<2>(x + m * q.K, q.K, panel, q.K, y + m * ldy + p0, ldy, cols); break;
      case 1: gemm_tile<1>(x + m * q.K, q.K, panel, q.K, y + m * ldy + p0, ldy, cols); break;
      default: break;
    }
  }
}

void dequant_avx512(const QMat& q, float* dst, int64_t n0, int64_t n1) {
  if (!q.fp4 && q.group % 16 == 0) {
    switch (q.bits) {
      case 2: return dequant_bits<2>(q, dst, n0, n1);
      case 3: return dequant_bits<3>(q, dst, n0, n1);
      case 4: return dequant_bits<4>(q, dst, n0, n1);
      case 5: return dequant_bits<5>(q, dst, n0, n1);
      case 6: return dequant_bits<6>(q, dst, n0, n1);
      case 8: return dequant_bits<8>(q, dst, n0, n1);
      default: break;
    }
  }
  dequant_avx2(q, dst, n0, n1);
}

void avx512_force_path(int path) { forced_path.store(path, std::memory_order_relaxed); }

void rows_avx512(const QMat& q, const float* x, int64_t M, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  if (q.bits == 4 && q.group % 32 == 0) return rows_bits<4>(q, x, M, y, ldy, n0, n1);
  if (q.fp4) return rows_scalar(q, x, M, y, ldy, n0, n1);
  if (q.group % 16 == 0) {
    switch (q.bits) {
      case 2: return rows_bits<2>(q, x, M, y, ldy, n0, n1);
      case 3: return rows_bits<3>(q, x, M, y, ldy, n0, n1);
      case 5: return rows_bits<5>(q, x, M, y, ldy, n0, n1);
      case 6: return rows_bits<6>(q, x, M, y, ldy, n0, n1);
      case 8: return rows_bits<8>(q, x, M, y, ldy, n0, n1);
      default: break;
    }
  }
  rows_avx2(q, x, M, y, ldy, n0, n1);
}

// ------------------------------------------------------------ attention (one query)
// Lanes [16 c, 16 c + 16) of a row of n values (none past n).
inline __mmask16 chunk_mask(int64_t c, int64_t n) { return c * 16 >= n ? (__mmask16)0 : tail16(c * 16, n); }

// The sixteen horizontal sums of acc: lane j of the result is the sum of the
// lanes of acc[j / 4 + 4 (j % 4)], added in _mm512_reduce_add_ps's order
// (halves, quarters, then (0 + 2) + (1 + 3)), so a score's bits do not depend
// on whether it was reduced alone or with fifteen others.
inline __m512 reduce16(const __m512 (&acc)[16]) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; i++)
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; i++)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  const __m512 d0 = _mm512_add_ps(_mm512_unpacklo_ps(c[0], c[1]), _mm512_unpackhi_ps(c[0], c[1]));
  const __m512 d1 = _mm512_add_ps(_mm512_unpacklo_ps(c[2], c[3]), _mm512_unpackhi_ps(c[2], c[3]));
  return _mm512_add_ps(_mm512_shuffle_ps(d0, d1, 0x44), _mm512_shuffle_ps(d0, d1, 0xEE));
}

// Scores of keys [t0, t0 + 16) (none past the visible ones), -inf where hidden.
template <int C>
inline __m512 scores16(const AttnRow& a, const __m512 (&qv)[C], const __mmask16 (&qm)[C], int64_t t0, int64_t end,
                       bool ahead) {
  const int n = (int)std::min<int64_t>(16, end - t0);
  __mmask16 live = tail16(0, n);
  if (a.mask != nullptr)
    for (int j = 0; j < n; j++)
      if (!a.mask[(t0 + j) * a.ms]) live &= (__mmask16) ~(1u << j);
  const __m512 none = _mm512_set1_ps(-INFINITY);
  if (live == 0) return none;
  __m512 acc[16];
#pragma GCC unroll 16
  for (int j = 0; j < 16; j++) {
    __m512 s = _mm512_setzero_ps();
    if (j < n) {
      const float* kr = a.k + (t0 + j) * a.ks;
      if (ahead) prefetch_ahead(kr, a.ks, t0 + j, a.T, a.D * 4);
#pragma GCC unroll 8
      for (int c = 0; c < C; c++) s = _mm512_fmadd_ps(qv[c], _mm512_maskz_loadu_ps(qm[c], kr + c * 16), s);
    }
    acc[j / 4 + 4 * (j % 4)] = s;
  }
  return _mm512_mask_mov_ps(none, live, reduce16(acc));
}

// A query's registers: C chunks of sixteen (a compile-time count keeps the query and the output
// in registers); chunks past the head size are masked off and add exact zeros (EXACT: both head
// sizes are 16 C, no masks).
template <int C, bool EXACT>
struct Query {
  __m512 qv[C];
  __mmask16 qm[C], vm[C];
  explicit Query(const AttnRow& a) {
#pragma GCC unroll 32
    for (int c = 0; c < C; c++) {
      qm[c] = EXACT ? (__mmask16)0xffff : chunk_mask(c, a.D);
      vm[c] = EXACT ? (__mmask16)0xffff : chunk_mask(c, a.Dv);
      qv[c] = _mm512_mul_ps(_mm512_maskz_loadu_ps(qm[c], a.q + c * 16), _mm512_set1_ps(a.scale));
    }
  }
};

// Keys from here on are hidden (past the causal limit).
inline int64_t key_end(const AttnRow& a) { return std::min(a.T, std::max<int64_t>(a.visible, 0)); }

// The scores p[0, end) (-inf where hidden) become their exponentials against the largest, m
// (hidden keys: exact zeros); returns their sum, taken in 2^-40 fixed point. That sum is
// associative: a query's result does not depend on where padding puts its keys, and it is
// vectorized (every term <= 1, the largest exactly 1: truncating each term moves the sum by
// less than end 2^-40 of it).
inline float exponentials(float* p, int64_t end, float m) {
  const __m512 mv = _mm512_set1_ps(m), none = _mm512_set1_ps(-INFINITY), fix = _mm512_set1_ps(0x1p40f);
  __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
  for (int64_t t = 0; t < end; t += 16) {
    const __m512 s = load16(p, t, end);
    const __mmask16 live = _mm512_cmp_ps_mask(s, none, _CMP_NEQ_OQ) & tail16(t, end);
    const __m512 e = _mm512_maskz_mov_ps(live, exp_ps(_mm512_sub_ps(s, mv)));
    store16(p, t, end, e);
    const __m512 f = _mm512_mul_ps(e, fix);
    s0 = _mm512_add_epi64(s0, _mm512_cvttps_epi64(_mm512_castps512_ps256(f)));
    s1 = _mm512_add_epi64(s1, _mm512_cvttps_epi64(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(f), 1))));
  }
  return (float)_mm512_reduce_add_epi64(_mm512_add_epi64(s0, s1)) * 0x1p-40f;
}

// A query's output sums: weighted value rows added in key order, the live keys taken in turn by
// two sets of accumulators (by their count, not their position, so padding moves no key to the
// other set; two chains hide the add's latency). Heads wider than 128 use one set (registers).
template <int C, bool TWO_SETS = (C <= 8)>
struct Sums {
  static constexpr bool TWO = TWO_SETS;
  __m512 y[TWO ? 2 : 1][C];
  bool odd = false;
  Sums() {
    for (auto& set : y)
      for (auto& c : set) c = _mm512_setzero_ps();
  }
  // += p[t] v[t] for keys [t0, t1) (a zero weight, masked or underflowed, adds nothing)
  // (ahead: prefetch rows ahead, for the first query over these rows; FULL: every chunk of vm is
  // whole, and the loads go unmasked: the masks had been reloaded from the stack for every chunk
  // of every key)
  template <bool FULL>
  void add(const AttnRow& a, const float* p, int64_t t0, int64_t t1, const __mmask16 (&vm)[C], bool ahead = false) {
    __m512 e[C], o[C];  // locals: the sums stay in registers (__m512 may alias the weights)
    for (int c = 0; c < C; c++) {
      e[c] = y[0][c];
      o[c] = y[TWO ? 1 : 0][c];
    }
    auto fma = [&](__m512(&acc)[C], int64_t t) {
      const float* vr = a.v + t * a.vs;
      if (ahead) prefetch_ahead(vr, a.vs, t, a.T, a.Dv * 4);
      const __m512 w = _mm512_set1_ps(p[t]);
#pragma GCC unroll 32
      for (int c = 0; c < C; c++)
        acc[c] = _mm512_fmadd_ps(w, FULL ? _mm512_loadu_ps(vr + c * 16) : _mm512_maskz_loadu_ps(vm[c], vr + c * 16), acc[c]);
    };
    const __m512i step = _mm512_set1_epi32(16);
    for (int64_t b = t0; b < t1; b += 64) {
      // this block's live keys in order, then two at a time (one to each set)
      alignas(64) int32_t live[64];
      int n = 0;
      __m512i at = _mm512_add_epi32(_mm512_set1_epi32((int32_t)b),
                                    _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
      const int64_t end = std::min(t1, b + 64);
      for (int64_t t = b; t < end; t += 16, at = _mm512_add_epi32(at, step)) {
        const __mmask16 m = _mm512_cmp_ps_mask(load16(p, t, end), _mm512_setzero_ps(), _CMP_NEQ_UQ) & tail16(t, end);
        // compressed in a register, then stored whole (Zen 4 microcodes a compress to memory: it
        // had cost about as much as the block's multiply-adds); lanes past n are overwritten next
        _mm512_storeu_si512(live + n, _mm512_maskz_compress_epi32(m, at));
        n += __builtin_popcount(m);
      }
      int j = 0;
      if (TWO && odd && n > 0) fma(o, live[j++]);
      if (TWO) {
        for (; j + 1 < n; j += 2) {
          fma(e, live[j]);
          fma(o, live[j + 1]);
        }
        if (j < n) fma(e, live[j++]);
        odd = TWO && ((odd + n) & 1);
      } else {
        for (; j < n; j++) fma(e, live[j]);
      }
    }
    for (int c = 0; c < C; c++) {
      y[0][c] = e[c];
      if (TWO) y[TWO ? 1 : 0][c] = o[c];
    }
  }
  void store(float* out, const __mmask16 (&vm)[C], float sum) const {
    const __m512 inv = _mm512_set1_ps(1.0f / sum);
#pragma GCC unroll 32
    for (int c = 0; c < C; c++) {
      const __m512 total = TWO ? _mm512_add_ps(y[0][c], y[TWO ? 1 : 0][c]) : y[0][c];
      _mm512_mask_storeu_ps(out + c * 16, vm[c], _mm512_mul_ps(total, inv));
    }
  }
};

// Key t's score for a query of a head wider than 128 (-inf where hidden): four chains of C / 4 FMAs
// (one chain of C had bound a key's score to C FMA latencies), then one reduction.
template <int C, bool EXACT>
inline float score_one(const AttnRow& a, const Query<C, EXACT>& q, int64_t t) {
  static_assert(C > 8 && C % 4 == 0);
  if (a.hidden(t)) return -INFINITY;
  const float* kr = a.k + t * a.ks;
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
#pragma GCC unroll 32
  for (int c = 0; c < C; c++) acc[c % 4] = _mm512_fmadd_ps(q.qv[c], _mm512_maskz_loadu_ps(q.qm[c], kr + c * 16), acc[c % 4]);
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
}

// One query of a head wider than 128 (heads up to 128 go through attend_many_chunks, which
// scores sixteen keys per reduction): key by key.
template <int C, bool EXACT>
void attend_chunks(const AttnRow& a, float* p, float* y) {
  const Query<C, EXACT> q(a);
  const int64_t end = key_end(a);
  float m = -INFINITY;
  for (int64_t t = 0; t < end; t++) {
    p[t] = score_one(a, q, t);
    m = std::max(m, p[t]);
  }
  const float sum = exponentials(p, end, m);
  Sums<C> out;
  out.template add<EXACT>(a, p, 0, end, q.vm);
  out.store(y, q.vm, sum);
}

template <int C, bool TWO>
std::vector<Sums<C, TWO>, Aligned64<Sums<C, TWO>>>& sums_scratch() {
  thread_local std::vector<Sums<C, TWO>, Aligned64<Sums<C, TWO>>> v;
  return v;
}

constexpr int64_t MANY = 64;  // queries a pass of attend_many_chunks

// The scores of keys [t0, t1) (t0 a multiple of sixteen) of n queries over one head into p + i T
// (-inf where hidden), and lane by lane each query's largest into mv[i]: sixteen keys at a time
// for all the queries (heads up to 128: one reduction for the sixteen, as a lone query's
// scores16; wider heads key by key, score_one). The first query over a block prefetches ahead.
template <int C, bool EXACT>
void score_keys(const AttnRow* rows, const int64_t* ends, int64_t n, int64_t t0, int64_t t1, float* p, __m512* mv) {
  const int64_t T = rows[0].T;
  for (int64_t t = t0; t < t1; t += 16)
    for (int64_t i = 0, first = 1; i < n; i++) {
      if (t >= ends[i]) continue;
      const Query<C, EXACT> q(rows[i]);
      __m512 s;
      if constexpr (C <= 8) {
        s = scores16<C>(rows[i], q.qv, q.qm, t, ends[i], first);
        store16(p + i * T, t, ends[i], s);
      } else {
        const int64_t end = std::min(ends[i], t + 16);
        for (int64_t k = t; k < end; k++) {
          if (first) prefetch_ahead(rows[i].k + k * rows[i].ks, rows[i].ks, k, T, rows[i].D * 4);
          p[i * T + k] = score_one(rows[i], q, k);
        }
        s = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail16(t, end), p + i * T + t);
      }
      mv[i] = _mm512_max_ps(mv[i], s);
      first = 0;
    }
}

// ys[i][0, 16 C) = each query's values weighted by its exponentials p + i T over keys [0, ends[i]),
// divided by sums[i], in blocks of keys read once for all the queries (rows' v, vs and Dv: the
// dims summed, which may be a part of the head; TWO: the whole head's sets of accumulators).
template <int C, bool TWO>
void value_sums(const AttnRow* rows, float* const* ys, const int64_t* ends, int64_t n, const float* p,
                const float* sums) {
  constexpr int64_t VALUES = TWO ? 64 : 16;  // keys a block of values (16 KiB for heads of 256)
  const int64_t T = rows[0].T, last = *std::max_element(ends, ends + n);
  __mmask16 vm[C];
  for (int c = 0; c < C; c++) vm[c] = chunk_mask(c, rows[0].Dv);
  auto& out = sums_scratch<C, TWO>();
  out.assign(n, Sums<C, TWO>());
  auto sum = [&]<bool FULL>() {
    for (int64_t t = 0; t < last; t += VALUES)
      for (int64_t i = 0, first = 1; i < n; i++)
        if (t < ends[i]) {
          out[i].template add<FULL>(rows[i], p + i * T, t, std::min(t + VALUES, ends[i]), vm, first);
          first = 0;
        }
  };
  if (rows[0].Dv == 16 * C) {
    sum.template operator()<true>();
  } else {
    sum.template operator()<false>();
  }
  for (int64_t i = 0; i < n; i++) out[i].store(ys[i], vm, sums[i]);
}

// Up to 64 queries of one head, each with the arithmetic of one query alone (heads up to 128:
// sixteen keys scored per reduction, as attend_many_avx512 scores a lone query; wider heads: key
// by key, as attend_chunks), in an order that reads each block of keys and values from memory once
// for all of them (the first query over a block prefetches ahead). Heads of 256, one core of Zen 4,
// 16 positions of 4 heads over 512 keys (a prefill chunk's task): 896 -> 643 us against one query
// at a time.
template <int C, bool EXACT>
void attend_many_chunks(const AttnRow* rows, float* const* ys, int64_t n, float* p) {
  __m512 mv[MANY];  // each query's largest scores, lane by lane
  int64_t ends[MANY];
  for (int64_t i = 0; i < n; i++) {
    ends[i] = key_end(rows[i]);
    mv[i] = _mm512_set1_ps(-INFINITY);
  }
  score_keys<C, EXACT>(rows, ends, n, 0, *std::max_element(ends, ends + n), p, mv);
  float sums[MANY];
  for (int64_t i = 0; i < n; i++) sums[i] = exponentials(p + i * rows[0].T, ends[i], _mm512_reduce_max_ps(mv[i]));
  value_sums<C, C <= 8>(rows, ys, ends, n, p, sums);
}

void attend_avx512(const AttnRow& a, float* p, float* y) {
  const int64_t chunks = (std::max(a.D, a.Dv) + 15) / 16;
  if (chunks <= 8) return attend_many_avx512(&a, &y, 1, p);
  if (a.D == a.Dv && a.D == 256) return attend_chunks<16, true>(a, p, y);
  if (chunks <= 16) return attend_chunks<16, false>(a, p, y);
  if (chunks <= 32) return attend_chunks<32, false>(a, p, y);  // to 512 (some of it spills)
  attend_scalar(a, p, y);
}

// f.template operator()<C, EXACT>() with attend_many_avx512's registers for a head's sizes: C chunks
// of sixteen (EXACT: both sizes 16 C); false for heads over 512 (no chunked kernel: key by key).
template <class F>
bool by_chunks(const AttnRow& a, F&& f) {
  const int64_t chunks = (std::max(a.D, a.Dv) + 15) / 16;
  if (a.D == a.Dv && a.D == 64) {
    f.template operator()<4, true>();
  } else if (a.D == a.Dv && a.D == 128) {
    f.template operator()<8, true>();
  } else if (chunks <= 4) {
    f.template operator()<4, false>();
  } else if (chunks <= 8) {
    f.template operator()<8, false>();
  } else if (a.D == a.Dv && a.D == 256) {
    f.template operator()<16, true>();
  } else if (chunks <= 16) {
    f.template operator()<16, false>();
  } else if (chunks <= 32) {
    f.template operator()<32, false>();
  } else {
    return false;
  }
  return true;
}

void attend_many_avx512(const AttnRow* rows, float* const* ys, int64_t n, float* p) {
  const int64_t chunks = (std::max(rows[0].D, rows[0].Dv) + 15) / 16;
  for (int64_t i0 = 0; i0 < n; i0 += MANY) {
    const int64_t m = std::min<int64_t>(MANY, n - i0);
    const AttnRow* r = rows + i0;
    float* const* y = ys + i0;
    if (m == 1 && chunks > 8) {
      attend_avx512(*r, p, *y);
    } else if (!by_chunks(*r, [&]<int C, bool EXACT>() { attend_many_chunks<C, EXACT>(r, y, m, p); })) {
      attend_each<attend_avx512>(r, y, m, p);
    }
  }
}

bool attend_scores_avx512(const AttnRow* rows, int64_t n, int64_t t0, int64_t t1, float* p, float* top) {
  if (n > MANY || t0 % 16 != 0) return false;
  int64_t ends[MANY];
  __m512 mv[MANY];
  for (int64_t i = 0; i < n; i++) {
    ends[i] = std::min(key_end(rows[i]), t1);
    mv[i] = _mm512_set1_ps(-INFINITY);
  }
  const int64_t last = *std::max_element(ends, ends + n);
  const bool done =
      by_chunks(rows[0], [&]<int C, bool EXACT>() { score_keys<C, EXACT>(rows, ends, n, t0, last, p, mv); });
  for (int64_t i = 0; i < n && done; i++) top[i] = _mm512_reduce_max_ps(mv[i]);
  return done;
}

bool attend_values_avx512(const AttnRow* rows, float* const* ys, int64_t n, const float* p, const float* top,
                          int64_t d0, int64_t d1, float* e) {
  if (n > MANY || d0 % 16 != 0 || (d1 % 16 != 0 && d1 != rows[0].Dv)) return false;
  const int64_t T = rows[0].T;
  int64_t ends[MANY];
  float sums[MANY];
  AttnRow part[MANY];
  float* outs[MANY];
  for (int64_t i = 0; i < n; i++) {
    ends[i] = key_end(rows[i]);
    std::copy(p + i * T, p + i * T + ends[i], e + i * T);
    sums[i] = exponentials(e + i * T, ends[i], top[i]);
    part[i] = rows[i];
    part[i].v += d0;
    part[i].Dv = d1 - d0;
    outs[i] = ys[i] + d0;
  }
  // the dims' chunks in registers of the smallest fitting count, with the whole head's sets of sums
  const int64_t chunks = (d1 - d0 + 15) / 16;
  return by_chunks(rows[0], [&]<int C, bool EXACT>() {
    constexpr bool TWO = C <= 8;
    if (chunks <= 1) {
      value_sums<1, TWO>(part, outs, ends, n, e, sums);
    } else if (chunks <= 2) {
      value_sums<2, TWO>(part, outs, ends, n, e, sums);
    } else if (chunks <= 4) {
      value_sums<4, TWO>(part, outs, ends, n, e, sums);
    } else if (chunks <= 8) {
      value_sums<8, TWO>(part, outs, ends, n, e, sums);
    } else if (chunks <= 16) {
      value_sums<16, TWO>(part, outs, ends, n, e, sums);
    } else {
      value_sums<32, TWO>(part, outs, ends, n, e, sums);
    }
  });
}

// ------------------------------------------------------------ argmax
// Each lane keeps the first of its values strictly above its best, or its first NaN (a lane that
// holds a NaN takes nothing more); then the smallest index among the lanes holding a NaN, else
// among those holding the largest best.
ArgMax argmax_avx512(const float* x, int64_t n) {
  const __m512 none = _mm512_set1_ps(-INFINITY);
  __m512 best = none;
  __mmask16 nan = 0;
  __m512i at = _mm512_set1_epi64(-1), at_hi = at;  // lanes 0-7, 8-15: 64-bit indices
  __m512i index = _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7);
  const __m512i step = _mm512_set1_epi64(16), half = _mm512_set1_epi64(8);
  for (int64_t i = 0; i < n; i += 16, index = _mm512_add_epi64(index, step)) {
    const __m512 v = _mm512_mask_loadu_ps(none, tail16(i, n), x + i);
    const __mmask16 up = _mm512_cmp_ps_mask(v, best, _CMP_NLE_UQ) & (__mmask16)~nan;  // greater, or NaN
    if (up == 0) [[likely]] continue;
    nan |= _mm512_mask_cmp_ps_mask(up, v, v, _CMP_UNORD_Q);
    best = _mm512_mask_mov_ps(best, up, v);
    at = _mm512_mask_mov_epi64(at, (__mmask8)up, index);
    at_hi = _mm512_mask_mov_epi64(at_hi, (__mmask8)(up >> 8), _mm512_add_epi64(index, half));
  }
  const float top = nan ? NAN : _mm512_reduce_max_ps(best);
  if (top == -INFINITY) return {-INFINITY, -1};
  const __mmask16 chosen = nan ? nan : _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
  const __m512i far = _mm512_set1_epi64(INT64_MAX);
  const int64_t lo = _mm512_reduce_min_epi64(_mm512_mask_mov_epi64(far, (__mmask8)chosen, at));
  const int64_t hi = _mm512_reduce_min_epi64(_mm512_mask_mov_epi64(far, (__mmask8)(chosen >> 8), at_hi));
  return {top, std::min(lo, hi)};
}

// ------------------------------------------------------------ rms norm, silu * up
void rms_norm_avx512(const float* x, int64_t xs, const float* w, float* y, int64_t rows, int64_t D, float eps) {
  for (int64_t r = 0; r < rows; r++) {
    const float* xr = x + r * xs;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 v = load16(xr, d, D);
      acc = _mm512_fmadd_ps(v, v, acc);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(acc) / (float)D + eps));
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 v = _mm512_mul_ps(load16(xr, d, D), inv);
      store16(y + r * D, d, D, w ? _mm512_mul_ps(v, load16(w, d, D)) : v);
    }
  }
}

void silu_mul_avx512(const float* g, int64_t gs, const float* u, int64_t us, float* y, int64_t rows, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t r = 0; r < rows; r++) {
    for (int64_t i = 0; i < n; i += 16) {
      const __m512 a = load16(g + r * gs, i, n);
      const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), a));
      store16(y + r * n, i, n, _mm512_mul_ps(_mm512_div_ps(a, _mm512_add_ps(one, e)), load16(u + r * us, i, n)));
    }
  }
}

void gelu_tanh_mul_avx512(const float* g, int64_t gs, const float* u, int64_t us, float* y, int64_t rows, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.0f), two = _mm512_set1_ps(2.0f);
  const __m512 c = _mm512_set1_ps(0.7978845608028654f), k = _mm512_set1_ps(0.044715f);
  for (int64_t r = 0; r < rows; r++) {
    for (int64_t i = 0; i < n; i += 16) {
      const __m512 a = load16(g + r * gs, i, n);
      const __m512 z = _mm512_mul_ps(c, _mm512_fmadd_ps(_mm512_mul_ps(k, a), _mm512_mul_ps(a, a), a));
      // 0.5 (1 + tanh(z)) = sigmoid(2 z): no cancellation for either sign of z
      const __m512 t = _mm512_div_ps(one, _mm512_add_ps(one, exp_ps(_mm512_mul_ps(two, _mm512_sub_ps(_mm512_setzero_ps(), z)))));
      store16(y + r * n, i, n, _mm512_mul_ps(_mm512_mul_ps(a, t), load16(u + r * us, i, n)));
    }
  }
}

// ------------------------------------------------------------ quantized KV rows
namespace {

// The normalized Walsh-Hadamard transform of C chunks of sixteen floats, in place.
template <int C>
void wht(__m512 (&v)[C]) {
#pragma GCC unroll 8
  for (int h = 1; h < C; h <<= 1)
    for (int i = 0; i < C; i++)
      if (!(i & h)) {
        const __m512 a = v[i], b = v[i + h];
        v[i] = _mm512_add_ps(a, b);
        v[i + h] = _mm512_sub_ps(a, b);
      }
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#pragma GCC unroll 4
  for (int h = 1; h < 16; h <<= 1) {
    // lane i: x[i ^ h] + (i & h ? -1 : 1) * x[i]
    const __m512i partner = _mm512_xor_si512(lane, _mm512_set1_epi32(h));
    const __mmask16 upper = _mm512_test_epi32_mask(lane, _mm512_set1_epi32(h));
    const __m512 sign = _mm512_mask_blend_ps(upper, _mm512_set1_ps(1.0f), _mm512_set1_ps(-1.0f));
    for (int i = 0; i < C; i++) v[i] = _mm512_fmadd_ps(v[i], sign, _mm512_permutexvar_ps(partner, v[i]));
  }
  const __m512 norm = _mm512_set1_ps(1.0f / std::sqrt(16.0f * C));
  for (int i = 0; i < C; i++) v[i] = _mm512_mul_ps(v[i], norm);
}

template <int BITS, int C>
void kv_row(const uint8_t* w, const void* scales, const void* biases, int scale_type, int group, bool rotate, float* out) {
  const int64_t D = 16 * C;
  alignas(64) float sf[C * 16 / 8], bf[C * 16 / 8];  // groups of at least 8
  const int64_t groups = D / group;
  to_f32(scales, scale_type, 0, groups, sf);
  if (biases) {
    to_f32(biases, scale_type, 0, groups, bf);
  } else {
    for (int64_t g = 0; g < groups; g++) bf[g] = -(float)(1 << (BITS - 1)) * sf[g];
  }
  const uint8_t* end = w + D * BITS / 8;
  __m512 v[C];
#pragma GCC unroll 32
  for (int c = 0; c < C; c++) {
    const int64_t g = c * 16 / group;
    v[c] = _mm512_fmadd_ps(codes16<BITS>(w + c * 16 * BITS / 8, end), _mm512_set1_ps(sf[g]), _mm512_set1_ps(bf[g]));
  }
  if (rotate) wht<C>(v);
  for (int c = 0; c < C; c++) _mm512_storeu_ps(out + c * 16, v[c]);
}

template <int BITS>
bool kv_row_bits(const uint8_t* w, const void* s, const void* b, int st, int64_t D, int group, bool rotate, float* out) {
  switch (D) {
    case 32: kv_row<BITS, 2>(w, s, b, st, group, rotate, out); return true;
    case 64: kv_row<BITS, 4>(w, s, b, st, group, rotate, out); return true;
    case 128: kv_row<BITS, 8>(w, s, b, st, group, rotate, out); return true;
    case 256: kv_row<BITS, 16>(w, s, b, st, group, rotate, out); return true;
    default: return false;
  }
}

}  // namespace

void kv_row_avx512(const uint8_t* w, const void* scales, const void* biases, int scale_type, int64_t D, int group,
                   int bits, bool rotate, float* out) {
  // groups of sixteen or more: each chunk of sixteen values lies in one group
  const bool done = group % 16 == 0 && (bits == 8   ? kv_row_bits<8>(w, scales, biases, scale_type, D, group, rotate, out)
                                        : bits == 4 ? kv_row_bits<4>(w, scales, biases, scale_type, D, group, rotate, out)
                                                    : false);
  if (!done) kv_row_scalar(w, scales, biases, scale_type, D, group, bits, rotate, out);
}

}  // namespace tsq
