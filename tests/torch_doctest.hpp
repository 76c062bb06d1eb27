// Include this instead of <doctest/doctest.h> in tests that use LibTorch. LibTorch's headers
// define glog-style CHECK / CHECK_EQ / ... macros (abort on failure, not counted by doctest);
// including LibTorch first, undefining them, then doctest makes every CHECK a doctest assertion.
#pragma once

#include <torch/torch.h>

#undef CHECK
#undef CHECK_EQ
#undef CHECK_NE
#undef CHECK_LT
#undef CHECK_LE
#undef CHECK_GT
#undef CHECK_GE
#undef CHECK_FALSE

#include <doctest/doctest.h>
