// A downstream program: it only sees kvevict through its CMake package or subdirectory.
#include <kvevict/kvevict.hpp>

#include <cstdio>
#include <vector>

int main() {
  const kvevict::Geometry g{1, 4, 2, 8};
  kvevict::KVCache<kvevict::policies::StreamingLLM> cache(g, kvevict::Budget::uniform(8));
  std::vector<float> k(2 * 8, 0.5f), v(2 * 8, 0.25f);
  for (int t = 0; t < 20; ++t) cache.append(0, t, k, v);
  if (cache.size(0, 0) != 8 || cache.positions(0, 0).size() != 8) return 1;
  std::puts("consumer ok");
  return 0;
}
