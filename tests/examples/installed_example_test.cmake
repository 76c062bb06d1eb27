# Installs xpm into a temporary prefix, configures and builds an example with find_package(xpm)
# from that prefix alone, runs it for a few steps and checks what it prints: 0 OOM and the
# prediction error of every microbatch where the formula binds.
set(REQUIRED_HEADERS xpm/planner_torch/step_probing.hpp)
include(${CMAKE_CURRENT_LIST_DIR}/install_and_build_example.cmake)
file(GLOB program "${WORK_DIR}/build/*-*")
list(FILTER program EXCLUDE REGEX "[.]cmake$")
run("run" "${program}" --data-dir "${DATA_DIR}" --steps 6 --threads 1)  # ctest runs two at once
message(STATUS "${OUT}")
if(NOT OUT MATCHES "OOM 0,")
  message(FATAL_ERROR "run: not 0 OOM: ${OUT}")
endif()
if(NOT OUT MATCHES "worst under (-?[0-9]+[.][0-9]+) %")
  message(FATAL_ERROR "run: no prediction error in: ${OUT}")
endif()
if(CMAKE_MATCH_1 LESS -1.0)  # if() compares numbers as doubles
  message(FATAL_ERROR "run: a microbatch was under-predicted by more than 1 %: ${OUT}")
endif()
