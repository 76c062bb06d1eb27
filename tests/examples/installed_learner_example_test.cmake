# Installs xpm into a temporary prefix, configures and builds the Learner example with
# find_package(xpm COMPONENTS planner trainer) from that prefix alone, then runs it: a run
# stopped after step 4 and resumed ends with the same best parameters, byte for byte, as an
# uninterrupted one; a run of 2 ranks (--nproc 2) trains too; every run has 0 OOM.
set(REQUIRED_HEADERS xpm/trainer/loop/learner.hpp xpm/trainer/loop/training_task.hpp)
include(${CMAKE_CURRENT_LIST_DIR}/install_and_build_example.cmake)
function(expect label pattern)
  if(NOT OUT MATCHES "${pattern}")
    message(FATAL_ERROR "${label}: no '${pattern}' in:\n${OUT}")
  endif()
endfunction()
set(program "${WORK_DIR}/build/conv-genre-classifier")
set(common --data-dir "${DATA_DIR}" --steps 8 --threads 1)

run("whole run" "${program}" ${common} --run-dir "${WORK_DIR}/whole")
message(STATUS "whole run:\n${OUT}")
expect("whole run" "OOM 0,")
expect("whole run" "validation at step 8: accuracy")

# A cap below what the model and its optimizer hold: bad input (exit 2) naming the flag, not an
# internal error.
execute_process(COMMAND "${program}" ${common} --run-dir "${WORK_DIR}/tiny_cap" --memory-cap-bytes 1000
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 2 OR NOT err MATCHES "error: --memory-cap-bytes 1000: the model and its optimizer alone run out of memory under it")
  message(FATAL_ERROR "tiny cap: exit code ${rc}, expected 2 naming --memory-cap-bytes\nstderr: ${err}")
endif()

run("stopped run" "${program}" ${common} --run-dir "${WORK_DIR}/resumed" --stop-after-steps 4)
expect("stopped run" "stopped after step 4")
run("resumed run" "${program}" ${common} --run-dir "${WORK_DIR}/resumed" --resume)
message(STATUS "resumed run:\n${OUT}")
expect("resumed run" "resuming from .*step-00000004")
expect("resumed run" "OOM 0,")
file(SHA256 "${WORK_DIR}/whole/best_parameters.pt" whole)
file(SHA256 "${WORK_DIR}/resumed/best_parameters.pt" resumed)
if(NOT whole STREQUAL resumed)
  message(FATAL_ERROR "the resumed run's parameters differ from the uninterrupted run's")
endif()

run("2 ranks" "${program}" ${common} --run-dir "${WORK_DIR}/two_ranks" --nproc 2)
message(STATUS "2 ranks:\n${OUT}")
expect("2 ranks" "OOM 0,")

# From the third step, every microbatch of both ranks: (planned - measured) / measured within
# -1 % and +3 % (metrics.jsonl's microbatch_planned_rel_errors).
file(STRINGS "${WORK_DIR}/two_ranks/metrics.jsonl" lines)
set(checked 0)
foreach(line IN LISTS lines)
  string(JSON step ERROR_VARIABLE no_step GET "${line}" step)
  string(JSON count ERROR_VARIABLE no_errors LENGTH "${line}" microbatch_planned_rel_errors)
  if(no_step OR no_errors OR step LESS 3 OR count EQUAL 0)
    continue()
  endif()
  math(EXPR last "${count} - 1")
  foreach(i RANGE ${last})
    string(JSON error GET "${line}" microbatch_planned_rel_errors ${i})
    if(error LESS -0.01 OR error GREATER 0.03)
      message(FATAL_ERROR "2 ranks: step ${step}: a microbatch predicted ${error} off its peak (outside -1 % .. +3 %)")
    endif()
    math(EXPR checked "${checked} + 1")
  endforeach()
endforeach()
if(checked EQUAL 0)
  message(FATAL_ERROR "2 ranks: no microbatch_planned_rel_errors from step 3 in metrics.jsonl")
endif()
message(STATUS "2 ranks: ${checked} microbatches from step 3 within -1 % .. +3 % of their peaks")
