// GPU tests run only where a CUDA device is present; elsewhere (CI) they skip
// with a message, so a green CI never pretends a GPU path was exercised.
#pragma once
#include <gtest/gtest.h>

#include "loom/ops/backend.hpp"

#define LOOM_REQUIRE_GPU()                                                                   \
  do {                                                                                       \
    if (!::loom::cuda_available())                                                           \
      GTEST_SKIP() << "no CUDA device here (or loom built without CUDA): GPU test skipped";  \
  } while (0)
