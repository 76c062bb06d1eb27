# Helpers of the command-line tests of the project's programs: every error is one line, without a
# C++ backtrace, with its exit code; a correct command line still runs. Included by the
# *_arguments_test.cmake and *_errors_test.cmake scripts.
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
