# xpm-train --batcher and --microbatch-size: bad values exit with code 2 and one line naming the
# option, writing no run folder; the power batcher (and the fixed one) refuse a data-parallel
# run (--nproc 2) with code 2, every rank saying why, before any training.
# Run as: cmake -DXPM_TRAIN=<xpm-train> -DDATA_DIR=<data/brown> -DWORK_DIR=<dir> -P ...
cmake_minimum_required(VERSION 3.22)
include("${CMAKE_CURRENT_LIST_DIR}/cli_test_helpers.cmake")
if(NOT EXISTS "${DATA_DIR}/cats.txt")
  message(FATAL_ERROR "no corpus in ${DATA_DIR}: run tools/setup.sh (make test does)")
endif()
set(run "${WORK_DIR}/xpm_train_batchers_test")
file(REMOVE_RECURSE "${run}")
function(expect_input_error label pattern)
  execute_process(COMMAND "${XPM_TRAIN}" --data-dir "${DATA_DIR}" --run-dir "${run}" ${ARGN}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 2)
    message(FATAL_ERROR "${label}: exit code ${rc}, expected 2 (stderr: ${err})")
  endif()
  if(NOT err MATCHES "^xpm-train: error: [^\n]*${pattern}[^\n]*\n$")
    message(FATAL_ERROR "${label}: stderr [${err}] is not one line matching '${pattern}'")
  endif()
  if(EXISTS "${run}")
    message(FATAL_ERROR "${label}: a run folder was written")
  endif()
endfunction()
expect_input_error("unknown batcher" "--batcher must be 'predictive', 'fixed' or 'power', got 'bogus'"
                   --batcher bogus)
expect_input_error("zero microbatch size" "--microbatch-size must be >= 1, got 0"
                   --batcher fixed --microbatch-size 0)
expect_input_error("negative microbatch size" "--microbatch-size must be >= 1, got -3"
                   --batcher power --microbatch-size -3)
expect_input_error("microbatch size above the outer batch"
                   "--microbatch-size must be at most --outer-batch-size \\(32\\), got 33"
                   --batcher fixed --outer-batch-size 32 --microbatch-size 33)
expect_input_error("microbatch size with the predictive batcher"
                   "--microbatch-size is for the fixed and power batchers"
                   --microbatch-size 8)

# Data-parallel: every rank refuses with code 2 and the reason.
function(expect_every_rank_refuses batcher pattern)
  file(REMOVE_RECURSE "${run}")
  execute_process(COMMAND "${XPM_TRAIN}" --data-dir "${DATA_DIR}" --run-dir "${run}" --batcher ${batcher}
                          --nproc 2 --threads 1 --rendezvous-timeout-s 60 --collective-timeout-s 30
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 180)
  if(NOT rc EQUAL 2)
    message(FATAL_ERROR "--batcher ${batcher} --nproc 2: exit code ${rc}, expected 2 (stderr: ${err})")
  endif()
  foreach(rank 0 1)
    if(NOT err MATCHES "xpm-train: rank ${rank}: error: [^\n]*${pattern}")
      message(FATAL_ERROR "--batcher ${batcher} --nproc 2: rank ${rank} did not say '${pattern}' "
                          "(stderr: ${err})")
    endif()
  endforeach()
  if(EXISTS "${run}/metrics.jsonl" OR EXISTS "${run}/summary.json")
    message(FATAL_ERROR "--batcher ${batcher} --nproc 2: training started")
  endif()
endfunction()
expect_every_rank_refuses(power
  "PowerAdaptativeBatcher refuses world_size 2: [^\n]*desynchronize at the next collective[^\n]*https://github.com/pytorch/pytorch/issues/50820")
expect_every_rank_refuses(fixed "--batcher 'fixed' runs in a single process only, got world_size 2")
# Passed (a failed check above stops the script): its run folders are removed.
cli_remove_run_folders("${run}")
