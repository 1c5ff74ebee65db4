// Small-row matrix products for decoding and tree verification on CPU (an XLA FFI handler).
//
// y[R, N] = x[R, K] @ W, with W packed as panels [N / 32, K, 32]: each panel is one contiguous
// stream, so the weights are read once, sequentially, at memory bandwidth, whatever R is (row
// tiles of 8/4/2/1 reuse a panel from cache). XLA:CPU's own dot reads weights at ~24 GB/s for
// one row but 13-17 GB/s for 2-8 rows, which made verifying a draft tree cost 1.4-1.9x a decode
// step. Every output element is one fused multiply-add chain over k = 0..K-1, so a row's result
// is bit-identical whatever R is and whichever rows share the call (decode and verify agree).
//
// Work is split over chunks of panels, shared with XLA's intra-op pool (cpu_pool.h).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

#include "cpu_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kPanel = 32;  // columns per panel (two 16-float vectors)
typedef float v16 __attribute__((vector_size(64)));

template <int TB>
inline void tile(const float* __restrict x, int64_t K, const float* __restrict panel,
                 float* __restrict y, int64_t N) {
  v16 acc[TB][2];
  for (int t = 0; t < TB; ++t) acc[t][0] = acc[t][1] = v16{};
  const float* w = panel;
  for (int64_t k = 0; k < K; ++k, w += kPanel) {
    v16 w0, w1;
    std::memcpy(&w0, w, 64);
    std::memcpy(&w1, w + 16, 64);
    for (int t = 0; t < TB; ++t) {
      const float xs = x[t * K + k];
      acc[t][0] += xs * w0;
      acc[t][1] += xs * w1;
    }
  }
  for (int t = 0; t < TB; ++t) {
    std::memcpy(y + t * N, &acc[t][0], 64);
    std::memcpy(y + t * N + 16, &acc[t][1], 64);
  }
}

// All R rows against panels [p0, p1).
void panels(const float* x, int64_t R, int64_t K, const float* w, int64_t N, float* y,
            int64_t p0, int64_t p1) {
  for (int64_t p = p0; p < p1; ++p) {
    const float* panel = w + p * K * kPanel;
    float* yp = y + p * kPanel;
    int64_t r = 0;
    for (; r + 8 <= R; r += 8) tile<8>(x + r * K, K, panel, yp + r * N, N);
    if (r + 4 <= R) { tile<4>(x + r * K, K, panel, yp + r * N, N); r += 4; }
    if (r + 2 <= R) { tile<2>(x + r * K, K, panel, yp + r * N, N); r += 2; }
    if (r < R) tile<1>(x + r * K, K, panel, yp + r * N, N);
  }
}

struct Job {
  const float* x;
  const float* w;
  float* y;
  int64_t R, K, N, num_panels, chunk;
  spec_jax::Claims claims;  // one item per chunk of panels

  void drain() {
    claims.drain([this](int64_t c) {
      const int64_t p0 = c * chunk, p1 = std::min(num_panels, p0 + chunk);
      panels(x, R, K, w, N, y, p0, p1);
    });
  }
};

ffi::Error PackedGemm(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                      ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || wd[2] != kPanel ||
      wd[1] != xd[1] || yd[0] != xd[0] || yd[1] != wd[0] * kPanel) {
    return ffi::Error::InvalidArgument(
        "spec_jax packed gemm: expected x [R, K], w [N/32, K, 32], y [R, N]");
  }
  auto job = std::make_shared<Job>();
  job->x = x.typed_data();
  job->w = w.typed_data();
  job->y = y->typed_data();
  job->R = xd[0];
  job->K = xd[1];
  job->N = yd[1];
  job->num_panels = wd[0];
  // About four chunks per thread: small enough to balance, large enough to stream.
  job->chunk = std::max<int64_t>(1, job->num_panels / (4 * spec_jax::pool_threads(pool)));
  job->claims.total = (job->num_panels + job->chunk - 1) / job->chunk;
  spec_jax::run_shared(pool, job);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecJaxPackedGemm, PackedGemm,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
