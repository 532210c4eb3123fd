// Translation unit B of the ODR test (see tests/support/odr_exercise.hpp).
#include "support/odr_exercise.hpp"

double odr_b_result() { return exercise_all_policies(); }
std::vector<const void*> odr_b_addresses() { return inline_function_addresses(); }
