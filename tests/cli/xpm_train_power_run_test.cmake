# xpm-train with the batchers that have no memory model, on the real corpus under a CPU cap of
# 1.8 x static memory: --batcher power starts with the whole outer batch of 64, runs out of
# memory, shrinks, redoes the step and counts it; --batcher fixed runs slices of the size asked.
# Neither probes nor writes memory_model.json; summary.json has the usual fields plus batcher,
# microbatch_size, retried_steps and oom_skipped_steps; predicted fields are 0.
# Run as: cmake -DXPM_TRAIN=<xpm-train> -DDATA_DIR=<data/brown> -DWORK_DIR=<dir> -P ...
cmake_minimum_required(VERSION 3.22)
include("${CMAKE_CURRENT_LIST_DIR}/cli_test_helpers.cmake")
if(NOT EXISTS "${DATA_DIR}/cats.txt")
  message(FATAL_ERROR "no corpus in ${DATA_DIR}: run tools/setup.sh (make test does)")
endif()

# run_train(<name> <steps> args...): runs, checks the run folder, sets summary_<key> in the caller.
function(run_train name steps)
  set(run "${WORK_DIR}/xpm_train_${name}_run_test")
  file(REMOVE_RECURSE "${run}")
  execute_process(COMMAND "${XPM_TRAIN}" --data-dir "${DATA_DIR}" --run-dir "${run}" --max-steps ${steps}
                          --memory-cap-factor 1.8 --max-validation-sentences 200 --threads 2 --quiet ${ARGN}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${name}: xpm-train exited with ${rc}: ${err}")
  endif()
  foreach(f config.json metrics.jsonl summary.json)
    if(NOT EXISTS "${run}/${f}")
      message(FATAL_ERROR "${name}: run folder lacks ${f}")
    endif()
  endforeach()
  if(EXISTS "${run}/memory_model.json")
    message(FATAL_ERROR "${name}: memory_model.json written without a memory model")
  endif()
  file(STRINGS "${run}/metrics.jsonl" lines)
  list(FILTER lines EXCLUDE REGEX "\"validation\":")  # the validation lines
  list(LENGTH lines n)
  if(NOT n EQUAL steps)
    message(FATAL_ERROR "${name}: metrics.jsonl has ${n} step lines, expected ${steps}")
  endif()
  foreach(line IN LISTS lines)
    foreach(key microbatch_size ooms attempts peak_allocated_bytes)
      string(JSON value ERROR_VARIABLE missing GET "${line}" ${key})
      if(missing)
        message(FATAL_ERROR "${name}: a metrics.jsonl line lacks ${key}: ${line}")
      endif()
    endforeach()
  endforeach()
  list(GET lines 0 first_line)
  string(JSON first_ooms GET "${first_line}" ooms)
  set(first_ooms ${first_ooms} PARENT_SCOPE)
  file(READ "${run}/summary.json" summary)
  foreach(key batcher microbatch_size retried_steps oom_skipped_steps ooms train_steps microbatches
              peak_allocated_bytes capacity_bytes tokens_per_s val_token_accuracy probes usable_bytes
              max_step_prediction_rel_error canonical_formula)
    string(JSON value ERROR_VARIABLE missing GET "${summary}" ${key})
    if(missing)
      message(FATAL_ERROR "${name}: summary.json lacks ${key}")
    endif()
    set(summary_${key} "${value}" PARENT_SCOPE)
  endforeach()
  message(STATUS "${name}: ${summary}")
endfunction()

run_train(power 3 --batcher power)
if(NOT summary_batcher STREQUAL "power" OR NOT summary_train_steps EQUAL 3)
  message(FATAL_ERROR "power: batcher '${summary_batcher}', ${summary_train_steps} steps")
endif()
if(summary_ooms LESS 1 OR summary_retried_steps LESS 1 OR first_ooms LESS 1)
  message(FATAL_ERROR "power: ooms=${summary_ooms} retried_steps=${summary_retried_steps} "
                      "first-step ooms=${first_ooms}: the whole outer batch should not fit 1.8 x static")
endif()
if(NOT summary_oom_skipped_steps EQUAL 0)
  message(FATAL_ERROR "power: ${summary_oom_skipped_steps} steps skipped, expected every step redone")
endif()
if(summary_microbatch_size LESS 1 OR NOT summary_microbatch_size LESS 64)
  message(FATAL_ERROR "power: final microbatch size ${summary_microbatch_size}, expected in [1, 64)")
endif()
if(summary_peak_allocated_bytes GREATER summary_capacity_bytes OR summary_peak_allocated_bytes LESS_EQUAL 0)
  message(FATAL_ERROR "power: peak ${summary_peak_allocated_bytes} not in (0, cap ${summary_capacity_bytes}]")
endif()
if(NOT summary_probes EQUAL 0 OR NOT summary_usable_bytes EQUAL 0 OR
   NOT summary_max_step_prediction_rel_error EQUAL 0 OR NOT summary_canonical_formula STREQUAL "")
  message(FATAL_ERROR "power: predicted fields are not 0 / empty")
endif()

run_train(fixed 2 --batcher fixed --microbatch-size 4)
if(NOT summary_batcher STREQUAL "fixed" OR NOT summary_microbatch_size EQUAL 4 OR
   NOT summary_retried_steps EQUAL 0)
  message(FATAL_ERROR "fixed: batcher '${summary_batcher}', microbatch size ${summary_microbatch_size}, "
                      "retried ${summary_retried_steps}")
endif()
if(NOT summary_ooms EQUAL 0 OR NOT summary_microbatches EQUAL 32)
  message(FATAL_ERROR "fixed: ooms=${summary_ooms} microbatches=${summary_microbatches}, "
                      "expected 0 and 2 steps x 64 / 4")
endif()
# Passed (a failed check above stops the script): its run folders are removed.
cli_remove_run_folders("${WORK_DIR}/xpm_train_power_run_test"
                       "${WORK_DIR}/xpm_train_fixed_run_test")
