# xpm-plan show: prints a model file — formula, canonical form, coefficients with units, floor,
# metadata and the probes with the prediction at each — as text or JSON; bad files exit 2.
include("${CMAKE_CURRENT_LIST_DIR}/xpm_plan_test_helpers.cmake")
set(dir "${WORK_DIR}/xpm_plan_show_test")
file(REMOVE_RECURSE "${dir}")
file(MAKE_DIRECTORY "${dir}")
set(model "${dir}/model.json")
write_test_model("${model}")

xpm_plan_run(0 "show" show "${model}")
foreach(pattern
    "canonical +a[*]bs[*]l\\^2 [+] b[*]bs[*]l [+] c\n"
    "a = 3 bytes per bs[*]l\\^2\n"
    "b = 50 bytes per bs[*]l\n"
    "c = 1000000 bytes\n"
    "floor +1100000 bytes"
    "device +cpu"
    "probes +3 \\(1 out of memory\\)"
    "1 +16 +1001568 +1100000 +1100000 +1100000 +[+]0[.]0000% +yes"
    "8 +128 +1444416 +1100000 +1444416 +1444416 +[+]0[.]0000% +yes"
    "64 +256 +- +- +- +14402112 +> cap +NO \\(out of memory\\)")
  expect_match("show text" "${OUT}" "${pattern}")
endforeach()

# A phase xpm.probe fitted apart (metadata.phases): one line each, its coefficients and error.
file(READ "${model}" text)
string(JSON text SET "${text}" metadata phases
       [=[{"without_gradients": {"coefficients": {"a": 2.5, "b": 40, "c": 900000}, "single_record_factor": 1.0,
          "max_rel_error": 0.0041, "fitted_points": 9}}]=])
file(WRITE "${dir}/phased.json" "${text}")
xpm_plan_run(0 "show phased" show "${dir}/phased.json")
expect_match("show phases" "${OUT}"
             "phases +without_gradients: a = 2[.]5, b = 40, c = 900000 bytes [(]max error [+]0[.]41 % over 9 shapes[)]\n")

xpm_plan_run(0 "show --json" show --model "${model}" --json)
string(JSON canonical GET "${OUT}" canonical)
string(JSON name0 GET "${OUT}" coefficients 0 name)
string(JSON value0 GET "${OUT}" coefficients 0 value)
string(JSON unit0 GET "${OUT}" coefficients 0 unit)
string(JSON unit2 GET "${OUT}" coefficients 2 unit)
string(JSON floor GET "${OUT}" floor_bytes)
string(JSON device GET "${OUT}" metadata device)
string(JSON probes LENGTH "${OUT}" probes)
string(JSON predicted1 GET "${OUT}" probes 1 predicted_bytes)
string(JSON l1 GET "${OUT}" probes 1 dims l)
string(JSON feasible2 GET "${OUT}" probes 2 feasible)
if(NOT canonical STREQUAL "a*bs*l^2 + b*bs*l + c" OR NOT name0 STREQUAL "a" OR NOT value0 EQUAL 3
   OR NOT unit0 STREQUAL "bytes per bs*l^2" OR NOT unit2 STREQUAL "bytes" OR NOT floor EQUAL 1100000
   OR NOT device STREQUAL "cpu" OR NOT probes EQUAL 3 OR NOT predicted1 EQUAL 1444416
   OR NOT l1 EQUAL 128 OR feasible2)
  message(FATAL_ERROR "show --json: ${OUT}")
endif()
string(JSON in_metadata ERROR_VARIABLE none GET "${OUT}" metadata probes)
if(NOT none)
  message(FATAL_ERROR "show --json: probes repeated under metadata")
endif()

# Bad files: exit 2, naming the file and the field.
xpm_plan_run(2 "missing file" show "${dir}/none.json")
expect_match("missing file" "${ERR}" "none[.]json")
file(WRITE "${dir}/not_json.json" "{ this is not JSON")
xpm_plan_run(2 "not JSON" show "${dir}/not_json.json")
expect_match("not JSON" "${ERR}" "not_json[.]json.*not valid JSON")
file(READ "${model}" text)
string(REPLACE "\"b\": 50," "\"b\": \"fifty\"," text "${text}")
file(WRITE "${dir}/bad_coefficient.json" "${text}")
xpm_plan_run(2 "bad coefficient" show "${dir}/bad_coefficient.json")
expect_match("bad coefficient" "${ERR}" "bad_coefficient[.]json.*coefficients[.]b")
