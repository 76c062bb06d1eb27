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
