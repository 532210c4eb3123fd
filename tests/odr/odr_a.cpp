// Translation unit A of the ODR test (see tests/support/odr_exercise.hpp); holds main.
#include <cstdio>

#include "support/odr_exercise.hpp"

double odr_b_result();
std::vector<const void*> odr_b_addresses();

int main() {
  const double a = exercise_all_policies();
  const double b = odr_b_result();
  if (a != b || !(a > 0)) {
    std::fprintf(stderr, "translation units disagree: %.17g vs %.17g\n", a, b);
    return 1;
  }
  if (inline_function_addresses() != odr_b_addresses()) {
    std::fprintf(stderr, "an inline library function has two definitions\n");
    return 1;
  }
  std::printf("two translation units agree: %.17g\n", a);
  return 0;
}
