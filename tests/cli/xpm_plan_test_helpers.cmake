# Helpers shared by the xpm-plan command-line tests (included by each xpm_plan_*_test.cmake).
# Each test runs as: cmake -DXPM_PLAN=<xpm-plan> -DWORK_DIR=<dir> -P <test>.cmake
cmake_minimum_required(VERSION 3.22)
foreach(var XPM_PLAN WORK_DIR)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "define ${var}")
  endif()
endforeach()

# xpm_plan_run(<expected exit code> <label> <args>...): runs xpm-plan, checks the exit code and
# sets OUT and ERR in the caller's scope. A non-zero expected code also requires stderr to be
# exactly one line starting "xpm-plan: error:".
function(xpm_plan_run expected label)
  execute_process(COMMAND "${XPM_PLAN}" ${ARGN}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc STREQUAL "${expected}")
    message(FATAL_ERROR "${label}: exit code ${rc}, expected ${expected}\nstdout: ${out}\nstderr: ${err}")
  endif()
  if(NOT expected EQUAL 0)
    string(REGEX REPLACE "\n$" "" line "${err}")
    if(line MATCHES "\n" OR NOT err MATCHES "\n$")
      message(FATAL_ERROR "${label}: stderr is not exactly one line: [${err}]")
    endif()
    if(NOT line MATCHES "^xpm-plan: error: ")
      message(FATAL_ERROR "${label}: stderr does not start with 'xpm-plan: error:': [${line}]")
    endif()
  endif()
  set(OUT "${out}" PARENT_SCOPE)
  set(ERR "${err}" PARENT_SCOPE)
endfunction()

# expect_match(<label> <text> <regex>)
function(expect_match label text pattern)
  if(NOT text MATCHES "${pattern}")
    message(FATAL_ERROR "${label}: [${text}] does not match '${pattern}'")
  endif()
endfunction()

# expect_between(<label> <value> <low> <high>): low <= value <= high, compared as doubles.
function(expect_between label value low high)
  if(NOT value MATCHES "^-?[0-9.]+([eE][-+]?[0-9]+)?$" OR value LESS low OR value GREATER high)
    message(FATAL_ERROR "${label}: ${value} is not in [${low}, ${high}]")
  endif()
endfunction()

# expect_no_temporaries(<label> <dir>): no "*.tmp*" file left by an atomic write.
function(expect_no_temporaries label dir)
  file(GLOB leftovers "${dir}/*.tmp*")
  if(leftovers)
    message(FATAL_ERROR "${label}: temporary files left behind: ${leftovers}")
  endif()
endfunction()

# expect_svg(<label> <file>): the file exists and is an SVG document.
function(expect_svg label file)
  if(NOT EXISTS "${file}")
    message(FATAL_ERROR "${label}: ${file} was not written")
  endif()
  file(READ "${file}" svg)
  if(NOT svg MATCHES "^(<\\?xml[^>]*>[ \t\r\n]*)?<svg[ >]")
    string(SUBSTRING "${svg}" 0 80 head)
    message(FATAL_ERROR "${label}: ${file} does not start with <?xml or <svg: [${head}]")
  endif()
  if(NOT svg MATCHES "</svg>[ \t\r\n]*$")
    message(FATAL_ERROR "${label}: ${file} does not end with </svg>")
  endif()
endfunction()

# write_test_model(<path>): a memory model with exact coefficients, so tests can compute every
# prediction by hand: bytes = max(1100000, 3*bs*l^2 + 50*bs*l + 1000000).
function(write_test_model path)
  file(WRITE "${path}" [=[
{
  "format_version": 1,
  "formula": {"text": "a*bs*l^2 + b*bs*l + c", "canonical": "a*bs*l^2 + b*bs*l + c",
              "coefficient_names": ["a", "b", "c"], "variable_names": ["bs", "l"]},
  "coefficients": {"a": 3, "b": 50, "c": 1000000},
  "floor_bytes": 1100000,
  "batch_size_variable": "bs",
  "aggregation": {"bs": "count", "l": "max"},
  "metadata": {
    "device": "cpu", "capacity_bytes": 4000000, "optimizer": "adamw",
    "fit": {"converged": true, "fitted_to": "forward_backward_peak_bytes", "max_rel_error": 0.001},
    "probes": [
      {"dims": [1, 16], "feasible": true, "forward_backward_peak_bytes": 1001568,
       "optimizer_step_peak_bytes": 1100000, "step_peak_bytes": 1100000},
      {"dims": [8, 128], "feasible": true, "forward_backward_peak_bytes": 1444416,
       "optimizer_step_peak_bytes": 1100000, "step_peak_bytes": 1444416},
      {"dims": [64, 256], "feasible": false, "forward_backward_peak_bytes": 0,
       "optimizer_step_peak_bytes": 0, "step_peak_bytes": 0, "error": "out of memory"}
    ]
  }
}
]=])
endfunction()

# model_bytes(<out var> <bs> <l>): the test model's prediction, integer math.
function(model_bytes out bs l)
  math(EXPR bytes "3 * ${bs} * ${l} * ${l} + 50 * ${bs} * ${l} + 1000000")
  if(bytes LESS 1100000)
    set(bytes 1100000)
  endif()
  set(${out} ${bytes} PARENT_SCOPE)
endfunction()
