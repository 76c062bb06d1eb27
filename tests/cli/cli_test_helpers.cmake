# Helpers of the command-line tests of the project's programs: every error is one line, without a
# C++ backtrace, with its exit code; a correct command line still runs; a passed script removes its
# run folders. Included by the *_arguments_test.cmake, *_errors_test.cmake and xpm_train_* scripts.
cmake_minimum_required(VERSION 3.22)

# cli_expect_no_backtrace(<label> <text>): no line of a C++ or LibTorch backtrace in <text>.
function(cli_expect_no_backtrace label text)
  foreach(marker "frame #" "Exception raised from")
    string(FIND "${text}" "${marker}" at)
    if(NOT at EQUAL -1)
      message(FATAL_ERROR "${label}: the output has a backtrace ('${marker}'): [${text}]")
    endif()
  endforeach()
endfunction()

# cli_expect_error(<label> <exit code> <regex> <command>...): runs the command; its exit code must
# be <exit code> and its stderr exactly one line matching <regex>, without a backtrace. Sets OUT
# and ERR in the caller's scope.
function(cli_expect_error label expected pattern)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err
                  TIMEOUT 600)
  if(NOT rc STREQUAL "${expected}")
    message(FATAL_ERROR "${label}: exit code ${rc}, expected ${expected}\nstdout: ${out}\nstderr: ${err}")
  endif()
  cli_expect_no_backtrace("${label}" "${err}")
  string(REGEX REPLACE "\n$" "" line "${err}")
  if(line MATCHES "\n" OR NOT err MATCHES "\n$")
    message(FATAL_ERROR "${label}: stderr is not exactly one line: [${err}]")
  endif()
  if(NOT line MATCHES "${pattern}")
    message(FATAL_ERROR "${label}: stderr [${line}] does not match '${pattern}'")
  endif()
  set(OUT "${out}" PARENT_SCOPE)
  set(ERR "${err}" PARENT_SCOPE)
endfunction()

# cli_expect_success(<label> <command>...): exit code 0. Sets OUT and ERR in the caller's scope.
function(cli_expect_success label)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err
                  TIMEOUT 600)
  if(NOT rc STREQUAL "0")
    message(FATAL_ERROR "${label}: exit code ${rc}, expected 0\nstdout: ${out}\nstderr: ${err}")
  endif()
  set(OUT "${out}" PARENT_SCOPE)
  set(ERR "${err}" PARENT_SCOPE)
endfunction()

# cli_remove_run_folders(<folder>...): a script's last step, removing the folders it wrote under
# WORK_DIR (training runs hold ~24 MB of parameters and checkpoints each). A failed check stops
# the script with FATAL_ERROR before this step, so a failing test keeps its folders. WORK_DIR
# itself, shared by every command-line test, and anything outside it are refused.
function(cli_remove_run_folders)
  foreach(folder IN LISTS ARGN)
    cmake_path(SET relative NORMALIZE "${folder}")
    cmake_path(RELATIVE_PATH relative BASE_DIRECTORY "${WORK_DIR}")
    if(relative STREQUAL "" OR relative STREQUAL "." OR relative MATCHES "^\\.\\.(/|$)"
       OR NOT IS_ABSOLUTE "${folder}" OR NOT IS_ABSOLUTE "${WORK_DIR}")
      message(FATAL_ERROR "cli_remove_run_folders: '${folder}' is not a folder under WORK_DIR '${WORK_DIR}'")
    endif()
    file(REMOVE_RECURSE "${folder}")
  endforeach()
endfunction()
