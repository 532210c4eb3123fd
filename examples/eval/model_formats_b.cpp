// kvevict-eval --model --kv-format: the engine in every storage format for H2O and
// ExpectedAttention (model_formats.hpp; model_formats_a.cpp holds the others).
#include "model_formats.hpp"

namespace kvevict::eval {
template struct FormatRunner<policies::H2O>;
template struct FormatRunner<policies::ExpectedAttention>;
}  // namespace kvevict::eval
