// Small-row matrix products for decoding and tree verification on CPU (an XLA FFI handler).
//
// y[R, N] = x[R, K] @ W, with W packed as panels [N / P, K, P]: each panel is one contiguous
// stream, so the weights are read once, sequentially, at memory bandwidth, whatever R is (the
// row tiles reuse a panel from cache). XLA:CPU's own dot reads weights at ~24 GB/s for
// one row but 13-17 GB/s for 2-8 rows, which made verifying a draft tree cost 1.4-1.9x a decode
// step. Every output element is computed by the same operations in the same order whatever R is
// and whichever rows share the call, so a row's result is bit-identical (decode and verify agree).
// The panel width P is the build's (`spec_jax_gemm_panel()`): 32 with AVX-512, 16 without.
//
// Work is split over chunks of panels, shared with XLA's intra-op pool (pool.h). A call may
// also transform x first (RMSNorm or SwiGLU: `prologue`) and y after (RoPE or a residual add:
// `epilogue`), row by row, so those are no XLA ops of their own.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <type_traits>
#include <vector>

#include <immintrin.h>

#include "pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Tiles of TB rows x a whole panel keep TB * kNV accumulators, kNV weight vectors and a broadcast
// in vector registers. AVX-512 (32 registers of 16 floats): panels of 32 columns, up to 8 rows
// per tile for codes and 12 for float32 (`kTopOf`: 12 tokens ran as an 8- and a 4-row tile and
// cost 1.4x one token's forward; in one tile their FMAs fit under the weight stream again,
// 1.25x). AVX2 (16 registers of 8 floats): panels of 16 columns, up to 6 rows per tile (the
// classic 6 x 16 tile, 12 + 2 + 1 registers). A 16-column panel row is one cache line, so every
// tile reads its panel in one sequential pass; with 32-column panels AVX2 had to take 4 rows in
// two column halves, each a strided pass, and reached 22 GB/s instead of 34. Vector types wider
// than the machine's make GCC keep accumulators on the stack (4x slower on an AVX2 Zen 3).
// Both prefetch the panel kPrefetch rows ahead (every cache line of that row): without it the
// loads of the next rows wait behind the FMAs of this one, so a tile of several rows streams
// slower than one row. AVX2, 4-row tiles: 2/3 of the one-row speed without it. AVX-512 on a Zen 4
// EPYC, SmolLM2's whole forward (sizing.verify_latency, best of 3 x 6, five processes each way):
// T = 8 tokens 15.3-16.6 ms with 32 rows ahead against 17.0-19.9 without, T = 4 13.7-14.2
// against 13.9-16.7, T = 1 unchanged (~12 ms).
// AVX-512 also prefetches into L2 kFar times as far ahead (run 52): the L1 prefetch
// alone leaves a tile of 8-12 rows, whose FMAs take longer than the row's load, short of lines in
// flight. A [576, 1536] float32 matrix streamed from memory, 60 distinct per pass, best of 8, four
// rounds alternating processes, us for 1 / 8 / 12 rows: 111.0-112.5 / 111.5-113.9 / 124.0-131.6
// with the L1 prefetch alone, 107.3-113.8 / 105.6-108.6 / 111.9-115.9 with both.
#if defined(__AVX512F__)
constexpr int kVec = 16, kPanel = 32, kTop = 8, kPrefetch = 32, kFar = 4;
#else
constexpr int kVec = 8, kPanel = 16, kTop = 6, kPrefetch = 16, kFar = 0;
#endif
constexpr int kNV = kPanel / kVec;  // vectors per panel row
// Rows per full tile: float32 panels take 12 on AVX-512 (24 accumulators), codes keep 8 (their
// per-block sums double the accumulators), AVX2 keeps 6.
template <typename W>
constexpr int kTopOf = std::is_same_v<W, float> && kTop == 8 ? 12 : kTop;
typedef float vec __attribute__((vector_size(kVec * sizeof(float))));
typedef float vec_u __attribute__((vector_size(kVec * sizeof(float)), aligned(4), may_alias));

// Weights are float32, or bfloat16 (uint16 bits) for draft heads: half the bytes to stream, and
// each converts exactly to float32 in registers (zero-extend, shift left 16), so the arithmetic
// is the float32 kernel's on the rounded weights.
typedef uint16_t hvec_u __attribute__((vector_size(kVec * sizeof(uint16_t)), aligned(2), may_alias));
typedef uint32_t uvec __attribute__((vector_size(kVec * sizeof(uint32_t))));

inline vec load_w(const float* w) { return *reinterpret_cast<const vec_u*>(w); }
inline vec load_w(const uint16_t* w) {
  return (vec)(__builtin_convertvector(*reinterpret_cast<const hvec_u*>(w), uvec) << 16);
}

// Or uint8 codes q with a float16 scale d and offset m per column and block of kBlock rows of K:
// w = d * q + m. That is how GGUF's Q4_1 and Q8_0 blocks dequantize (a 16-bit d times an 8-bit q
// is exact in float32, so the one rounding is the add's), so the codes hold exactly the float32
// weights a target converted from such a file has (`gemm.pack_exact`) while streaming 1.125
// bytes per weight instead of 4, or 0.625 where every code fits 4 bits (Q4_1). The kernel sums
// x * q per block and applies d and m * sum(x) once per block (`tile`), so its products match the
// float32 kernel's to rounding, not to the bit. A 4-bit panel row is kPanel / 2 bytes, byte j
// holding column j in its low half and column j + kVec in its high half (`Nib`), so one load and
// zero-extension gives both of the row's vectors (a mask and a shift apart).
constexpr int64_t kBlock = 32;
struct Nib {  // tag: a byte of two 4-bit codes
  uint8_t b;
};
static_assert(kNV == 2, "4-bit panels hold a panel row's two vectors in one run of bytes");
template <typename W>
constexpr int kRow = std::is_same_v<W, Nib> ? kPanel / 2 : kPanel;  // elements per panel row
// Prefetch distance in elements: kPrefetch float32 rows' worth of bytes, whatever the element.
template <typename W>
constexpr int64_t kAhead = int64_t{kPrefetch} * kPanel * 4 / sizeof(W) / kRow<W> * kRow<W>;

#if defined(__AVX512F__)
inline __m512i widen(const uint8_t* w) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)w)); }
inline vec to_vec(__m512i q) { return (vec)_mm512_cvtepi32_ps(q); }
inline __m512i low4(__m512i q) { return _mm512_and_si512(q, _mm512_set1_epi32(15)); }
inline __m512i high4(__m512i q) { return _mm512_srli_epi32(q, 4); }
inline vec load_s(const uint16_t* s) { return (vec)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)s)); }
#else
inline __m256i widen(const uint8_t* w) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)w)); }
inline vec to_vec(__m256i q) { return (vec)_mm256_cvtepi32_ps(q); }
inline __m256i low4(__m256i q) { return _mm256_and_si256(q, _mm256_set1_epi32(15)); }
inline __m256i high4(__m256i q) { return _mm256_srli_epi32(q, 4); }
inline vec load_s(const uint16_t* s) { return (vec)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)s)); }
#endif

// The kNV vectors of one panel row, as float32.
template <typename W>
inline void load_row(const W* w, vec* wv) {
#pragma GCC unroll 16
  for (int v = 0; v < kNV; ++v) wv[v] = load_w(w + v * kVec);
}
inline void load_row(const uint8_t* w, vec* wv) {
#pragma GCC unroll 16
  for (int v = 0; v < kNV; ++v) wv[v] = to_vec(widen(w + v * kVec));
}
inline void load_row(const Nib* w, vec* wv) {
  const auto q = widen(reinterpret_cast<const uint8_t*>(w));
  wv[0] = to_vec(low4(q));
  wv[1] = to_vec(high4(q));
}

// y[t, panel's columns] for TB rows, the same operations per row in every tile shape, so a row's
// result does not depend on R. Float weights: one fused multiply-add chain over k = 0..K-1 per
// element. Codes: per block of kBlock rows of K, the chain sum_k x[t, k] * q[k] in registers, then
// y += d * that + m * xsum[t, block] (xsum: the block's sum of x, `block_sums`), so a weight costs
// its conversion and the row's FMA instead of also the d * q + m one: a row of codes is
// arithmetic-bound, not stream-bound (run 44: a one-token pass 5.8 -> 5.3 ms).
// `scales` ([K / kBlock, 2, kPanel] float16: d, then m) and `xsum` ([TB][K / kBlock]) are read for
// code panels only.
template <int TB, typename W>
inline void tile(const float* __restrict x, int64_t K, const W* __restrict panel,
                 const uint16_t* __restrict scales, const float* __restrict xsum,
                 float* __restrict y, int64_t N) {
  constexpr bool kAffine = std::is_same_v<W, uint8_t> || std::is_same_v<W, Nib>;
  constexpr int NV = kNV;
  constexpr int kLine = 64 / sizeof(W);  // elements per cache line
  vec acc[TB][NV];
#pragma GCC unroll 16
  for (int t = 0; t < TB; ++t)
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) acc[t][v] = vec{};
  const W* w = panel;
  const int64_t span = kAffine ? kBlock : K;  // rows of K sharing one d and m
  const int64_t blocks = K / kBlock;
  for (int64_t k0 = 0; k0 < K; k0 += span) {
    vec blk[TB][NV];
#pragma GCC unroll 16
    for (int t = 0; t < TB; ++t)
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) blk[t][v] = vec{};
    vec(&sum)[TB][NV] = kAffine ? blk : acc;
    for (int64_t k = k0; k < k0 + span; ++k, w += kRow<W>) {
      if constexpr (kPrefetch > 0) {
#pragma GCC unroll 4
        for (int c = 0; c < kRow<W>; c += kLine) {
          __builtin_prefetch(w + kAhead<W> + c);
          if constexpr (kFar > 0) __builtin_prefetch(w + kFar * kAhead<W> + c, 0, 2);  // to L2
        }
      }
      vec wv[NV];
      load_row(w, wv);
      if constexpr (std::is_same_v<W, float>) {
        // Keep the row in registers: for 2-4 rows GCC otherwise folds the load into every row's
        // FMA, loading each weight vector TB times, and 4 rows were load-bound (127 against 200
        // GFLOP/s for a cached [576, 3072] matrix).
#pragma GCC unroll 16
        for (int v = 0; v < NV; ++v) asm("" : "+v"(wv[v]));
      }
#pragma GCC unroll 16
      for (int t = 0; t < TB; ++t) {
        const float xs = x[t * K + k];
#pragma GCC unroll 16
        for (int v = 0; v < NV; ++v) sum[t][v] += xs * wv[v];
      }
    }
    if constexpr (kAffine) {
      const uint16_t* s = scales + (k0 / kBlock) * 2 * kPanel;
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) {
        const vec dv = load_s(s + v * kVec), mv = load_s(s + kPanel + v * kVec);
#pragma GCC unroll 16
        for (int t = 0; t < TB; ++t) {
          acc[t][v] += dv * blk[t][v];
          acc[t][v] += mv * xsum[t * blocks + k0 / kBlock];
        }
      }
    }
  }
#pragma GCC unroll 16
  for (int t = 0; t < TB; ++t)
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) *reinterpret_cast<vec_u*>(y + t * N + v * kVec) = acc[t][v];
}

// n (< kTopOf<W>) rows against a whole panel, in one tile of n rows.
template <typename W, int TB = kTopOf<W> - 1>
inline void rest(int n, const float* x, int64_t K, const W* panel, const uint16_t* scales,
                 const float* xsum, float* y, int64_t N) {
  if constexpr (TB > 0) {
    if (n == TB) return tile<TB>(x, K, panel, scales, xsum, y, N);
    rest<W, TB - 1>(n, x, K, panel, scales, xsum, y, N);
  }
}

// Which rows of x [R, K] a call computes: all of them, or (`seg`, a prefill's prompt lengths)
// the first seg[s] of each of nseg equal segments (R = nseg * len), a padded prompt's real tokens.
struct Rows {
  const int32_t* seg = nullptr;
  int64_t nseg = 1, len = 0;
  int64_t begin(int64_t s) const { return s * len; }
  int64_t end(int64_t s) const {
    return s * len + (seg ? std::clamp<int64_t>(seg[s], 0, len) : len);
  }
};

// The rows `rows` selects against panels [p0, p1): in blocks of at most kRowBytes of x (one
// block for decoding and verification), so that a prefill's rows stay in cache while the chunk's
// panels stream past them.
constexpr int64_t kRowBytes = 256 << 10;
template <typename W>
void panels(const float* x, const Rows& rows, int64_t K, const W* w, const uint16_t* scales,
            const float* xsum, int64_t N, float* y, int64_t p0, int64_t p1) {
  const int64_t blocks = K / kBlock;
  constexpr int kT = kTopOf<W>;
  const int64_t block = std::max<int64_t>(kT, kRowBytes / (K * 4) / kT * kT);
  for (int64_t s = 0; s < rows.nseg; ++s) {
    for (int64_t r0 = rows.begin(s), R = rows.end(s); r0 < R; r0 += block) {
      const int64_t r1 = std::min(R, r0 + block);
      for (int64_t p = p0; p < p1; ++p) {
        const W* panel = w + p * K * kRow<W>;
        const uint16_t* ps = scales ? scales + p * (K / kBlock) * 2 * kPanel : nullptr;
        float* yp = y + p * kPanel;
        int64_t r = r0;
        const float* xs = xsum ? xsum + r * blocks : nullptr;
        for (; r + kT <= r1; r += kT, xs += xs ? kT * blocks : 0)
          tile<kT>(x + r * K, K, panel, ps, xs, yp + r * N, N);
        if (r < r1) rest(static_cast<int>(r1 - r), x + r * K, K, panel, ps, xs, yp + r * N, N);
      }
    }
  }
}

// xsum[r, b] = sum of x[r, k] over block b's kBlock rows of K, in a fixed order (halves, then
// halves of those): code panels add m * xsum once per block and column.
void block_sums(const float* x, int64_t R, int64_t K, std::vector<float>& xsum) {
  static_assert(kBlock == 32, "block_sums folds 32 values");
  xsum.resize(R * (K / kBlock));
  float* out = xsum.data();
  for (int64_t i = 0; i < R * (K / kBlock); ++i, x += kBlock) {
    float s[16];
    for (int j = 0; j < 16; ++j) s[j] = x[j] + x[j + 16];
    for (int h = 8; h > 0; h /= 2)
      for (int j = 0; j < h; ++j) s[j] += s[j + h];
    out[i] = s[0];
  }
}

// What a call applies to x before the product (its `prologue` attribute): nothing, Llama's
// RMSNorm (x * rsqrt(mean(x^2) + eps) * g), or SwiGLU (silu(a) * b for x = [a, b], [R, 2K]).
// Done here, the norm before each q/k/v and gate/up product and the SwiGLU before each down
// product are not XLA fusions of their own: at 8 rows those were 5 thunks and ~19 us a layer
// (XNNPACK's reduce alone 3.2 us a call). Each row is transformed alone, by the same operations
// in the same order whatever R is, so rows stay bit-identical across row counts.
enum : int32_t { kNoPrologue = 0, kRmsNorm = 1, kSwiGlu = 2 };

typedef int32_t ivec __attribute__((vector_size(kVec * sizeof(int32_t))));
inline vec splat(float f) { return vec{} + f; }
inline vec round_vec(vec x) {
#if defined(__AVX512F__)
  return (vec)_mm512_roundscale_ps((__m512)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  return (vec)_mm256_round_ps((__m256)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#endif
}

// e^x to a few float32 ulps (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r, 2^n from
// the exponent bits); x clamped to [-87, 88], where the result stays a normal float.
inline vec exp_vec(vec x) {
  x = x < 88.0f ? x : splat(88.0f);
  x = x > -87.0f ? x : splat(-87.0f);
  const vec n = round_vec(x * 1.44269504088896341f);
  const vec r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vec p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const vec y = p * r * r + r + 1.0f;
  return y * (vec)((__builtin_convertvector(n, ivec) + 127) << 23);
}

// Rows [r0, r1) of the transformed x: out [R, K] from x [R, K] (RMSNorm) or [R, 2K] (SwiGLU).
void prologue_rows(int32_t mode, const float* x, const float* g, float eps, int64_t K,
                   int64_t r0, int64_t r1, float* out) {
  const int64_t kv = K / kVec * kVec;
  for (int64_t r = r0; r < r1; ++r) {
    float* o = out + r * K;
    if (mode == kRmsNorm) {
      const float* xr = x + r * K;
      vec acc = vec{};
      for (int64_t k = 0; k < kv; k += kVec) {
        const vec v = *reinterpret_cast<const vec_u*>(xr + k);
        acc += v * v;
      }
      float lanes[kVec];
      std::memcpy(lanes, &acc, sizeof(lanes));
      for (int h = kVec / 2; h > 0; h /= 2)
        for (int j = 0; j < h; ++j) lanes[j] += lanes[j + h];
      float ss = lanes[0];
      for (int64_t k = kv; k < K; ++k) ss += xr[k] * xr[k];
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(K) + eps);
      for (int64_t k = 0; k < kv; k += kVec) {
        const vec v = *reinterpret_cast<const vec_u*>(xr + k);
        *reinterpret_cast<vec_u*>(o + k) = (v * inv) * *reinterpret_cast<const vec_u*>(g + k);
      }
      for (int64_t k = kv; k < K; ++k) o[k] = (xr[k] * inv) * g[k];
    } else {
      const float* a = x + r * 2 * K;
      const float* b = a + K;
      for (int64_t k = 0; k < kv; k += kVec) {
        const vec av = *reinterpret_cast<const vec_u*>(a + k);
        const vec bv = *reinterpret_cast<const vec_u*>(b + k);
        *reinterpret_cast<vec_u*>(o + k) = av / (exp_vec(-av) + 1.0f) * bv;
      }
      for (int64_t k = kv; k < K; ++k) o[k] = a[k] / (std::exp(-a[k]) + 1.0f) * b[k];
    }
  }
}

// fn(r0, r1) over rows [0, R): inline for a few rows, in chunks over the pool for a prefill's.
struct RowsJob {
  std::function<void(int64_t, int64_t)> fn;
  int64_t R = 0, chunk = 16;
  spec_jax::Claims claims;  // one item per chunk of rows

  void drain() {
    claims.drain([this](int64_t c) { fn(c * chunk, std::min(R, (c + 1) * chunk)); });
  }
};

void over_rows(ffi::ThreadPool& pool, int64_t R, std::function<void(int64_t, int64_t)> fn) {
  if (R <= 64) return fn(0, R);
  auto job = std::make_shared<RowsJob>();
  job->fn = std::move(fn);
  job->R = R;
  job->claims.total = (R + job->chunk - 1) / job->chunk;
  spec_jax::run_shared(pool, job);
}

// The transformed x [R, K] into `out`.
void prologue(ffi::ThreadPool& pool, int32_t mode, const float* x, const float* g, float eps,
              int64_t R, int64_t K, std::vector<float>& out) {
  out.resize(R * K);
  over_rows(pool, R, [&](int64_t r0, int64_t r1) {
    prologue_rows(mode, x, g, eps, K, r0, r1, out.data());
  });
}

// The prologue a call asks for: `mode`, the norm's weights g [K] (a placeholder otherwise), eps.
struct Pro {
  int32_t mode = kNoPrologue;
  const float* g = nullptr;
  int64_t g_size = 0;
  float eps = 0.0f;
};

// What a call applies to y after the product (its `epilogue` attribute): nothing, RoPE on the
// first `rotate` columns in heads of D (Hugging Face's rotate-half layout; aux [R, D] holds each
// row's cos, then sin, of D/2 frequencies), or y += aux (aux [R, N]: the residual stream). They
// replace the rotations of q and k (XLA computed k's twice: for attention and for the cache) and
// the residual adds, ~12 us a layer at 8 rows. Rows are transformed alone, as in the prologue.
enum : int32_t { kNoEpilogue = 0, kRope = 1, kResidual = 2 };

struct Epi {
  int32_t mode = kNoEpilogue;
  const float* aux = nullptr;
  int64_t aux_rows = 0, aux_cols = 0, rotate = 0;
};

void epilogue_rows(const Epi& e, float* y, int64_t N, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    float* yr = y + r * N;
    const float* a = e.aux + r * e.aux_cols;
    if (e.mode == kResidual) {
      for (int64_t n = 0; n < N; ++n) yr[n] = a[n] + yr[n];
      continue;
    }
    const int64_t half = e.aux_cols / 2;
    for (int64_t h = 0; h < e.rotate; h += e.aux_cols) {
      float* x1 = yr + h;
      float* x2 = x1 + half;
      for (int64_t j = 0; j < half; ++j) {
        const float c = a[j], s = a[half + j], u = x1[j], v = x2[j];
        x1[j] = u * c - v * s;
        x2[j] = v * c + u * s;
      }
    }
  }
}

template <typename W>
struct Job {
  const float* x;
  const W* w;
  const uint16_t* scales;  // code panels only
  std::vector<float> xsum;  // code panels only: [R, K / kBlock] (`block_sums`)
  std::vector<float> xp;  // x after the call's prologue, where it has one
  float* y;
  Rows rows;
  int64_t R, K, N, num_panels, chunk;
  spec_jax::Claims claims;  // one item per chunk of panels

  void drain() {
    claims.drain([this](int64_t c) {
      const int64_t p0 = c * chunk, p1 = std::min(num_panels, p0 + chunk);
      panels(x, rows, K, w, scales, xsum.empty() ? nullptr : xsum.data(), N, y, p0, p1);
    });
  }
};

// y = x @ w for the rows `seg` selects (all where it is null); the other rows of y are zeros.
template <typename W>
ffi::Error Run(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, ffi::Span<const int64_t> wd,
               const W* w, const uint16_t* scales, ffi::ResultBuffer<ffi::F32>& y, const Pro& pro,
               const Epi& epi, const int32_t* seg = nullptr, int64_t nseg = 1) {
  auto xd = x.dimensions(), yd = y->dimensions();
  const int64_t width = pro.mode == kSwiGlu ? 2 : 1;  // x's columns per row of K
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || wd[2] != kRow<W> ||
      xd[1] != width * wd[1] || yd[0] != xd[0] || yd[1] != wd[0] * kPanel ||
      nseg < 1 || xd[0] % nseg != 0 || pro.mode < kNoPrologue || pro.mode > kSwiGlu ||
      (pro.mode == kRmsNorm && pro.g_size != wd[1]) || epi.mode < kNoEpilogue ||
      epi.mode > kResidual || (epi.mode != kNoEpilogue && epi.aux_rows != xd[0]) ||
      (epi.mode == kResidual && epi.aux_cols != yd[1]) ||
      (epi.mode == kRope && (epi.aux_cols < 2 || epi.aux_cols % 2 || epi.rotate < 0 ||
                             epi.rotate % epi.aux_cols || epi.rotate > yd[1]))) {
    return ffi::Error::InvalidArgument(
        "spec_jax packed gemm: expected x [R, K] ([R, 2K] with a SwiGLU prologue), w [N/P, K, P], "
        "y [R, N] with P = spec_jax_gemm_panel(), norm weights [K] with an RMSNorm prologue, "
        "cos/sin [R, D] with a RoPE epilogue of whole heads, a residual [R, N], and row counts "
        "[S] with S dividing R");
  }
  auto job = std::make_shared<Job<W>>();
  job->x = x.typed_data();
  if (pro.mode != kNoPrologue) {
    prologue(pool, pro.mode, job->x, pro.g, pro.eps, xd[0], wd[1], job->xp);
    job->x = job->xp.data();
  }
  job->w = w;
  job->scales = scales;
  job->y = y->typed_data();
  job->R = xd[0];
  job->K = wd[1];
  job->N = yd[1];
  job->num_panels = wd[0];
  job->rows = Rows{seg, nseg, xd[0] / nseg};
  for (int64_t s = 0; s < nseg; ++s) {  // rows not computed: zeros, not stale memory
    const int64_t e = job->rows.end(s), n = job->rows.begin(s) + job->rows.len - e;
    if (n > 0) std::memset(job->y + e * job->N, 0, n * job->N * sizeof(float));
  }
  if (scales) block_sums(job->x, job->R, job->K, job->xsum);
  // About four chunks per thread: small enough to balance, large enough to stream.
  job->chunk = std::max<int64_t>(1, job->num_panels / (4 * spec_jax::pool_threads(pool)));
  job->claims.total = (job->num_panels + job->chunk - 1) / job->chunk;
  spec_jax::run_shared(pool, job);
  if (epi.mode != kNoEpilogue) {
    float* yp = job->y;
    const int64_t N = job->N;
    const Rows rows = job->rows;
    over_rows(pool, job->R, [&](int64_t r0, int64_t r1) {
      for (int64_t s = 0; s < rows.nseg; ++s) {  // the rows computed; the others stay zeros
        const int64_t a = std::max(r0, rows.begin(s)), b = std::min(r1, rows.end(s));
        if (a < b) epilogue_rows(epi, yp, N, a, b);
      }
    });
  }
  return ffi::Error::Success();
}

Pro MakePro(ffi::Buffer<ffi::F32>& g, int32_t mode, float eps) {
  return Pro{mode, g.typed_data(), static_cast<int64_t>(g.element_count()), eps};
}

Epi MakeEpi(ffi::Buffer<ffi::F32>& aux, int32_t mode, int32_t rotate) {
  auto d = aux.dimensions();
  return Epi{mode, aux.typed_data(), d.size() == 2 ? d[0] : 0, d.size() == 2 ? d[1] : 0, rotate};
}

template <ffi::DataType WT>
ffi::Error PackedGemm(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> g,
                      ffi::Buffer<ffi::F32> aux, ffi::Buffer<WT> w, ffi::ResultBuffer<ffi::F32> y,
                      int32_t prologue, float eps, int32_t epilogue, int32_t rotate) {
  return Run(pool, x, w.dimensions(), w.typed_data(), nullptr, y, MakePro(g, prologue, eps),
             MakeEpi(aux, epilogue, rotate));
}

// The same for the first rows[s] rows of each of the S segments of x (a padded prefill).
template <ffi::DataType WT>
ffi::Error PackedGemmRows(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> g,
                          ffi::Buffer<ffi::F32> aux, ffi::Buffer<WT> w, ffi::Buffer<ffi::S32> rows,
                          ffi::ResultBuffer<ffi::F32> y, int32_t prologue, float eps,
                          int32_t epilogue, int32_t rotate) {
  return Run(pool, x, w.dimensions(), w.typed_data(), nullptr, y, MakePro(g, prologue, eps),
             MakeEpi(aux, epilogue, rotate), rows.typed_data(),
             static_cast<int64_t>(rows.element_count()));
}

// uint8 code panels [N/P, K, P], or [N/P, K, P/2] of 4-bit pairs, with float16 scales
// [N/P, K/kBlock, 2, P] (d, then m); `seg`/`nseg` as in `Run`.
ffi::Error Affine(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, ffi::Buffer<ffi::U8>& w,
                  ffi::Buffer<ffi::F16>& s, ffi::ResultBuffer<ffi::F32>& y, const Pro& pro,
                  const Epi& epi, const int32_t* seg = nullptr, int64_t nseg = 1) {
  auto wd = w.dimensions(), sd = s.dimensions();
  if (wd.size() != 3 || wd[1] % kBlock != 0 || sd.size() != 4 || sd[0] != wd[0] ||
      sd[1] != wd[1] / kBlock || sd[2] != 2 || sd[3] != kPanel ||
      (wd[2] != kPanel && wd[2] != kPanel / 2)) {
    return ffi::Error::InvalidArgument(
        "spec_jax affine packed gemm: expected w [N/P, K, P] or [N/P, K, P/2] uint8 and "
        "float16 scales [N/P, K/32, 2, P]");
  }
  auto scales = reinterpret_cast<const uint16_t*>(s.typed_data());
  if (wd[2] == kPanel / 2) {
    return Run(pool, x, wd, reinterpret_cast<const Nib*>(w.typed_data()), scales, y, pro, epi,
               seg, nseg);
  }
  return Run(pool, x, wd, w.typed_data(), scales, y, pro, epi, seg, nseg);
}

ffi::Error PackedGemmAffine(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                            ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> aux,
                            ffi::Buffer<ffi::U8> w, ffi::Buffer<ffi::F16> s,
                            ffi::ResultBuffer<ffi::F32> y, int32_t prologue, float eps,
                            int32_t epilogue, int32_t rotate) {
  return Affine(pool, x, w, s, y, MakePro(g, prologue, eps), MakeEpi(aux, epilogue, rotate));
}

ffi::Error PackedGemmAffineRows(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                                ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> aux,
                                ffi::Buffer<ffi::U8> w, ffi::Buffer<ffi::F16> s,
                                ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> y,
                                int32_t prologue, float eps, int32_t epilogue, int32_t rotate) {
  return Affine(pool, x, w, s, y, MakePro(g, prologue, eps), MakeEpi(aux, epilogue, rotate),
                rows.typed_data(), static_cast<int64_t>(rows.element_count()));
}

}  // namespace

// The panel width P that `PackedGemm` expects (weights packed as [N / P, K, P]).
extern "C" int spec_jax_gemm_panel() { return kPanel; }

// One handler symbol per weight storage, plain and with per-row counts. Every one takes x, g
// (the norm's weights) and aux (cos/sin or the residual), all float32, then `operands` (the
// weight panels, a uint8 storage's float16 scales, a `Rows` variant's int32 counts), returns y
// and reads the prologue / epilogue attributes.
#define SPEC_JAX_ARG(type) .Arg<ffi::Buffer<ffi::type>>()
#define SPEC_JAX_GEMM_HANDLER(symbol, impl, operands)                    \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(symbol, impl,                            \
                                ffi::Ffi::Bind()                         \
                                    .Ctx<ffi::ThreadPool>()              \
                                    SPEC_JAX_ARG(F32)                    \
                                    SPEC_JAX_ARG(F32)                    \
                                    SPEC_JAX_ARG(F32)                    \
                                    operands                             \
                                    .Ret<ffi::Buffer<ffi::F32>>()        \
                                    .Attr<int32_t>("prologue")           \
                                    .Attr<float>("eps")                  \
                                    .Attr<int32_t>("epilogue")           \
                                    .Attr<int32_t>("rotate"))

SPEC_JAX_GEMM_HANDLER(SpecJaxPackedGemm, PackedGemm<ffi::F32>, SPEC_JAX_ARG(F32));
SPEC_JAX_GEMM_HANDLER(SpecJaxPackedGemmBf16, PackedGemm<ffi::BF16>, SPEC_JAX_ARG(BF16));
SPEC_JAX_GEMM_HANDLER(SpecJaxPackedGemmAffine, PackedGemmAffine,
                      SPEC_JAX_ARG(U8) SPEC_JAX_ARG(F16));
SPEC_JAX_GEMM_HANDLER(SpecJaxPackedGemmRows, PackedGemmRows<ffi::F32>,
                      SPEC_JAX_ARG(F32) SPEC_JAX_ARG(S32));
SPEC_JAX_GEMM_HANDLER(SpecJaxPackedGemmBf16Rows, PackedGemmRows<ffi::BF16>,
                      SPEC_JAX_ARG(BF16) SPEC_JAX_ARG(S32));
SPEC_JAX_GEMM_HANDLER(SpecJaxPackedGemmAffineRows, PackedGemmAffineRows,
                      SPEC_JAX_ARG(U8) SPEC_JAX_ARG(F16) SPEC_JAX_ARG(S32));

#undef SPEC_JAX_GEMM_HANDLER
#undef SPEC_JAX_ARG
