// Tree attention for decoding and verification on CPU (an XLA FFI handler).
//
// T block queries per row attend to the committed cache (slots s < length[b] with valid[b, s])
// and to the N block keys their tree mask allows; one exact softmax over both. Shapes as in
// pallas_kernels/reference.py: q [B, T, H, D]; k_cache, v_cache [B, KVH, S, D]; valid [B, S];
// length [B]; k_new, v_new [B, N, KVH, D]; mask [B, T, N]; out [B, T, H, D].
//
// Why: XLA:CPU runs this as ~10 small ops per layer and reads every cache slot, written or not.
// Here one call per layer reads only slots below each row's length, and each key row is scored
// against up to 16 queries of its KV head at once (four vector lanes each, `score_rows`); their
// softmaxes run lane-parallel (one lane each), and with AVX-512 several of them share each value
// row they sum (verifying 8 tokens: 1.5x the speed of one query at a time, run 38 in docs/results.md).
// A prefill's long causal block is scored only up to each item's last visible key, and the block
// keys all of an item's queries see go with the cache keys (vector-wide, not lane by lane). Past
// 256 keys a query's keys are split by rank into windows, each a partial softmax, merged in order
// (`kChunk`): decoding one row gets more work items than KV heads.
//
// A query's result depends only on the keys it sees, in order (valid cache slots, then visible
// block keys): each score is four FMA chains over D in a fixed order, each key's weight lands in
// sum lane rank % 16, values are added in rank order. So a token seen from the cache (plain
// decoding) and from the block (verification) gives bit-identical outputs, whatever T is.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kL = 16;  // lanes per vector; keys per tile
typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t vi16 __attribute__((vector_size(64)));

inline v16 load(const float* p) {
  v16 v;
  std::memcpy(&v, p, 64);
  return v;
}
inline void store(float* p, v16 v) { std::memcpy(p, &v, 64); }

// a * b + c rounded once, lane by lane. Explicit because -ffp-contract does not fuse every
// instantiation alike, and a score must not depend on which one computed it.
template <typename V>
inline V fma(V a, V b, V c) {
#if defined(__AVX512F__)
  if constexpr (sizeof(V) == 64) return (V)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#endif
#if defined(__FMA__)
  if constexpr (sizeof(V) == 32) return (V)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#endif
  V r;
  for (unsigned i = 0; i < sizeof(V) / sizeof(float); ++i) r[i] = __builtin_fmaf(a[i], b[i], c[i]);
  return r;
}

// exp(x) for x <= 0 (Cephes' single-precision polynomial, ~1 ulp); exactly 0 below -87.
inline v16 vexp(v16 x) {
  const v16 lo = v16{} - 87.0f;
  const v16 xc = x < lo ? lo : x;
  const v16 magic = v16{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const v16 n = (xc * 1.44269504088896341f + magic) - magic;
  const v16 r = (xc - n * 0.693359375f) + n * 2.12194440e-4f;
  v16 p = v16{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const vi16 e = (__builtin_convertvector(n, vi16) + 127) << 23;
  v16 scale;
  std::memcpy(&scale, &e, 64);
  const v16 y = p * scale;
  return x < lo ? v16{} : y;
}

// Scores: out[s][r] = scale * (k_s . q_r) for key rows s and queries r < R (lanes r of a 16-lane
// row; the others 0). Each dot product is four FMA chains, chain c over d = c, c + 4, c + 8, ...,
// added as (c0 + c1) + (c2 + c3): a vector lane per (query, chain), so 4 queries fill 16 lanes and
// one load broadcasts k_s[4i:4i+4] to all of them. The operations per (query, key) are the same
// whichever queries share the pass and whatever the vector width, so a score's bits do not depend
// on R; decoding (R = 3 for SmolLM2) runs a quarter of the FMAs a lane per query needed.
// qt4 [D / 4][64]: qt4[i][4r + c] = q_r[4i + c].
#if defined(__AVX512F__)
typedef v16 SV;  // 4 queries a vector
inline SV bcast4(const float* p) { return (SV)_mm512_broadcast_f32x4(_mm_loadu_ps(p)); }
inline SV pair_sums(SV x) {  // every lane of query r: (c0 + c1) + (c2 + c3), commuted alike
  x = x + (SV)_mm512_permute_ps((__m512)x, 0xB1);
  return x + (SV)_mm512_permute_ps((__m512)x, 0x4E);
}
#else
typedef v8 SV;  // 2 queries a vector
inline SV bcast4(const float* p) { return (SV)_mm256_broadcast_ps((const __m128*)p); }
inline SV pair_sums(SV x) {
  x = x + (SV)_mm256_permute_ps((__m256)x, 0xB1);
  return x + (SV)_mm256_permute_ps((__m256)x, 0x4E);
}
#endif
constexpr int kQV = sizeof(SV) / sizeof(float) / 4;  // queries per vector

template <int SB, int NQ>  // SB key rows, NQ vectors of queries
inline void score_rows(const float* const* k, int64_t D, const float* qt4, float scale,
                       float* out) {
  SV acc[SB][NQ];
  for (int s = 0; s < SB; ++s)
    for (int u = 0; u < NQ; ++u) acc[s][u] = SV{};
  for (int64_t i = 0; i < D / 4; ++i) {
    SV qv[NQ];
    for (int u = 0; u < NQ; ++u) std::memcpy(&qv[u], qt4 + i * 4 * kL + u * 4 * kQV, sizeof(SV));
    for (int s = 0; s < SB; ++s) {
      const SV kb = bcast4(k[s] + 4 * i);
      for (int u = 0; u < NQ; ++u) acc[s][u] = fma(kb, qv[u], acc[s][u]);
    }
  }
  for (int s = 0; s < SB; ++s) {
#if defined(__AVX512F__)
    const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12);
    __m512 o = _mm512_setzero_ps();
    for (int u = 0; u < NQ; ++u)  // query 4u + j from lane 4j to lane 4u + j
      o = _mm512_mask_permutexvar_ps(o, static_cast<__mmask16>(0xF << (4 * u)), idx,
                                     (__m512)(pair_sums(acc[s][u]) * scale));
    store(out + s * kL, (v16)o);
#else
    float* o = out + s * kL;
    std::fill(o, o + kL, 0.f);
    for (int u = 0; u < NQ; ++u) {
      const SV x = pair_sums(acc[s][u]) * scale;
      o[2 * u] = x[0];
      o[2 * u + 1] = x[4];
    }
#endif
  }
}

template <int NQ>
void score_tiles(const float* const* k, int64_t n, int64_t D, const float* qt4, float scale,
                 float* out) {
  constexpr int SB = NQ == 1 ? 8 : NQ == 2 ? 4 : NQ <= 4 ? 2 : 1;  // SB * NQ accumulators
  int64_t s = 0;
  for (; s + SB <= n; s += SB) score_rows<SB, NQ>(k + s, D, qt4, scale, out + s * kL);
  for (; s < n; ++s) score_rows<1, NQ>(k + s, D, qt4, scale, out + s * kL);
}

void score_all(const float* const* k, int64_t n, int64_t D, int64_t R, const float* qt4,
               float scale, float* out) {
  switch ((R + kQV - 1) / kQV) {
    case 1: return score_tiles<1>(k, n, D, qt4, scale, out);
    case 2: return score_tiles<2>(k, n, D, qt4, scale, out);
    case 3: return score_tiles<3>(k, n, D, qt4, scale, out);
    case 4: return score_tiles<4>(k, n, D, qt4, scale, out);
#if !defined(__AVX512F__)
    case 5: return score_tiles<5>(k, n, D, qt4, scale, out);
    case 6: return score_tiles<6>(k, n, D, qt4, scale, out);
    case 7: return score_tiles<7>(k, n, D, qt4, scale, out);
    case 8: return score_tiles<8>(k, n, D, qt4, scale, out);
#endif
  }
}

// out[0:D] = sum_j p[j] * v[j][0:D], j in order, accumulated in registers (DV = D / lanes of V).
// Each element is one FMA chain over j whatever the vector width.
template <typename V, int DV>
void weighted_rows(const float* p, const float* const* v, int64_t cnt, float* out) {
  constexpr int kW = sizeof(V) / sizeof(float);
  V acc[DV];
  for (int c = 0; c < DV; ++c) acc[c] = V{};
  for (int64_t j = 0; j < cnt; ++j) {
    const V pj = V{} + p[j];
    for (int c = 0; c < DV; ++c) {
      V x;
      std::memcpy(&x, v[j] + c * kW, sizeof(V));
      acc[c] = fma(pj, x, acc[c]);
    }
  }
  for (int c = 0; c < DV; ++c) std::memcpy(out + c * kW, &acc[c], sizeof(V));
}

void weighted_sum(const float* p, const float* const* v, int64_t cnt, int64_t D, float* out) {
#if defined(__AVX512F__)
  switch (D / kL) {
    case 1: return weighted_rows<v16, 1>(p, v, cnt, out);
    case 2: return weighted_rows<v16, 2>(p, v, cnt, out);
    case 4: return weighted_rows<v16, 4>(p, v, cnt, out);
    case 6: return weighted_rows<v16, 6>(p, v, cnt, out);
    case 8: return weighted_rows<v16, 8>(p, v, cnt, out);
    case 16: return weighted_rows<v16, 16>(p, v, cnt, out);
  }
#else  // 16 registers of 8 lanes (a 16-lane type would fall back to scalar FMAs)
  switch (D / 8) {
    case 2: return weighted_rows<v8, 2>(p, v, cnt, out);
    case 4: return weighted_rows<v8, 4>(p, v, cnt, out);
    case 8: return weighted_rows<v8, 8>(p, v, cnt, out);
    case 12: return weighted_rows<v8, 12>(p, v, cnt, out);
    case 16: return weighted_rows<v8, 16>(p, v, cnt, out);
  }
#endif
  std::fill(out, out + D, 0.f);  // other head sizes: same order, accumulated in memory
  for (int64_t j = 0; j < cnt; ++j)
    for (int64_t d = 0; d < D; d += kL) store(out + d, fma(v16{} + p[j], load(v[j] + d), load(out + d)));
}

// acc[r][0:D] = sum over lane r's keys j (cache keys, then its visible block keys in order) of
// e[j][r] * v_j, for lanes r < R. QB lanes share each loaded value row; each element stays one
// FMA chain over j, so a lane's result does not depend on which lanes share its pass. The shared
// pass covers the first nv keys of v (the cache keys, and on a long block its keys too, with e = 0
// where a lane may not see one: an exact no-op in an FMA chain); block keys in `blk` follow lane
// by lane.
template <int DV, int QB, typename BlkRow>
void weighted_group(const float* e, const float* const* v, int64_t nv, const std::vector<int64_t>& blk,
                    BlkRow blk_row, int64_t nc, int64_t r0, float* acc) {
  v16 a[QB][DV];
  for (int q = 0; q < QB; ++q)
    for (int c = 0; c < DV; ++c) a[q][c] = v16{};
  for (int64_t j = 0; j < nv; ++j) {
    v16 x[DV];
    for (int c = 0; c < DV; ++c) x[c] = load(v[j] + c * kL);
    for (int q = 0; q < QB; ++q) {
      const v16 p = v16{} + e[j * kL + r0 + q];
      for (int c = 0; c < DV; ++c) a[q][c] = fma(p, x[c], a[q][c]);
    }
  }
  for (int q = 0; q < QB; ++q) {
    for (int c = 0; c < DV; ++c) store(acc + (r0 + q) * DV * kL + c * kL, a[q][c]);
  }
  // block keys (few): lane by lane, each chain continued from where the cache keys left it.
  // Stored first on purpose: continuing a[][] in registers through this data-dependent loop
  // measured 1.3-1.5x slower for the whole call at 4-8 block tokens (run 38).
  for (int q = 0; q < QB; ++q) {
    v16 b[DV];
    bool any = false;
    for (int64_t i : blk) {
      if (i % kL != r0 + q) continue;
      if (!any) {
        for (int c = 0; c < DV; ++c) b[c] = load(acc + (r0 + q) * DV * kL + c * kL);
        any = true;
      }
      const int64_t n = i / kL;
      const float* row = blk_row(n);
      const v16 p = v16{} + e[(nc + n) * kL + r0 + q];
      for (int c = 0; c < DV; ++c) b[c] = fma(p, load(row + c * kL), b[c]);
    }
    if (any)
      for (int c = 0; c < DV; ++c) store(acc + (r0 + q) * DV * kL + c * kL, b[c]);
  }
}

// weighted_group for the n (<= QB) lanes from r0.
template <int DV, int QB, typename BlkRow>
void weighted_upto(int n, const float* e, const float* const* v, int64_t nv,
                   const std::vector<int64_t>& blk, BlkRow blk_row, int64_t nc, int64_t r0,
                   float* acc) {
  if constexpr (QB > 1) {
    if (n < QB) return weighted_upto<DV, QB - 1>(n, e, v, nv, blk, blk_row, nc, r0, acc);
  }
  weighted_group<DV, QB>(e, v, nv, blk, blk_row, nc, r0, acc);
}

// `shared` (a long block, see AttnJob::item): v holds the nb block value rows after the cache's,
// and e is zero where a lane may not see a block key.
template <typename BlkRow>
void weighted_lanes(const float* e, const float* const* v, int64_t nc, int64_t nb, bool shared,
                    const std::vector<int64_t>& blk, BlkRow blk_row, int64_t R, int64_t D, float* acc) {
#if defined(__AVX512F__)
  // 16 accumulators of 16 lanes: saturates both FMA ports, fits the 32 registers. The last group
  // takes only the lanes left (decoding SmolLM2: 3 queries, not a group of 4 with one idle).
  static const std::vector<int64_t> none;
  const int64_t nv = shared ? nc + nb : nc;
  const auto& rest = shared ? none : blk;
  auto groups = [&](auto dv) {
    constexpr int DV = decltype(dv)::value, QB = 16 / DV;
    for (int64_t r0 = 0; r0 < R; r0 += QB)
      weighted_upto<DV, QB>(static_cast<int>(std::min<int64_t>(QB, R - r0)), e, v, nv, rest,
                            blk_row, nc, r0, acc);
  };
  switch (D / kL) {
    case 1: return groups(std::integral_constant<int, 1>{});
    case 2: return groups(std::integral_constant<int, 2>{});
    case 4: return groups(std::integral_constant<int, 4>{});
    case 8: return groups(std::integral_constant<int, 8>{});
  }
#endif
  // one lane at a time (its weights gathered in rank order), as `weighted_sum` lays them out
  std::vector<float> p(nc + blk.size());
  std::vector<const float*> rows(v, v + nc);
  for (int64_t r = 0; r < R; ++r) {
    rows.resize(nc);
    for (int64_t j = 0; j < nc; ++j) p[j] = e[j * kL + r];
    int64_t k = nc;
    for (int64_t i : blk)
      if (i % kL == r) {
        p[k++] = e[(nc + i / kL) * kL + r];
        rows.push_back(blk_row(i / kL));
      }
    weighted_sum(p.data(), rows.data(), k, D, acc + r * D);
  }
}

// A query's keys are split by rank (its n-th visible key, cache slots first) into windows of
// kChunk: each window is its own work item (a partial softmax: max, sum, weighted values), and
// windows are merged in order afterwards. The windows depend only on ranks, so a query's bits
// still do not depend on T or on the other queries; a query with at most kChunk keys gets the
// unsplit result. Why: decoding has one item per (row, KV head), 3 for SmolLM2, which leave a
// thread of two idle half the time (3 heads cost what 4 did) and a many-core host mostly idle.
constexpr int64_t kChunk = 256;  // a multiple of kL: a key's sum lane (rank % 16) stays its own

struct AttnJob {
  const float *q, *kc, *vc, *kn, *vn;
  const bool *valid, *mask;
  const int32_t* length;
  float* out;
  int64_t B, T, H, KVH, S, N, D, G, TC, TCH;
  float scale;
  std::vector<int64_t> first;   // [B + 1]: the first item of row b
  std::vector<int64_t> chunks;  // [B]: key windows of row b (those past its keys stay empty)
  std::vector<char> dense;      // [B]: every slot below the row's length is valid
  std::vector<std::vector<int32_t>> visible;  // [B]: else its valid slots below length, in order
  bool split = false;           // an item per window (else per row, KV head and block chunk)
  mutable std::vector<float> part;  // split: [items][kL][D + 3], each window's partials
  spec_jax::Claims claims;

  struct Scratch {
    std::vector<float> qt, sc, p, acc, vis, part;
    std::vector<const float*> rows, vrows;
    std::vector<int64_t> blk;
    bool resume = false;  // an item's windows in turn: its queries (qt) and scan position carry over
    int64_t cur_n[kL], cur_k[kL];
  };

  // Query r (lane r) of KV head kvh at block positions from t0 of row b: its row in q and out.
  int64_t qrow(int64_t b, int64_t t0, int64_t kvh, int64_t r) const {
    return ((b * T + t0 + r / G) * H + kvh * G + r % G) * D;
  }

  // The item's R queries into w.qt as score_rows takes them: [D / 4][query][4].
  void load_queries(int64_t b, int64_t kvh, int64_t t0, int64_t R, Scratch& w) const {
    std::fill(w.qt.begin(), w.qt.end(), 0.f);
    for (int64_t r = 0; r < R; ++r) {
      const float* qr = q + qrow(b, t0, kvh, r);
      for (int64_t d = 0; d < D; ++d) w.qt[(d / 4) * 4 * kL + 4 * r + d % 4] = qr[d];
    }
  }

  // Keys of ranks [lo, hi) (window c) of the queries of KV head `kvh` at block positions
  // [t0, t0 + TC) of row b (R <= 16 queries, one per lane): the result into `out` where the row
  // has one window, else the window's partials into `part` ([kL][D + 3]: acc, max, sum, and 1
  // where the lane has keys in the window, else 0).
  void window(int64_t b, int64_t kvh, int64_t tc, int64_t c, Scratch& w, float* part) const {
    const int64_t nch = chunks[b], t0 = tc * TC;
    const int64_t lo = c * kChunk, hi = nch == 1 ? INT64_MAX : lo + kChunk;
    const int64_t nt = std::min(TC, T - t0), R = nt * G;
    const int64_t len = std::clamp<int64_t>(length[b], 0, S);
    const float* kcb = kc + (b * KVH + kvh) * S * D;
    const float* vcb = vc + (b * KVH + kvh) * S * D;
    const bool* mrow = mask + (b * T + t0) * N;  // [nt][N]
    auto blk_row = [&](const float* base, int64_t n) { return base + ((b * N + n) * KVH + kvh) * D; };

    // the window's cache keys (visible slots of rank lo..hi-1) and the rank of the first block key
    w.rows.clear();
    w.vrows.clear();
    const std::vector<int32_t>& slots = visible[b];  // empty: every slot below len is valid
    const int64_t rank0 = dense[b] ? len : static_cast<int64_t>(slots.size());  // cache keys
    for (int64_t j = lo, e = std::min(rank0, hi); j < e; ++j) {
      const int64_t s = dense[b] ? j : slots[j];
      w.rows.push_back(kcb + s * D);
      w.vrows.push_back(vcb + s * D);
    }
    int64_t nc = w.rows.size();  // grows by the block keys every query sees first (below)
    // block keys in the window: query t's k-th visible one has rank rank0 + k, so those of
    // ranks [lo, hi) are its visible keys in [kfirst[t], klast[t]); n0 .. nb-1 spans them all
    int64_t n0 = N, nb = 0;
    int64_t kfirst[kL], klast[kL];  // per query: its keys in the window, [kfirst, klast)
    for (int64_t t = 0; t < nt; ++t) {
      kfirst[t] = klast[t] = 0;
      // where the scan starts: block key 0 at rank rank0, or where the previous window of
      // this query stopped (windows in turn: a long block is scanned once, not once a window)
      int64_t n = 0, k = rank0;
      if (c > 0 && w.resume) {
        n = w.cur_n[t];
        k = w.cur_k[t];
      }
      if (rank0 < hi) {
        const bool* mt = mrow + t * N;
        for (; n < N && k < lo; ++n) k += mt[n];
        int64_t f = -1, l = -1;
        for (; n < N && k < hi; ++n)
          if (mt[n]) {
            if (f < 0) f = n;
            l = n + 1;
            ++k;
          }
        if (f >= 0) {
          kfirst[t] = f;
          klast[t] = l;
          n0 = std::min(n0, f);
          nb = std::max(nb, l);
        }
      }
      w.cur_n[t] = n;
      w.cur_k[t] = k;
    }
    if (nb <= n0) n0 = nb = 0;
    // Block keys every query sees, from the first any sees (a causal prefill's keys before its
    // queries, a tree's root, the key a decoding step adds): each query's next keys in rank
    // order alike, so they go with the cache keys, summed and weighed vector-wide rather than
    // lane by lane (the same operations per lane, so the same bits).
    for (; n0 < nb; ++n0, ++nc) {
      bool all = true;
      for (int64_t t = 0; t < nt && all; ++t)
        all = mrow[t * N + n0] && n0 >= kfirst[t] && n0 < klast[t];
      if (!all) break;
      w.rows.push_back(blk_row(kn, n0));
      w.vrows.push_back(blk_row(vn, n0));
    }
    const int64_t nbw = nb - n0;  // block keys scored lane by lane: n0 .. nb-1
    if (nch > 1 && nc == 0 && nbw == 0) {  // nothing of this window: an empty partial
      for (int64_t r = 0; r < kL; ++r) part[r * (D + 3) + D + 2] = 0.f;
      return;
    }
    if (!w.resume) load_queries(b, kvh, t0, R, w);

    // Scores of the window's cache keys (shared by the item's queries) in order, then of the
    // other block keys n0 .. nb-1 (for a causal prefill's items, the diagonal): sc[j][lane].
    for (int64_t n = n0; n < nb; ++n) w.rows.push_back(blk_row(kn, n));
    score_all(w.rows.data(), nc + nbw, D, R, w.qt.data(), scale, w.sc.data());

    // Softmax of all R queries at once, one per lane (sc holds [key][lane]): per lane the
    // same operations in the same order as one query alone, so bits do not depend on R.
    const float* sc = w.sc.data();
    int64_t cnt[kL];
    w.blk.clear();  // visible (block key - n0, lane) pairs of the window, by key
    v16 m = v16{} - INFINITY;
    for (int64_t j = 0; j < nc; ++j) {
      const v16 x = load(sc + j * kL);
      m = m < x ? x : m;
    }
    float mm[kL];
    store(mm, m);
    for (int64_t r = 0; r < kL; ++r) cnt[r] = r < R ? nc : 0;
    float* vis = w.vis.data();  // [nbw][16]: 1 where the lane sees the block key in this window
    for (int64_t n = 0; n < nbw; ++n)
      for (int64_t r = 0; r < kL; ++r) {
        const int64_t t = r / G, nn = n0 + n;
        const bool seen = r < R && mrow[t * N + nn] && nn >= kfirst[t] && nn < klast[t];
        vis[n * kL + r] = seen ? 1.f : 0.f;
        if (seen) {
          mm[r] = std::max(mm[r], sc[(nc + n) * kL + r]);
          w.blk.push_back(n * kL + r);
          ++cnt[r];
        }
      }
    // A long, mostly visible block (a causal prefill) joins the shared pass over value rows; a
    // draft tree's few, sparsely visible keys go lane by lane.
    const bool shared = nbw > kL && 2 * static_cast<int64_t>(w.blk.size()) >= nbw * R;
    if (shared)
      for (int64_t n = 0; n < nbw; ++n) w.vrows.push_back(blk_row(vn, n0 + n));
    for (int64_t r = 0; r < kL; ++r)
      if (cnt[r] == 0) mm[r] = 0.f;  // nothing visible (or an unused lane): no inf - inf
    m = load(mm);
    // e = exp(score - max) of every key; each lane's weights summed in lane (rank % 16), in
    // rank order, then folded in a fixed tree (classes 8, 4, 2, 1 apart). A window starts at a
    // multiple of 16, so ranks counted from it give the same classes.
    float* e = w.p.data();
    float* sums = w.acc.data() + D * kL;  // [16 classes][16 lanes]
    std::fill(sums, sums + kL * kL, 0.f);
    for (int64_t j = 0; j < nc; ++j) {
      const v16 x = vexp(load(sc + j * kL) - m);
      store(e + j * kL, x);
      store(sums + (j % kL) * kL, load(sums + (j % kL) * kL) + x);
    }
    for (int64_t n = 0; n < nbw; ++n)  // unseen: 0 (a select: an unseen score's exp may overflow)
      store(e + (nc + n) * kL, load(vis + n * kL) > 0.f ? vexp(load(sc + (nc + n) * kL) - m) : v16{});
    int64_t rank[kL];
    for (int64_t r = 0; r < kL; ++r) rank[r] = nc;
    for (int64_t x : w.blk) {
      const int64_t n = x / kL, r = x % kL;
      sums[(rank[r]++ % kL) * kL + r] += e[(nc + n) * kL + r];
    }
    for (int64_t half = kL / 2; half > 0; half /= 2)
      for (int64_t cl = 0; cl < half; ++cl)
        store(sums + cl * kL, load(sums + cl * kL) + load(sums + (cl + half) * kL));
    // acc = sum_j e_j v_j, each element one FMA chain over the lane's keys in rank order
    float* acc = w.acc.data();  // [16 lanes][D]
    weighted_lanes(e, w.vrows.data(), nc, nbw, shared, w.blk,
                   [&](int64_t n) { return blk_row(vn, n0 + n); }, R, D, acc);
    if (nch == 1) {  // out = acc / sum
      for (int64_t r = 0; r < R; ++r) {
        const float l = cnt[r] ? sums[r] : 0.f;
        const float inv = l > 0.f ? 1.f / l : 0.f;  // nothing visible (padding): zeros
        float* o = out + qrow(b, t0, kvh, r);
        for (int64_t d = 0; d < D; ++d) o[d] = acc[r * D + d] * inv;
      }
      return;
    }
    for (int64_t r = 0; r < kL; ++r) {
      float* pr = part + r * (D + 3);
      if (r < R && cnt[r]) {
        std::copy(acc + r * D, acc + (r + 1) * D, pr);
        pr[D] = mm[r];
        pr[D + 1] = sums[r];
        pr[D + 2] = 1.f;
      } else {
        pr[D + 2] = 0.f;
      }
    }
  }

  // The windows of (row b, KV head kvh, block chunk tc), merged in order: out = sum_c w_c acc_c
  // / sum_c w_c l_c with w_c = exp(max_c - max). A query whose keys fill one window gets w = 1:
  // acc * (1 / l), its bits as unsplit. parts: [chunks[b]][kL][D + 3].
  void merge(int64_t b, int64_t kvh, int64_t tc, const float* parts) const {
    const int64_t nch = chunks[b], t0 = tc * TC, R = std::min(TC, T - t0) * G;
    for (int64_t r = 0; r < R; ++r) {
      float mx = -INFINITY;
      for (int64_t c = 0; c < nch; ++c) {
        const float* pr = parts + (c * kL + r) * (D + 3);
        if (pr[D + 2] > 0.f) mx = std::max(mx, pr[D]);
      }
      float* o = out + qrow(b, t0, kvh, r);
      std::fill(o, o + D, 0.f);
      float l = 0.f;
      for (int64_t c = 0; c < nch; ++c) {
        const float* pr = parts + (c * kL + r) * (D + 3);
        if (pr[D + 2] == 0.f) continue;
        const float wc = std::exp(pr[D] - mx);
        l += pr[D + 1] * wc;
        for (int64_t d = 0; d < D; ++d) o[d] += pr[d] * wc;
      }
      const float inv = l > 0.f ? 1.f / l : 0.f;
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
  }

  // Item i: with `split`, one window (decoding and verifying few rows: the windows are the
  // parallel work, merged after all items); else all windows of one (row, KV head, block chunk),
  // merged here (a prefill, or a batch: rows and block chunks are work enough).
  void item(int64_t i, Scratch& w) const {
    const int64_t b = std::upper_bound(first.begin(), first.end(), i) - first.begin() - 1;
    const int64_t nch = chunks[b], local = i - first[b];
    if (split) {
      const int64_t g = local / nch;
      window(b, g / TCH, g % TCH, local % nch, w, part.data() + i * kL * (D + 3));
    } else if (nch == 1) {
      window(b, local / TCH, local % TCH, 0, w, nullptr);
    } else {
      const int64_t kvh = local / TCH, tc = local % TCH;
      w.part.resize(nch * kL * (D + 3));
      load_queries(b, kvh, tc * TC, std::min(TC, T - tc * TC) * G, w);
      w.resume = true;
      for (int64_t c = 0; c < nch; ++c) window(b, kvh, tc, c, w, w.part.data() + c * kL * (D + 3));
      w.resume = false;
      merge(b, kvh, tc, w.part.data());
    }
  }

  void drain() {
    Scratch w;
    const int64_t keys = std::min<int64_t>(S, kChunk) + N;  // a window's cache keys + block keys
    w.qt.resize(D * kL);
    w.sc.resize(keys * kL);
    w.p.resize(keys * kL);
    w.acc.resize(D * kL + kL * kL);
    w.vis.resize(N * kL);
    w.rows.reserve(keys);
    w.vrows.reserve(keys);
    w.blk.reserve(N * kL);
    claims.drain([&](int64_t c) { item(c, w); });
  }
};

// Block positions per item (their T * G queries in at most 16 lanes): the count whose items
// score in the fewest vectors of kQV queries, then the fewest items. SmolLM2 (G = 3) verifying 8
// tokens: 2 items of 4 positions (12 lanes, 3 vectors each) rather than 5 + 3 (15 + 9 lanes, 4 + 3
// vectors), a seventh fewer FMAs in the scores and in the weighted values; bits are the same
// whichever queries share an item.
int64_t block_positions(int64_t T, int64_t G) {
  int64_t best = 1, cost = INT64_MAX;
  for (int64_t tc = 1; tc <= std::min<int64_t>(T, kL / G); ++tc) {
    const int64_t full = T / tc, last = T % tc;
    const int64_t c = full * ((tc * G + kQV - 1) / kQV) + (last * G + kQV - 1) / kQV;
    if (c < cost || (c == cost && (T + tc - 1) / tc <= (T + best - 1) / best)) {
      best = tc;
      cost = c;
    }
  }
  return best;
}

ffi::Error TreeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> kc,
                         ffi::Buffer<ffi::F32> vc, ffi::Buffer<ffi::PRED> valid,
                         ffi::Buffer<ffi::S32> length, ffi::Buffer<ffi::F32> kn,
                         ffi::Buffer<ffi::F32> vn, ffi::Buffer<ffi::PRED> mask, float scale,
                         ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions(), cd = kc.dimensions(), nd = kn.dimensions(), md = mask.dimensions();
  if (qd.size() != 4 || cd.size() != 4 || nd.size() != 4 || md.size() != 3 ||
      cd[0] != qd[0] || cd[3] != qd[3] || qd[3] % kL != 0 || qd[2] % cd[1] != 0 || qd[2] / cd[1] > kL ||
      nd[0] != qd[0] || nd[2] != cd[1] || nd[3] != qd[3] || md[0] != qd[0] || md[1] != qd[1] ||
      md[2] != nd[1] || valid.element_count() != cd[0] * cd[2] || length.element_count() != cd[0] ||
      vc.element_count() != kc.element_count() || vn.element_count() != kn.element_count()) {
    return ffi::Error::InvalidArgument(
        "spec_jax tree attention: expected q [B,T,H,D], caches [B,KVH,S,D], valid [B,S], "
        "length [B], new K/V [B,N,KVH,D], mask [B,T,N], H a multiple of KVH (at most 16 times), D of 16");
  }
  auto job = std::make_shared<AttnJob>();
  job->q = q.typed_data();
  job->kc = kc.typed_data();
  job->vc = vc.typed_data();
  job->valid = valid.typed_data();
  job->length = length.typed_data();
  job->kn = kn.typed_data();
  job->vn = vn.typed_data();
  job->mask = mask.typed_data();
  job->out = out->typed_data();
  job->B = qd[0];
  job->T = qd[1];
  job->H = qd[2];
  job->D = qd[3];
  job->KVH = cd[1];
  job->S = cd[2];
  job->N = nd[1];
  job->G = job->H / job->KVH;
  job->TC = block_positions(job->T, job->G);
  job->TCH = (job->T + job->TC - 1) / job->TC;
  job->scale = scale;
  // windows per row: enough for its slots below length and every block key (an upper bound on
  // any query's keys); a row whose keys fit one window runs unsplit
  job->first.assign(job->B + 1, 0);
  job->chunks.assign(job->B, 1);
  job->dense.assign(job->B, 1);
  job->visible.resize(job->B);
  bool any_split = false;
  for (int64_t b = 0; b < job->B; ++b) {
    const int64_t len = std::clamp<int64_t>(job->length[b], 0, job->S);
    const bool* vrow = job->valid + b * job->S;
    if (std::find(vrow, vrow + len, false) != vrow + len) {
      job->dense[b] = 0;
      for (int64_t s = 0; s < len; ++s)
        if (vrow[s]) job->visible[b].push_back(static_cast<int32_t>(s));
    }
    job->chunks[b] = std::max<int64_t>(1, (len + job->N + kChunk - 1) / kChunk);
    any_split |= job->chunks[b] > 1;
  }
  // windows as items of their own only where (row, KV head, block chunk) items are too few to
  // keep the threads busy (decoding SmolLM2: 3 KV heads on 2 threads)
  const int64_t groups = job->B * job->KVH * job->TCH;
  job->split = any_split && groups < 2 * spec_jax::pool_threads(pool);
  for (int64_t b = 0; b < job->B; ++b)
    job->first[b + 1] = job->first[b] + job->KVH * job->TCH * (job->split ? job->chunks[b] : 1);
  if (job->split) job->part.resize(job->first[job->B] * kL * (job->D + 3));
  job->claims.total = job->first[job->B];
  spec_jax::run_shared(pool, job);
  if (job->split)
    for (int64_t b = 0; b < job->B; ++b)
      if (job->chunks[b] > 1)
        for (int64_t g = 0; g < job->KVH * job->TCH; ++g)
          job->merge(b, g / job->TCH, g % job->TCH,
                     job->part.data() + (job->first[b] + g * job->chunks[b]) * kL * (job->D + 3));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecJaxTreeAttention, TreeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());
