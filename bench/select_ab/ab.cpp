// Float top-k at small k, two include trees (topk_A, topk_B: bench/select_ab/tu.cpp) and
// std::nth_element on values (copy + nth_element, as bench_kernels' std_nth_element_values)
// interleaved in one process: per case 21 repetitions of 500 calls each, A, B, nth in turn,
// medians of CPU time per call. N(0,1) scores, repeated (one vector) or varied (16 in turn).
// Usage: bench/run_select_ab.sh (stop 36, docs/benchmarks.md "Small-n select, stop 36").
#include <algorithm>
#include <cstdio>
#include <cstdint>
#include <random>
#include <vector>
#include <ctime>
#include <cstdlib>
#include <functional>
void topk_A(const float*, std::size_t, std::size_t, std::uint32_t*);
void topk_B(const float*, std::size_t, std::size_t, std::uint32_t*);
static double cpu_ns() { timespec t; clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t); return t.tv_sec * 1e9 + t.tv_nsec; }
int main(int argc, char** argv) {
  std::vector<int> ns = {256, 320, 384, 512, 768, 1024, 2048, 4096};
  std::vector<int> ks = {1, 4, 8, 10, 12, 14, 16, 20, 32, 64};
  if (const char* e = std::getenv("KS")) { ks.clear(); for (const char* p = e; *p;) { ks.push_back(std::atoi(p)); while (*p && *p != ',') ++p; if (*p) ++p; } }
  if (argc > 1) { ns.clear(); for (int a = 1; a < argc; ++a) ns.push_back(atoi(argv[a])); }
  for (int n : ns) for (int k0 : ks) for (int varied = 0; varied < 2; ++varied) {
    int k = k0 ? k0 : n / 2;
    std::mt19937_64 rng(6); std::normal_distribution<float> g;
    std::vector<std::vector<float>> in(16, std::vector<float>(n));
    for (auto& s : in) for (auto& v : s) v = g(rng);
    std::vector<std::uint32_t> oa(n), ob(n);
    std::vector<double> ta, tb, tn;
    std::vector<float> work(n);
    for (int rep = 0; rep < 21; ++rep) for (int w = 0; w < 3; ++w) {
      double t0 = cpu_ns();
      if (w == 2) {
        for (int i = 0; i < 500; ++i) { auto& s = in[varied ? i % 16 : 0]; std::copy(s.begin(), s.end(), work.begin());
          std::nth_element(work.begin(), work.begin() + (k - 1), work.end(), std::greater<>()); asm volatile("" ::: "memory"); }
        tn.push_back((cpu_ns() - t0) / 500);
        continue;
      }
      auto fn = w ? topk_B : topk_A;
      for (int i = 0; i < 500; ++i) { fn(in[varied ? i % 16 : 0].data(), n, k, w ? ob.data() : oa.data()); asm volatile("" ::: "memory"); }
      (w ? tb : ta).push_back((cpu_ns() - t0) / 500);
    }
    std::sort(ta.begin(), ta.end()); std::sort(tb.begin(), tb.end()); std::sort(tn.begin(), tn.end());
    std::printf("n=%4d k=%3d %s A %6.1f B %6.1f nth_values %6.1f  A/B %.2f  nth/A %.2f nth/B %.2f\n", n, k, varied ? "var" : "rep", ta[10], tb[10], tn[10], ta[10] / tb[10], tn[10] / ta[10], tn[10] / tb[10]);
  }
}
