// The learning-rate schedule against its closed form.
#include <gtest/gtest.h>

#include <cmath>

#include "train/optimizer.hpp"

using loom::lr_at;

TEST(Schedule, LinearWarmupThenCosineToMinLr) {
  const double lr = 1e-3, min_lr = 1e-4;
  // 111 steps: 10 of warmup, then 101 decaying from lr (step 10) to min_lr (step 110).
  EXPECT_DOUBLE_EQ(lr_at(0, 111, 10, lr, min_lr, "cosine"), lr * 1 / 10);
  EXPECT_DOUBLE_EQ(lr_at(9, 111, 10, lr, min_lr, "cosine"), lr);
  EXPECT_DOUBLE_EQ(lr_at(10, 111, 10, lr, min_lr, "cosine"), lr);          // decay starts at the peak
  EXPECT_NEAR(lr_at(110, 111, 10, lr, min_lr, "cosine"), min_lr, 1e-15);   // and ends at min_lr
  const double mid = min_lr + 0.5 * (lr - min_lr) * (1 + std::cos(M_PI * 0.5));
  EXPECT_NEAR(lr_at(60, 111, 10, lr, min_lr, "cosine"), mid, 1e-15);
  for (int64_t s = 10; s < 110; ++s)  // monotone decay
    EXPECT_GT(lr_at(s, 111, 10, lr, min_lr, "cosine"), lr_at(s + 1, 111, 10, lr, min_lr, "cosine"));
}

TEST(Schedule, LinearAndConstant) {
  EXPECT_DOUBLE_EQ(lr_at(0, 11, 0, 1.0, 0.0, "linear"), 1.0);
  EXPECT_DOUBLE_EQ(lr_at(5, 11, 0, 1.0, 0.0, "linear"), 0.5);
  EXPECT_DOUBLE_EQ(lr_at(10, 11, 0, 1.0, 0.0, "linear"), 0.0);
  EXPECT_DOUBLE_EQ(lr_at(7, 11, 0, 2.0, 0.0, "constant"), 2.0);
  EXPECT_DOUBLE_EQ(lr_at(1, 11, 4, 2.0, 0.0, "constant"), 1.0);  // warmup applies to every schedule
  EXPECT_THROW(lr_at(5, 11, 0, 1.0, 0.0, "cosin"), loom::Error);
}
