# xpm-plan fit on a small CSV generated from known coefficients: the --json output recovers them,
# the saved model answers max-batch and plan as computed by hand.
# Run as: cmake -DXPM_PLAN=<xpm-plan> -DWORK_DIR=<dir> -P xpm_plan_fit_test.cmake
cmake_minimum_required(VERSION 3.22)
foreach(var XPM_PLAN WORK_DIR)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "define ${var}")
  endif()
endforeach()
set(dir "${WORK_DIR}/xpm_plan_fit_test")
file(REMOVE_RECURSE "${dir}")
file(MAKE_DIRECTORY "${dir}")

# bytes = a*bs*l^2 + b*bs*l + c with a = 3, b = 50, c = 1000000; an extra column is ignored.
set(csv "${dir}/probes.csv")
file(WRITE "${csv}" "bs,l,note,peak_bytes\n")
foreach(bs 1 2 4 8)
  foreach(l 16 64 128 256)
    math(EXPR bytes "3 * ${bs} * ${l} * ${l} + 50 * ${bs} * ${l} + 1000000")
    file(APPEND "${csv}" "${bs},${l},probe,${bytes}\n")
  endforeach()
endforeach()

set(model "${dir}/model.json")
execute_process(
  COMMAND "${XPM_PLAN}" fit --csv "${csv}" --formula "a*bs*l^2 + b*bs*l + c"
          --coefficients a,b,c --variables bs,l --bytes-column peak_bytes
          --output "${model}" --json
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "xpm-plan fit failed (${rc}): ${err}")
endif()

# Each coefficient within 1e-6 relative of its true value (CMake compares doubles in if()).
function(expect_coefficient json_text name low high)
  string(JSON value GET "${json_text}" coefficients ${name})
  if(value LESS low OR value GREATER high)
    message(FATAL_ERROR "coefficient ${name} = ${value}, expected in [${low}, ${high}]")
  endif()
endfunction()
expect_coefficient("${out}" a 2.999997 3.000003)
expect_coefficient("${out}" b 49.99995 50.00005)
expect_coefficient("${out}" c 999999 1000001)

string(JSON max_rel GET "${out}" max_rel_error)
if(NOT max_rel LESS 0.000001)
  message(FATAL_ERROR "max_rel_error = ${max_rel}, expected < 1e-6")
endif()
string(JSON converged GET "${out}" converged)
if(NOT converged)
  message(FATAL_ERROR "fit did not converge: ${out}")
endif()
string(JSON canonical GET "${out}" canonical)
if(canonical STREQUAL "")
  message(FATAL_ERROR "no canonical formula in ${out}")
endif()

# The model was saved atomically: model.json and no temporary file next to it.
if(NOT EXISTS "${model}")
  message(FATAL_ERROR "--output did not write ${model}")
endif()
file(GLOB leftovers "${dir}/*.tmp*")
if(leftovers)
  message(FATAL_ERROR "temporary files left behind: ${leftovers}")
endif()

# max-batch at l = 128: cost(bs) = 55552*bs + 1000000; 1580000 bytes hold 10, not 11.
execute_process(
  COMMAND "${XPM_PLAN}" max-batch --model "${model}" --dims l=128 --capacity-bytes 1580000
          --memory-fraction 1 --json
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "xpm-plan max-batch failed (${rc}): ${err}")
endif()
string(JSON m GET "${out}" max_microbatch_size)
if(NOT m EQUAL 10)
  message(FATAL_ERROR "max-batch gave ${m}, expected 10: ${out}")
endif()

# plan: 20 records of length 128 under the same budget -> two microbatches of 10.
set(records "${dir}/records.csv")
file(WRITE "${records}" "id,l\n")
foreach(i RANGE 1 20)
  file(APPEND "${records}" "${i},128\n")
endforeach()
execute_process(
  COMMAND "${XPM_PLAN}" plan --model "${model}" --csv "${records}" --capacity-bytes 1580000
          --memory-fraction 1 --sort-by l --json
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "xpm-plan plan failed (${rc}): ${err}")
endif()
string(JSON count LENGTH "${out}" microbatches)
string(JSON size0 GET "${out}" microbatches 0 size)
string(JSON size1 GET "${out}" microbatches 1 size)
if(NOT count EQUAL 2 OR NOT size0 EQUAL 10 OR NOT size1 EQUAL 10)
  message(FATAL_ERROR "plan gave ${count} microbatches (${size0}, ${size1}), expected 10 + 10: ${out}")
endif()
