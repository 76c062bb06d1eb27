# Probes that ran out of memory are upper bounds, never dropped: `xpm-plan fit` uses them as
# lower bounds of the prediction (with the capacity they ran under) and stores them in the model;
# max-batch and plan never return a shape that reaches one; a bound the formula cannot meet makes
# the fit not usable (exit 1, no file).
# Run as: cmake -DXPM_PLAN=<xpm-plan> -DWORK_DIR=<dir> -P xpm_plan_infeasible_test.cmake
include("${CMAKE_CURRENT_LIST_DIR}/xpm_plan_test_helpers.cmake")
set(dir "${WORK_DIR}/xpm_plan_infeasible_test")
file(REMOVE_RECURSE "${dir}")
file(MAKE_DIRECTORY "${dir}")

# Truth 1000*bs*l + 2*bs*l^2 + 1e7, probed at small shapes where the quadratic term hides, and
# bs=32 l=512 out of memory under 40 MB (the truth there is 43.2 MB). A fit of a*bs*l + c on the
# feasible rows alone predicts about 28 MB there; with the bound it must reach 40 MB.
set(csv "bs,l,bytes,feasible,capacity_bytes\n")
foreach(bs 1 2 4)
  foreach(l 16 32 64)
    math(EXPR bytes "1000 * ${bs} * ${l} + 2 * ${bs} * ${l} * ${l} + 10000000")
    string(APPEND csv "${bs},${l},${bytes},1,\n")
  endforeach()
endforeach()
string(APPEND csv "32,512,,0,40000000\n")
file(WRITE "${dir}/probes.csv" "${csv}")
set(model "${dir}/model.json")
xpm_plan_run(0 "fit with an infeasible probe" fit --csv "${dir}/probes.csv" --variables bs,l
             --formula "a*bs*l + c" --bytes-column bytes --output "${model}" --json)
string(JSON bounds LENGTH "${OUT}" infeasible_bounds)
string(JSON satisfied GET "${OUT}" infeasible_bounds 0 satisfied)
string(JSON predicted GET "${OUT}" infeasible_bounds 0 predicted_bytes)
string(JSON exceeds GET "${OUT}" infeasible_bounds 0 exceeds_bytes)
if(NOT bounds EQUAL 1 OR NOT satisfied STREQUAL "ON" OR NOT exceeds EQUAL 40000000)
  message(FATAL_ERROR "fit with an infeasible probe: ${OUT}")
endif()
expect_between("prediction at the infeasible probe" "${predicted}" 40000000 40100000)
file(READ "${model}" saved)
string(JSON saved_l GET "${saved}" infeasible_probes 0 dims 1)
string(JSON saved_exceeds GET "${saved}" infeasible_probes 0 exceeds_bytes)
if(NOT saved_l EQUAL 512 OR NOT saved_exceeds EQUAL 40000000)
  message(FATAL_ERROR "saved model infeasible_probes: ${saved}")
endif()

# Text report: the bound and whether it holds.
xpm_plan_run(0 "fit text" fit --csv "${dir}/probes.csv" --variables bs,l --formula "a*bs*l + c"
             --bytes-column bytes)
expect_match("fit text" "${OUT}" "1 probes ran out of memory and were not fitted: +\\[bs=32 l=512\\]")
expect_match("fit text" "${OUT}" "bs=32 l=512: out of memory under 40000000 bytes, predicted [0-9]+: satisfied")
expect_match("fit text" "${OUT}" "1 infeasible-probe bound: all satisfied")
expect_match("fit text" "${OUT}" "Fit solved exactly on 9 points")

# Without a recorded capacity the probe is reported, not used; --probe-capacity-bytes supplies it.
string(REPLACE ",0,40000000\n" ",0,\n" no_capacity "${csv}")
file(WRITE "${dir}/no_capacity.csv" "${no_capacity}")
xpm_plan_run(0 "fit without capacity" fit --csv "${dir}/no_capacity.csv" --variables bs,l
             --formula "a*bs*l + c" --bytes-column bytes)
expect_match("fit without capacity" "${OUT}" "1 not used as bounds: the capacity they ran under is unknown")
xpm_plan_run(0 "fit --probe-capacity-bytes" fit --csv "${dir}/no_capacity.csv" --variables bs,l
             --formula "a*bs*l + c" --bytes-column bytes --probe-capacity-bytes 40000000 --json)
string(JSON satisfied GET "${OUT}" infeasible_bounds 0 satisfied)
if(NOT satisfied STREQUAL "ON")
  message(FATAL_ERROR "fit --probe-capacity-bytes: ${OUT}")
endif()

# A bound the formula cannot meet (a*bs*l is 0 at l = 0): not usable, exit 1, no file.
file(WRITE "${dir}/impossible.csv"
     "bs,l,bytes,feasible,capacity_bytes\n1,16,2000000,1,\n2,16,3000000,1,\n4,32,9000000,1,\n8,0,,0,5000000000\n")
set(never "${dir}/never.json")
xpm_plan_run(1 "violated bound" fit --csv "${dir}/impossible.csv" --variables bs,l
             --formula "a*bs*l" --bytes-column bytes --output "${never}")
expect_match("violated bound" "${ERR}" "not usable: .*ran out of memory at bs = 8, l = 0")
if(EXISTS "${never}")
  message(FATAL_ERROR "violated bound: ${never} was written")
endif()

# A model file that records bs=8 l=128 out of memory under 4 MB. The formula alone would allow
# 54 records of l = 128 in 4 MB; the probe caps it at 7, for l = 128 and longer records.
write_test_model("${dir}/base.json")
file(READ "${dir}/base.json" base)
string(JSON limited SET "${base}" infeasible_probes [=[[{"dims": [8, 128], "exceeds_bytes": 4000000}]]=])
file(WRITE "${dir}/limited.json" "${limited}")
xpm_plan_run(0 "max-batch below the probe" max-batch --model "${dir}/limited.json" --dims l=128
             --capacity-bytes 4000000 --memory-fraction 1 --json)
string(JSON m GET "${OUT}" max_microbatch_size)
if(NOT m EQUAL 7)
  message(FATAL_ERROR "max-batch below the probe: ${OUT}")
endif()
xpm_plan_run(0 "max-batch, shorter records" max-batch --model "${dir}/limited.json" --dims l=64
             --capacity-bytes 4000000 --memory-fraction 1 --json)
string(JSON m GET "${OUT}" max_microbatch_size)
if(NOT m GREATER 7)
  message(FATAL_ERROR "max-batch, shorter records: ${OUT}")
endif()
file(WRITE "${dir}/records.txt" "128\n128\n128\n128\n128\n128\n128\n128\n128\n128\n200\n200\n200\n200\n200\n")
xpm_plan_run(0 "plan below the probe" plan --model "${dir}/limited.json" --csv "${dir}/records.txt"
             --capacity-bytes 4000000 --memory-fraction 1 --json)
string(JSON count LENGTH "${OUT}" microbatches)
math(EXPR last "${count} - 1")
foreach(i RANGE ${last})
  string(JSON size GET "${OUT}" microbatches ${i} size)
  if(size GREATER 7)
    message(FATAL_ERROR "plan below the probe: microbatch ${i} has ${size} records: ${OUT}")
  endif()
endforeach()

# One record at l >= 256 reaches a probe of one record that ran out of memory: exit 1.
string(JSON one SET "${base}" infeasible_probes [=[[{"dims": [1, 256], "exceeds_bytes": 4000000}]]=])
file(WRITE "${dir}/one.json" "${one}")
xpm_plan_run(1 "one record out of memory" max-batch --model "${dir}/one.json" --dims l=300
             --capacity-bytes 4000000 --memory-fraction 1)
expect_match("one record out of memory" "${ERR}" "reaches a probe that ran out of memory at bs=1 l=256")

# show lists the plan limits.
xpm_plan_run(0 "show plan limits" show "${dir}/limited.json")
expect_match("show plan limits" "${OUT}" "plan limits .*\n  bs=8 l=128 under 4000000 bytes")
xpm_plan_run(0 "show plan limits json" show "${dir}/limited.json" --json)
string(JSON shown_l GET "${OUT}" infeasible_probes 0 dims l)
if(NOT shown_l EQUAL 128)
  message(FATAL_ERROR "show --json infeasible_probes: ${OUT}")
endif()
