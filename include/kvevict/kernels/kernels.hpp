// All kvevict kernels: dispatch, Hamming, SimHash, selection. See docs/kernels.md.
#pragma once

#include "attention_decode.hpp"
#include "dispatch.hpp"
#include "hamming.hpp"
#include "row_dots.hpp"
#include "select.hpp"
#include "simhash.hpp"
