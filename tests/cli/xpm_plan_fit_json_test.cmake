# xpm-plan fit reads JSON measurements — a list of objects, a memory model file's probes, probe
# output — keeps infeasible probes out of the fit but reports them, takes the floor from a
# column, writes an SVG figure, and rejects bad JSON with exit code 2 and no file written.
include("${CMAKE_CURRENT_LIST_DIR}/xpm_plan_test_helpers.cmake")
set(dir "${WORK_DIR}/xpm_plan_fit_json_test")
file(REMOVE_RECURSE "${dir}")
file(MAKE_DIRECTORY "${dir}")

# bytes = 3*bs*l^2 + 50*bs*l + 1000000 as a JSON list of objects (coefficients inferred).
set(list_json "[")
set(sep "")
foreach(bs 1 2 4 8)
  foreach(l 16 64 128 256)
    math(EXPR bytes "3 * ${bs} * ${l} * ${l} + 50 * ${bs} * ${l} + 1000000")
    string(APPEND list_json "${sep}{\"bs\": ${bs}, \"l\": ${l}, \"peak\": ${bytes}}")
    set(sep ",\n ")
  endforeach()
endforeach()
string(APPEND list_json ",\n {\"bs\": 64, \"l\": 256, \"feasible\": false}]\n")
file(WRITE "${dir}/list.json" "${list_json}")

set(model "${dir}/model.json")
set(figure "${dir}/fit.svg")
xpm_plan_run(0 "fit a JSON list" fit "${dir}/list.json" --formula "a*bs*l^2 + b*bs*l + c"
             --variables bs,l --bytes-column peak --output "${model}" --figure "${figure}" --json)
string(JSON a GET "${OUT}" coefficients a)
string(JSON b GET "${OUT}" coefficients b)
string(JSON c GET "${OUT}" coefficients c)
expect_between("a" "${a}" 2.999997 3.000003)
expect_between("b" "${b}" 49.99995 50.00005)
expect_between("c" "${c}" 999999 1000001)
string(JSON points GET "${OUT}" points)
string(JSON infeasible LENGTH "${OUT}" infeasible_probes)
string(JSON infeasible_l GET "${OUT}" infeasible_probes 0 l)
string(JSON unit GET "${OUT}" coefficient_units a)
string(JSON residuals LENGTH "${OUT}" residuals)
if(NOT points EQUAL 16 OR NOT infeasible EQUAL 1 OR NOT infeasible_l EQUAL 256
   OR NOT unit STREQUAL "bytes per bs*l^2" OR NOT residuals EQUAL 16)
  message(FATAL_ERROR "fit of a JSON list: ${OUT}")
endif()
expect_svg("fit --figure" "${figure}")
expect_no_temporaries("fit --figure" "${dir}")
file(READ "${model}" saved)
string(JSON saved_probes LENGTH "${saved}" metadata probes)
string(JSON fitted_to GET "${saved}" metadata fit fitted_to)
if(NOT saved_probes EQUAL 17 OR NOT fitted_to STREQUAL "peak")
  message(FATAL_ERROR "saved model: ${saved_probes} probes, fitted to ${fitted_to}")
endif()

# An unusable fit's JSON reasons name this tool's option, not the library's field (the formula
# leaves l out, and so do the variables: a variable no term uses is refused).
xpm_plan_run(1 "unusable fit, JSON" fit "${dir}/list.json" --formula "a*bs + c" --variables bs
             --bytes-column peak --json)
string(JSON reason GET "${OUT}" reasons 0)
if(NOT reason MATCHES "[(]--usable-max-rel-error[)]" OR reason MATCHES "FitOptions")
  message(FATAL_ERROR "unusable fit, JSON reasons: ${reason}")
endif()

# Text output: the brief report and the infeasible probe.
xpm_plan_run(0 "fit text" fit "${dir}/list.json" --formula "a*bs*l^2 + b*bs*l + c"
             --variables bs,l --bytes-column peak)
expect_match("fit text" "${OUT}" "Fit converged")
expect_match("fit text" "${OUT}" "1 probes ran out of memory and were not fitted: +\\[bs=64 l=256\\]")

# A memory model file's probes (variables named by the file), floor from a column.
set(model_file "${dir}/probes_model.json")
write_test_model("${model_file}")
xpm_plan_run(0 "fit a model file" fit "${model_file}" --formula "b*bs*l + c"
             --bytes-column forward_backward_peak_bytes --floor-column optimizer_step_peak_bytes --json)
string(JSON floor GET "${OUT}" floor_bytes)
string(JSON points GET "${OUT}" points)
string(JSON variables GET "${OUT}" variables)
if(NOT floor EQUAL 1100000 OR NOT points EQUAL 2)
  message(FATAL_ERROR "fit of a model file: floor ${floor}, ${points} points: ${OUT}")
endif()

# --above-floor-only: the probe at the floor (bs=1, l=16) is reported, not fitted.
xpm_plan_run(0 "fit above the floor" fit "${model_file}" --formula "a*bs*l^2 + 1000000"
             --bytes-column forward_backward_peak_bytes --floor-column optimizer_step_peak_bytes
             --above-floor-only --json)
string(JSON points GET "${OUT}" points)
string(JSON below LENGTH "${OUT}" below_floor_not_fitted)
string(JSON below_l GET "${OUT}" below_floor_not_fitted 0 l)
if(NOT points EQUAL 1 OR NOT below EQUAL 1 OR NOT below_l EQUAL 16)
  message(FATAL_ERROR "fit --above-floor-only: ${OUT}")
endif()
xpm_plan_run(2 "too few above the floor" fit "${model_file}" --formula "b*bs*l + c"
             --bytes-column forward_backward_peak_bytes --floor-column optimizer_step_peak_bytes
             --above-floor-only)
expect_match("too few above the floor" "${ERR}" "keeps 1 of 2 measurements .*fewer than the 2 coefficients")
xpm_plan_run(2 "above the floor without a floor" fit "${model_file}" --formula "b*bs*l + c"
             --bytes-column forward_backward_peak_bytes --above-floor-only)
expect_match("above the floor without a floor" "${ERR}" "--above-floor-only needs a floor")

# `xpm-plan probe --json` output: dims as lists in variable_names order.
file(WRITE "${dir}/probe_output.json" [=[
{"variable_names": ["bs", "l"], "static_bytes": 1000000, "capacity_bytes": 0, "probes": [
  {"dims": [1, 64], "feasible": true, "forward_backward_peak_bytes": 1015488, "step_peak_bytes": 1015488},
  {"dims": [4, 64], "feasible": true, "forward_backward_peak_bytes": 1061952, "step_peak_bytes": 1061952},
  {"dims": [4, 128], "feasible": true, "forward_backward_peak_bytes": 1222208, "step_peak_bytes": 1222208}]}
]=])
xpm_plan_run(0 "fit probe output" fit --measurements "${dir}/probe_output.json"
             --formula "a*bs*l^2 + b*bs*l + c" --bytes-column step_peak_bytes --json)
string(JSON a GET "${OUT}" coefficients a)
expect_between("probe output a" "${a}" 2.9999 3.0001)

# Bad JSON measurements: exit 2, one line naming the file and the entry, no model written.
set(bad_model "${dir}/bad_model.json")
function(expect_bad_json label pattern text)
  file(WRITE "${dir}/bad.json" "${text}")
  xpm_plan_run(2 "${label}" fit "${dir}/bad.json" --formula "a*bs*l^2 + b*bs*l + c"
               --variables bs,l --bytes-column peak --output "${bad_model}" --figure "${dir}/bad.svg")
  expect_match("${label}" "${ERR}" "${pattern}")
  if(EXISTS "${bad_model}" OR EXISTS "${dir}/bad.svg")
    message(FATAL_ERROR "${label}: a file was written")
  endif()
  expect_no_temporaries("${label}" "${dir}")
endfunction()
expect_bad_json("malformed JSON" "bad[.]json: not valid JSON" "[{\"bs\": 1, \"l\": 16, \"peak\": 1000}")
expect_bad_json("string bytes" "bad[.]json: \\[1\\][.]peak: expected a number, got \"big\""
                "[{\"bs\": 1, \"l\": 16, \"peak\": 2e6}, {\"bs\": 2, \"l\": 16, \"peak\": \"big\"}]")
expect_bad_json("missing bytes" "bad[.]json: \\[0\\]: no bytes field 'peak'"
                "[{\"bs\": 1, \"l\": 16, \"bytes\": 2e6}]")
expect_bad_json("missing variable" "bad[.]json: \\[0\\]: no variable 'l'"
                "[{\"bs\": 1, \"length\": 16, \"peak\": 2e6}]")
expect_bad_json("negative bytes" "\\[0\\][.]peak: bytes must be > 0"
                "[{\"bs\": 1, \"l\": 16, \"peak\": -5}]")
expect_bad_json("not a list" "expected a list of measurements" "{\"rows\": []}")
expect_bad_json("empty list" "is empty" "[]")
expect_bad_json("bad feasible" "feasible: expected true or false" "[{\"bs\": 1, \"l\": 16, \"peak\": 2e6, \"feasible\": \"maybe\"}]")
expect_bad_json("too few points" "3 coefficients"
                "[{\"bs\": 1, \"l\": 16, \"peak\": 2e6}, {\"bs\": 2, \"l\": 16, \"peak\": 3e6}]")

# Other bad options: exit 2.
xpm_plan_run(2 "bad formula" fit "${dir}/list.json" --formula "a*bs*zz + c" --variables bs,l
             --coefficients a,c --bytes-column peak)
expect_match("bad formula" "${ERR}" "--formula 'a[*]bs[*]zz [+] c': .*zz")
xpm_plan_run(2 "bad robust loss" fit "${dir}/list.json" --formula "a*bs*l^2 + c" --variables bs,l
             --bytes-column peak --robust-loss l1)
expect_match("bad robust loss" "${ERR}" "--robust-loss must be 'none', 'huber' or 'cauchy', got 'l1'")
xpm_plan_run(2 "floor twice" fit "${dir}/list.json" --formula "a*bs*l^2 + c" --variables bs,l
             --bytes-column peak --floor-bytes 5 --floor-column peak)
xpm_plan_run(2 "no measurements" fit --formula "a*bs*l^2 + c" --variables bs,l --bytes-column peak)
expect_match("no measurements" "${ERR}" "no measurements file")
