#include "torch_doctest.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "xpm/trainer/options/lr_schedule.hpp"

namespace {

xpm::LrScheduleOptions schedule(xpm::LrScheduleKind kind, double peak, std::int64_t warmup,
                                std::int64_t total, double final_fraction) {
  xpm::LrScheduleOptions options;
  options.kind = kind;
  options.peak_learning_rate = peak;
  options.warmup_steps = warmup;
  options.total_steps = total;
  options.final_fraction = final_fraction;
  options.validate();
  return options;
}

// The job's schedule as tagging_job.cpp wrote it at commit 443d7fb (scheduled_learning_rate):
// the linear schedule must give the very same doubles so the job can switch to it.
double job_schedule(double peak, std::int64_t warmup_steps, std::int64_t step, std::int64_t total_steps) {
  if (step < warmup_steps) return peak * static_cast<double>(step + 1) / warmup_steps;
  const double span = std::max<std::int64_t>(1, total_steps - warmup_steps);
  const double progress = std::min(1.0, static_cast<double>(step - warmup_steps) / span);
  return peak * (1.0 - 0.9 * progress);
}

}  // namespace

TEST_CASE("the linear schedule warms up linearly and decays linearly to its floor") {
  const auto options = schedule(xpm::LrScheduleKind::kLinear, 1.0, 4, 14, 0.1);
  CHECK(xpm::learning_rate_at(options, 0) == doctest::Approx(0.25));
  CHECK(xpm::learning_rate_at(options, 1) == doctest::Approx(0.5));
  CHECK(xpm::learning_rate_at(options, 3) == doctest::Approx(1.0));
  CHECK(xpm::learning_rate_at(options, 4) == doctest::Approx(1.0));   // decay starts: progress 0
  CHECK(xpm::learning_rate_at(options, 9) == doctest::Approx(0.55));  // 1 - 0.9 * 5/10
  CHECK(xpm::learning_rate_at(options, 13) == doctest::Approx(0.19)); // 1 - 0.9 * 9/10
  CHECK(xpm::learning_rate_at(options, 14) == doctest::Approx(0.1));
  CHECK(xpm::learning_rate_at(options, 1000) == doctest::Approx(0.1));  // stays at the floor
}

TEST_CASE("the linear schedule with a 10 % floor reproduces the job's schedule bit for bit") {
  struct Case { double peak; std::int64_t warmup; std::int64_t total; };
  for (const Case c : {Case{3e-3, 50, 1000}, Case{3e-3, 0, 1}, Case{1e-4, 7, 5}, Case{0.02, 1, 333}}) {
    const auto options = schedule(xpm::LrScheduleKind::kLinear, c.peak, c.warmup, c.total, 0.1);
    for (std::int64_t step = 0; step < c.total + 20; ++step) {
      INFO("peak " << c.peak << " warmup " << c.warmup << " total " << c.total << " step " << step);
      REQUIRE(xpm::learning_rate_at(options, step) == job_schedule(c.peak, c.warmup, step, c.total));
    }
  }
}

TEST_CASE("the cosine schedule follows half a cosine from the peak down to its floor") {
  const auto to_zero = schedule(xpm::LrScheduleKind::kCosine, 2.0, 0, 10, 0.0);
  CHECK(xpm::learning_rate_at(to_zero, 0) == doctest::Approx(2.0));
  CHECK(xpm::learning_rate_at(to_zero, 5) == doctest::Approx(1.0));  // 2 * 0.5 * (1 + cos(pi/2))
  CHECK(xpm::learning_rate_at(to_zero, 10) == doctest::Approx(0.0).epsilon(1e-12));
  // 2 * 0.5 * (1 + cos(pi / 4)) = 1 + sqrt(2)/2
  CHECK(xpm::learning_rate_at(to_zero, 2) ==
        doctest::Approx(2.0 * 0.5 * (1.0 + std::cos(M_PI * 0.2))));
  const auto with_floor = schedule(xpm::LrScheduleKind::kCosine, 2.0, 2, 12, 0.2);
  CHECK(xpm::learning_rate_at(with_floor, 0) == doctest::Approx(1.0));  // warmup 1/2
  CHECK(xpm::learning_rate_at(with_floor, 1) == doctest::Approx(2.0));
  CHECK(xpm::learning_rate_at(with_floor, 7) == doctest::Approx(1.2));  // 2 * (0.2 + 0.8 * 0.5)
  CHECK(xpm::learning_rate_at(with_floor, 12) == doctest::Approx(0.4));
  CHECK(xpm::learning_rate_at(with_floor, 50) == doctest::Approx(0.4));
}

TEST_CASE("the constant schedule holds the peak after its warmup") {
  const auto options = schedule(xpm::LrScheduleKind::kConstant, 0.5, 2, 10, 0.1);
  CHECK(xpm::learning_rate_at(options, 0) == doctest::Approx(0.25));
  CHECK(xpm::learning_rate_at(options, 1) == doctest::Approx(0.5));
  CHECK(xpm::learning_rate_at(options, 9) == doctest::Approx(0.5));
  CHECK(xpm::learning_rate_at(options, 100) == doctest::Approx(0.5));
  const auto no_warmup = schedule(xpm::LrScheduleKind::kConstant, 0.5, 0, 10, 0.1);
  CHECK(xpm::learning_rate_at(no_warmup, 0) == doctest::Approx(0.5));
}

TEST_CASE("schedule kinds parse by name and bad options are refused with the value") {
  CHECK(xpm::parse_lr_schedule_kind("cosine", "--lr-schedule") == xpm::LrScheduleKind::kCosine);
  CHECK(xpm::to_string(xpm::parse_lr_schedule_kind("linear", "x")) == "linear");
  CHECK(xpm::to_string(xpm::LrScheduleKind::kConstant) == "constant");
  CHECK_THROWS_WITH_AS(xpm::parse_lr_schedule_kind("step", "--lr-schedule"),
                       doctest::Contains("--lr-schedule must be 'constant', 'linear' or 'cosine', got 'step'"),
                       std::invalid_argument);
  xpm::LrScheduleOptions options;
  options.final_fraction = 1.5;
  CHECK_THROWS_WITH_AS(options.validate(), doctest::Contains("final_fraction must be in [0, 1], got 1.5"),
                       std::invalid_argument);
  options = {};
  options.total_steps = 0;
  CHECK_THROWS_WITH_AS(options.validate(), doctest::Contains("total_steps must be >= 1, got 0"),
                       std::invalid_argument);
  options = {};
  options.warmup_steps = -1;
  CHECK_THROWS_WITH_AS(options.validate(), doctest::Contains("warmup_steps"), std::invalid_argument);
  options = {};
  options.peak_learning_rate = std::nan("");
  CHECK_THROWS_WITH_AS(options.validate(), doctest::Contains("peak_learning_rate"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(xpm::learning_rate_at(xpm::LrScheduleOptions{}, -1), doctest::Contains("step must be >= 0"),
                       std::invalid_argument);
}
