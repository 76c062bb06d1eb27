# The project's other programs ignore no argument either: a stray word exits with code 2 and one
# line naming it, and a correct command line (--help, or listing the benchmarks) exits with 0.
# Each program is passed as -D<NAME>=<path>; the ones not built are not passed and not checked:
# XPM_PLAN_PROBE, XPM_RANK_EXAMPLE, XPM_CHECKPOINT_WRITER, XPM_SHARDING_WORKER, HELDOUT_PREDICTION,
# RAW_TRAINING_LOOP, CPU_METER_UNSEEN (LibTorch); PACKER_BENCH, FIT_BENCH, BENCH_REPORT, BATCHER_COMPARISON,
# DDP_THROUGHPUT (benchmarks). Run as: cmake -D...=<path> -DDATA_DIR=<data/brown> -DWORK_DIR=<dir> -P ...
include("${CMAKE_CURRENT_LIST_DIR}/cli_test_helpers.cmake")
set(dir "${WORK_DIR}/programs_arguments_test")
file(REMOVE_RECURSE "${dir}")
file(MAKE_DIRECTORY "${dir}")

# A Boost.Program_options program: `garbage` is refused by name, --help succeeds.
function(expect_refuses_stray_word name variable)
  if(NOT DEFINED ${variable})
    return()
  endif()
  cli_expect_error("${name} garbage" 2 "^${name}: error: unexpected argument 'garbage' \\([^)]*\\)$"
                   "${${variable}}" garbage)
  cli_expect_success("${name} --help" "${${variable}}" --help)
endfunction()

expect_refuses_stray_word(xpm-rank-example XPM_RANK_EXAMPLE)
expect_refuses_stray_word(heldout-prediction HELDOUT_PREDICTION)
if(DEFINED HELDOUT_PREDICTION)  # --device cuda: one line before any work
  cli_expect_error("heldout-prediction --device cuda" 2 "^heldout-prediction: error: [^\n]*--device 'cuda': [^\n]*$"
                   "${HELDOUT_PREDICTION}" --data-dir "${DATA_DIR}" --device cuda)
endif()
expect_refuses_stray_word(raw-training-loop RAW_TRAINING_LOOP)
expect_refuses_stray_word(bench-report BENCH_REPORT)
expect_refuses_stray_word(batcher-comparison BATCHER_COMPARISON)
expect_refuses_stray_word(ddp-throughput DDP_THROUGHPUT)
expect_refuses_stray_word(cpu-meter-unseen CPU_METER_UNSEEN)

if(DEFINED XPM_PLAN_PROBE)  # the helper of `xpm-plan probe`, run by hand
  cli_expect_error("xpm-plan-probe probe garbage" 2
                   "^xpm-plan: error: unexpected argument 'garbage' \\(probe takes no positional arguments; see xpm-plan probe --help\\)$"
                   "${XPM_PLAN_PROBE}" probe --probe-points 8x64 garbage)
  cli_expect_success("xpm-plan-probe --help" "${XPM_PLAN_PROBE}" --help)
endif()
if(DEFINED XPM_CHECKPOINT_WRITER)  # test helpers: fixed arguments
  cli_expect_error("xpm-checkpoint-writer with a third argument" 2
                   "^xpm-checkpoint-writer: error: unexpected argument 'garbage' \\(usage: [^)]*\\)$"
                   "${XPM_CHECKPOINT_WRITER}" "${dir}/checkpoints" 8 garbage)
  cli_expect_error("xpm-checkpoint-writer with a bad count" 2
                   "^xpm-checkpoint-writer: error: FLOATS_PER_TENSOR 'eight' is not a whole number >= 1$"
                   "${XPM_CHECKPOINT_WRITER}" "${dir}/checkpoints" eight)
endif()
if(DEFINED XPM_SHARDING_WORKER)
  cli_expect_error("xpm-sharding-worker with a stray word" 2
                   "^xpm-sharding-worker: error: unexpected argument 'garbage' \\(scenario 'clip' takes 2 after OUT_DIR\\)$"
                   "${XPM_SHARDING_WORKER}" clip "${dir}" 1 2 garbage)
endif()
# Google Benchmark programs: a flag it does not know, or a stray word, is exit code 2.
if(DEFINED FIT_BENCH)
  cli_expect_error("fit_bench garbage" 2 ": error: unrecognized command-line flag: garbage$" "${FIT_BENCH}" garbage)
  cli_expect_success("fit_bench --benchmark_list_tests=true" "${FIT_BENCH}" --benchmark_list_tests=true)
endif()
if(DEFINED PACKER_BENCH)
  cli_expect_error("packer_bench garbage" 2 ": error: unrecognized command-line flag: garbage$"
                   "${PACKER_BENCH}" --data-dir "${DATA_DIR}" garbage)
  cli_expect_success("packer_bench --data-dir DIR --benchmark_list_tests=true" "${PACKER_BENCH}"
                     --data-dir "${DATA_DIR}" --benchmark_list_tests=true)
  cli_expect_success("packer_bench --data-dir=DIR --benchmark_list_tests=true" "${PACKER_BENCH}"
                     "--data-dir=${DATA_DIR}" --benchmark_list_tests=true)
endif()
