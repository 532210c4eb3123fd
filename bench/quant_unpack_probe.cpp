// The exact quantized decode step (issue 15) split into its two passes, outside Google
// Benchmark, to find what binds Q4<32> against Q8<32>: kvevict's dispatched kernels
// (quant_attention_probs, then quant_attention_output) over n rows x HKV KV heads, d = 128,
// G = 4 query heads per KV head, random stored rows (fp16 scales 2^-8..2^-6, random codes).
//   quant_unpack_probe MODE REPS [DUMP]
// MODE cache: n = 4096, Hkv = 1 (K and V in L2: compute only); mem: n = 16K, 32K, 64K at
// Hkv = 8 (the decode benchmark's shape). Prints median CPU µs per step and per pass over
// REPS steps (4 x REPS in cache mode). DUMP: writes the first step's probabilities and
// outputs, so two builds can be compared byte for byte (cmp).
// bench/quant_unpack_probe.sh builds it against the headers of several trees (or a scratch
// copy of one with a kernel part removed, to bound that part's cost) and alternates them.
#include <kvevict/kernels/attention_quant.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <random>
#include <string>
#include <vector>

namespace {
namespace kk = kvevict::kernels;

double cpu_now() {
  timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return double(t.tv_sec) + double(t.tv_nsec) * 1e-9;
}

template <class D>
std::vector<std::uint8_t> make_rows(std::size_t n, std::size_t d, std::mt19937& rng) {
  const std::size_t rb = D::row_bytes(d);
  std::vector<std::uint8_t> r(n * rb);
  std::uniform_int_distribution<int> byte(0, 255);
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t b = 0; b < d / D::group; ++b) {
      std::uint8_t* p = r.data() + i * rb + b * D::block_bytes;
      const auto h = static_cast<std::uint16_t>(((7 + byte(rng) % 3) << 10) | (byte(rng) * 4 + byte(rng) % 4));
      std::memcpy(p, &h, 2);
      for (std::size_t j = 2; j < D::block_bytes; ++j) {
        int v = byte(rng);
        if (D::kind == kk::QKind::q8 && v == 128) v = 129;  // int8 codes in [-127, 127]
        p[j] = static_cast<std::uint8_t>(v);
      }
    }
  return r;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2] * 1e6;
}

template <class D>
void run(const char* name, std::size_t n, int hkv, int reps, FILE* dump) {
  const std::size_t d = 128, G = 4, rb = D::row_bytes(d);
  std::mt19937 rng(static_cast<unsigned>(1234 + n));
  std::vector<std::vector<std::uint8_t>> K(static_cast<std::size_t>(hkv)), V(static_cast<std::size_t>(hkv));
  for (int h = 0; h < hkv; ++h) {
    K[static_cast<std::size_t>(h)] = make_rows<D>(n, d, rng);
    V[static_cast<std::size_t>(h)] = make_rows<D>(n, d, rng);
  }
  std::vector<float> q(static_cast<std::size_t>(hkv) * G * d), probs(G * n), out(q.size());
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (auto& x : q) x = nd(rng);
  const float scale = 1.0f / std::sqrt(float(d));
  std::vector<double> tq, tv, tt;
  for (int it = 0; it < reps; ++it) {
    double a = 0, b = 0;
    const double t0 = cpu_now();
    for (std::size_t h = 0; h < static_cast<std::size_t>(hkv); ++h) {
      const double s0 = cpu_now();
      if (!kk::quant_attention_probs<D>(q.data() + h * G * d, d, G, K[h].data(), rb, n, d, scale, probs.data()))
        std::fprintf(stderr, "non-finite score\n");
      const double s1 = cpu_now();
      kk::quant_attention_output<D>(probs.data(), G, V[h].data(), rb, n, d, out.data() + h * G * d, d);
      const double s2 = cpu_now();
      a += s1 - s0;
      b += s2 - s1;
      if (dump && it == 0) std::fwrite(probs.data(), sizeof(float), probs.size(), dump);
    }
    tt.push_back(cpu_now() - t0);
    tq.push_back(a);
    tv.push_back(b);
    if (dump && it == 0) std::fwrite(out.data(), sizeof(float), out.size(), dump);
  }
  std::printf("%s n=%zu hkv=%d step_us=%.1f qk_us=%.1f pv_us=%.1f\n", name, n, hkv, median(tt), median(tq), median(tv));
}
}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "mem";
  const int reps = argc > 2 ? std::atoi(argv[2]) : 15;
  FILE* dump = argc > 3 ? std::fopen(argv[3], "wb") : nullptr;
  using Q8 = kk::QDesc<kk::QKind::q8, 32>;
  using Q4 = kk::QDesc<kk::QKind::q4, 32>;
  std::printf("isa %s\n", kk::isa_name(kk::attention_isa()));
  if (mode == "cache") {
    run<Q8>("q8", 4096, 1, 4 * reps, dump);
    run<Q4>("q4", 4096, 1, 4 * reps, dump);
  } else {
    for (const std::size_t n : {std::size_t(16384), std::size_t(32768), std::size_t(65536)}) {
      run<Q8>("q8", n, 8, reps, dump);
      run<Q4>("q4", n, 8, reps, dump);
    }
  }
  if (dump) std::fclose(dump);
  return 0;
}
