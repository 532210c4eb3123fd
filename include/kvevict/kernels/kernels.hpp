// All kvevict kernels: dispatch, Hamming, SimHash, selection. See docs/kernels.md.
#pragma once

#include "dispatch.hpp"
#include "hamming.hpp"
#include "select.hpp"
#include "simhash.hpp"
