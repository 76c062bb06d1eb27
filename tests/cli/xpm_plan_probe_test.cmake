# xpm-plan probe on the real corpus: two small probe points under a memory cap write the
# measurements CSV (bs,l,forward_backward_peak_bytes,optimizer_step_peak_bytes,step_peak_bytes,
# feasible) and JSON that `xpm-plan fit` reads; bad input exits with code 2.
# Run as: cmake -DXPM_PLAN=<xpm-plan> -DWORK_DIR=<dir> -DDATA_DIR=<data/brown> -P ...
include("${CMAKE_CURRENT_LIST_DIR}/xpm_plan_test_helpers.cmake")
if(NOT EXISTS "${DATA_DIR}/cats.txt")
  message(FATAL_ERROR "no corpus in ${DATA_DIR}: run tools/setup.sh (make test does)")
endif()
set(dir "${WORK_DIR}/xpm_plan_probe_test")
file(REMOVE_RECURSE "${dir}")
file(MAKE_DIRECTORY "${dir}")

set(csv "${dir}/probes.csv")
xpm_plan_run(0 "probe" probe --data-dir "${DATA_DIR}" --probe-points 2x16,4x32
             --memory-cap-factor 4 --output "${csv}" --json)
string(JSON n LENGTH "${OUT}" probes)
string(JSON static GET "${OUT}" static_bytes)
string(JSON capacity GET "${OUT}" capacity_bytes)
string(JSON bs1 GET "${OUT}" probes 1 dims 0)
string(JSON l1 GET "${OUT}" probes 1 dims 1)
string(JSON feasible1 GET "${OUT}" probes 1 feasible)
string(JSON fb1 GET "${OUT}" probes 1 forward_backward_peak_bytes)
string(JSON opt1 GET "${OUT}" probes 1 optimizer_step_peak_bytes)
string(JSON step1 GET "${OUT}" probes 1 step_peak_bytes)
string(JSON fb0 GET "${OUT}" probes 0 forward_backward_peak_bytes)
if(NOT n EQUAL 2 OR NOT bs1 EQUAL 4 OR NOT l1 EQUAL 32 OR NOT feasible1)
  message(FATAL_ERROR "probe --json: ${OUT}")
endif()
if(static LESS_EQUAL 0 OR capacity LESS static OR fb1 LESS_EQUAL fb0 OR step1 LESS fb1
   OR step1 LESS opt1 OR opt1 LESS static)
  message(FATAL_ERROR "probe peaks out of order (static ${static}, cap ${capacity}, "
                      "fb ${fb0} -> ${fb1}, opt ${opt1}, step ${step1}): ${OUT}")
endif()

file(STRINGS "${csv}" lines)
list(LENGTH lines rows)
list(GET lines 0 header)
if(NOT rows EQUAL 3 OR NOT header STREQUAL
   "bs,l,forward_backward_peak_bytes,optimizer_step_peak_bytes,step_peak_bytes,feasible")
  message(FATAL_ERROR "probe CSV: ${rows} lines, header [${header}]")
endif()
list(GET lines 2 row)
expect_match("probe CSV row" "${row}" "^4,32,[0-9]+,[0-9]+,[0-9]+,true$")
expect_no_temporaries("probe" "${dir}")

# The measurements feed fit: the CSV (variables given) and the JSON (variables named by it).
file(WRITE "${dir}/probes.json" "${OUT}")
xpm_plan_run(0 "fit probe CSV" fit "${csv}" --formula "b*bs*l + c" --variables bs,l
             --bytes-column forward_backward_peak_bytes --json)
xpm_plan_run(0 "fit probe JSON" fit "${dir}/probes.json" --formula "b*bs*l + c"
             --bytes-column forward_backward_peak_bytes --floor-column optimizer_step_peak_bytes
             --output "${dir}/model.json" --json)
string(JSON floor GET "${OUT}" floor_bytes)
if(NOT floor EQUAL opt1)
  message(FATAL_ERROR "fit of probe JSON: floor ${floor}, expected ${opt1}")
endif()

# --grid: bs = 1, 2 times l = 90, 180 (the longest sentence is 180 tokens).
xpm_plan_run(0 "probe --grid" probe --data-dir "${DATA_DIR}" --grid --grid-max-bs 2 --grid-lengths 2 --json)
string(JSON n LENGTH "${OUT}" probes)
string(JSON max_length GET "${OUT}" max_length)
string(JSON l3 GET "${OUT}" probes 3 dims 1)
string(JSON bs3 GET "${OUT}" probes 3 dims 0)
if(NOT n EQUAL 4 OR NOT max_length EQUAL 180 OR NOT l3 EQUAL 180 OR NOT bs3 EQUAL 2)
  message(FATAL_ERROR "probe --grid: ${OUT}")
endif()

# A cap barely above the static memory: every probe runs out of memory, exit 1, no file.
xpm_plan_run(1 "every probe out of memory" probe --data-dir "${DATA_DIR}" --probe-points 2x16
             --memory-cap-factor 1.01 --output "${dir}/oom.csv")
expect_match("every probe out of memory" "${ERR}" "every probe ran out of memory")
expect_match("every probe out of memory" "${OUT}" "NO \\(out of memory\\)")
if(EXISTS "${dir}/oom.csv")
  message(FATAL_ERROR "every probe out of memory: the CSV was written")
endif()

# Bad input: exit 2, nothing written.
xpm_plan_run(2 "bad probe point" probe --data-dir "${DATA_DIR}" --probe-points 8y64 --output "${dir}/bad.csv")
expect_match("bad probe point" "${ERR}" "'8y64' is not of the form BSxL")
xpm_plan_run(2 "cuda device" probe --data-dir "${DATA_DIR}" --probe-points 2x16 --device cuda)
expect_match("cuda device" "${ERR}" "--device 'cuda': ")
xpm_plan_run(2 "no corpus" probe --data-dir "${dir}/nowhere" --probe-points 2x16)
expect_match("no corpus" "${ERR}" "nowhere' has no cats.txt")
xpm_plan_run(2 "bad cap factor" probe --data-dir "${DATA_DIR}" --probe-points 2x16 --memory-cap-factor 0.5)
expect_match("bad cap factor" "${ERR}" "probe: --memory-cap-factor must be 0")
xpm_plan_run(2 "points and grid" probe --data-dir "${DATA_DIR}" --probe-points 2x16 --grid)
if(EXISTS "${dir}/bad.csv")
  message(FATAL_ERROR "bad probe point: the CSV was written")
endif()
