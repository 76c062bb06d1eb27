# xpm-plan plan: microbatches with predicted bytes, counts and utilization (predicted / usable
# per microbatch, mean and min); 500 records of length 1 with 8 of the maximum length; an
# over-budget record exits with code 1; --figure writes an SVG; bad input exits with code 2.
include("${CMAKE_CURRENT_LIST_DIR}/xpm_plan_test_helpers.cmake")
set(dir "${WORK_DIR}/xpm_plan_plan_test")
file(REMOVE_RECURSE "${dir}")
file(MAKE_DIRECTORY "${dir}")
set(model "${dir}/model.json")
write_test_model("${model}")

# 20 records of length 128 under 1580000 usable bytes: two microbatches of 10, each predicted
# at 55552*10 + 1000000 = 1555520 bytes, utilization 1555520 / 1580000 = 0.98450...
set(records "${dir}/records.csv")
file(WRITE "${records}" "id,l\n")
foreach(i RANGE 1 20)
  file(APPEND "${records}" "${i},128\n")
endforeach()
set(figure "${dir}/plan.svg")
xpm_plan_run(0 "plan" plan --model "${model}" --csv "${records}" --capacity-bytes 1580000
             --memory-fraction 1 --sort-by l --json --figure "${figure}")
string(JSON count LENGTH "${OUT}" microbatches)
string(JSON n GET "${OUT}" microbatch_count)
if(NOT count EQUAL 2 OR NOT n EQUAL 2)
  message(FATAL_ERROR "plan gave ${count} microbatches, expected 2: ${OUT}")
endif()
foreach(i 0 1)
  string(JSON size GET "${OUT}" microbatches ${i} size)
  string(JSON predicted GET "${OUT}" microbatches ${i} predicted_bytes)
  string(JSON utilization GET "${OUT}" microbatches ${i} utilization)
  string(JSON over GET "${OUT}" microbatches ${i} over_budget)
  if(NOT size EQUAL 10 OR NOT predicted EQUAL 1555520 OR over)
    message(FATAL_ERROR "microbatch ${i}: size ${size}, predicted ${predicted}, over ${over}: ${OUT}")
  endif()
  expect_between("microbatch ${i} utilization" "${utilization}" 0.98450 0.98451)
endforeach()
string(JSON mean GET "${OUT}" mean_utilization)
string(JSON min GET "${OUT}" min_utilization)
expect_between("mean utilization" "${mean}" 0.98450 0.98451)
expect_between("min utilization" "${min}" 0.98450 0.98451)
string(JSON feasible GET "${OUT}" feasible)
string(JSON usable GET "${OUT}" usable_bytes)
if(NOT feasible OR NOT usable EQUAL 1580000)
  message(FATAL_ERROR "plan: feasible ${feasible}, usable ${usable}: ${OUT}")
endif()
expect_svg("plan --figure" "${figure}")
expect_no_temporaries("plan --figure" "${dir}")
# bs = 10 is beyond the largest probed bs (8): both microbatches say so.
string(JSON extrapolated GET "${OUT}" extrapolated_microbatches)
string(JSON variable GET "${OUT}" microbatches 0 extrapolation 0 variable)
string(JSON probed_max GET "${OUT}" microbatches 0 extrapolation 0 probed_max)
if(NOT extrapolated EQUAL 2 OR NOT variable STREQUAL "bs" OR NOT probed_max EQUAL 8)
  message(FATAL_ERROR "plan extrapolation: ${extrapolated} microbatches, ${variable} over ${probed_max}: ${OUT}")
endif()

# Text output names the utilization.
xpm_plan_run(0 "plan text" plan --model "${model}" "${records}" --capacity-bytes 1580000
             --memory-fraction 1)
expect_match("plan text" "${OUT}" "#1: size 10, bs=10 l=128, predicted 1555520 bytes, utilization 98[.]5 %; extrapolated: bs = 10 is 1[.]25x the largest probed bs [(]8[)]")
expect_match("plan text" "${OUT}" "utilization: mean 98[.]5 %, min 98[.]5 %")

# 500 records of length 1 and 8 of length 256 under 4000000 bytes. At l = 256 a microbatch
# holds 14 records (209408*bs + 1000000); sorted heaviest first, the 8 long records and 6 short
# ones share the first microbatch, the other 494 short ones (53*bs + 1000000) the second.
set(mixed "${dir}/mixed.txt")  # a plain list of lengths, one per line
file(WRITE "${mixed}" "")
foreach(i RANGE 1 500)
  file(APPEND "${mixed}" "1\n")
  if(i LESS_EQUAL 8)
    file(APPEND "${mixed}" "256\n")
  endif()
endforeach()
xpm_plan_run(0 "plan mixed" plan --model "${model}" --csv "${mixed}" --capacity-bytes 4000000
             --memory-fraction 1 --sort-by l --json)
string(JSON count LENGTH "${OUT}" microbatches)
string(JSON size0 GET "${OUT}" microbatches 0 size)
string(JSON size1 GET "${OUT}" microbatches 1 size)
string(JSON l0 GET "${OUT}" microbatches 0 dims l)
string(JSON records_n GET "${OUT}" records)
if(NOT count EQUAL 2 OR NOT size0 EQUAL 14 OR NOT size1 EQUAL 494 OR NOT l0 EQUAL 256
   OR NOT records_n EQUAL 508)
  message(FATAL_ERROR "mixed plan: ${count} microbatches (${size0} at l=${l0}, ${size1}) of ${records_n}: ${OUT}")
endif()
# The uniform packer sizes every microbatch for the longest record: ceil(508 / 14) = 37.
xpm_plan_run(0 "plan uniform" plan --model "${model}" --csv "${mixed}" --capacity-bytes 4000000
             --memory-fraction 1 --packer uniform --json)
string(JSON count LENGTH "${OUT}" microbatches)
string(JSON packer GET "${OUT}" packer)
if(NOT count EQUAL 37 OR NOT packer STREQUAL "uniform")
  message(FATAL_ERROR "uniform plan: ${count} microbatches (${packer}), expected 37")
endif()

# A record over budget even alone: the plan is printed, exit code 1, no figure.
file(WRITE "${dir}/long.csv" "l\n128\n1000\n64\n")
set(no_figure "${dir}/over.svg")
xpm_plan_run(1 "over budget" plan --model "${model}" --csv "${dir}/long.csv"
             --capacity-bytes 4000000 --memory-fraction 1 --json --figure "${no_figure}")
expect_match("over budget" "${ERR}" "1 of 3 records .* over the usable budget of 4000000 bytes even alone .*#1 \\(bs=1 l=1000\\)")
string(JSON feasible GET "${OUT}" feasible)
string(JSON over GET "${OUT}" over_budget_records 0)
if(feasible OR NOT over EQUAL 1)
  message(FATAL_ERROR "over budget --json: ${OUT}")
endif()
if(EXISTS "${no_figure}")
  message(FATAL_ERROR "over budget: the figure was written")
endif()

# Bad input: exit 2.
xpm_plan_run(0 "ffd packer" plan --model "${model}" --csv "${records}" --capacity-bytes 1580000 --packer ffd)
expect_match("ffd packer" "${OUT}" "packer ffd")
xpm_plan_run(2 "bad packer" plan --model "${model}" --csv "${records}" --capacity-bytes 1580000 --packer best-fit)
expect_match("bad packer" "${ERR}" "--packer must be 'adaptive', 'uniform', 'ffd' or 'fastest', got 'best-fit'")
xpm_plan_run(2 "fastest without a time model" plan --model "${model}" --csv "${records}" --capacity-bytes 1580000
             --packer fastest)
expect_match("fastest without a time model" "${ERR}"
             "^xpm-plan: error: --packer fastest: the model .*model[.]json has no time model \\(fitted to given")
xpm_plan_run(2 "bad sort-by" plan --model "${model}" --csv "${records}" --capacity-bytes 1580000 --sort-by len)
expect_match("bad sort-by" "${ERR}" "--sort-by: 'len' is not a variable")
xpm_plan_run(2 "sort-by uniform" plan --model "${model}" --csv "${records}" --capacity-bytes 1580000
             --packer uniform --sort-by l)
xpm_plan_run(2 "missing records file" plan --model "${model}" --csv "${dir}/none.csv" --capacity-bytes 1580000)
expect_match("missing records file" "${ERR}" "none[.]csv")
file(WRITE "${dir}/no_l.csv" "id,length\n1,5\n")
xpm_plan_run(2 "no length column" plan --model "${model}" --csv "${dir}/no_l.csv" --capacity-bytes 1580000)
expect_match("no length column" "${ERR}" "no_l[.]csv: no column 'l'")
xpm_plan_run(2 "budget" plan --model "${model}" --csv "${records}" --capacity-bytes 1000
             --extra-overhead-bytes 2000)
expect_match("budget" "${ERR}" "no usable bytes left")
