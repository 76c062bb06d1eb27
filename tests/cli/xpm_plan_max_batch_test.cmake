# xpm-plan max-batch: the largest microbatch size within the budget; exit code 1, with the
# predicted bytes and the budget in the message, when even one record does not fit.
include("${CMAKE_CURRENT_LIST_DIR}/xpm_plan_test_helpers.cmake")
set(dir "${WORK_DIR}/xpm_plan_max_batch_test")
file(REMOVE_RECURSE "${dir}")
file(MAKE_DIRECTORY "${dir}")
set(model "${dir}/model.json")
write_test_model("${model}")

# l = 128: bytes(bs) = 55552*bs + 1000000 (above the floor from bs = 2); 1580000 usable bytes
# hold 10 records (1555520), not 11 (1611072).
xpm_plan_run(0 "max-batch" max-batch --model "${model}" --dims l=128 --capacity-bytes 1580000
             --memory-fraction 1 --json)
string(JSON m GET "${OUT}" max_microbatch_size)
string(JSON predicted GET "${OUT}" predicted_bytes)
string(JSON usable GET "${OUT}" usable_bytes)
string(JSON feasible GET "${OUT}" feasible)
if(NOT m EQUAL 10 OR NOT predicted EQUAL 1555520 OR NOT usable EQUAL 1580000 OR NOT feasible)
  message(FATAL_ERROR "max-batch: ${OUT}")
endif()
string(JSON utilization GET "${OUT}" utilization)
expect_between("max-batch utilization" "${utilization}" 0.98450 0.98451)
# The probes went up to bs = 8: bs = 10 is an extrapolation.
string(JSON beyond GET "${OUT}" extrapolation 0 description)
expect_match("max-batch extrapolation" "${beyond}" "bs = 10 is 1[.]25x the largest probed bs [(]8[)]")

# memory fraction and extra overhead: 2000000 * 0.9 - 220000 = 1580000, same answer.
xpm_plan_run(0 "max-batch with overhead" max-batch --model "${model}" --dims l=128
             --capacity-bytes 2000000 --memory-fraction 0.9 --extra-overhead-bytes 220000)
expect_match("max-batch text" "${OUT}" "max microbatch size 10 at bs=10 l=128: predicted 1555520 of 1580000 usable bytes.*; extrapolated: bs = 10 is 1[.]25x the largest probed bs [(]8[)]")

# A budget below one record of bs 1 (1055552 bytes at l = 128; the floor is 1100000): exit 1.
xpm_plan_run(1 "budget below one record" max-batch --model "${model}" --dims l=128
             --capacity-bytes 1000000 --memory-fraction 1)
expect_match("budget below one record" "${ERR}"
             "even a microbatch of 1 record at bs=1 l=128 is predicted at 1100000 bytes .*over the usable budget of 1000000 bytes")
xpm_plan_run(1 "budget below one record, json" max-batch --model "${model}" --dims l=128
             --capacity-bytes 1000000 --memory-fraction 1 --json)
string(JSON feasible GET "${OUT}" feasible)
string(JSON m GET "${OUT}" max_microbatch_size)
string(JSON predicted GET "${OUT}" predicted_bytes)
if(feasible OR NOT m EQUAL 0 OR NOT predicted EQUAL 1100000)
  message(FATAL_ERROR "infeasible max-batch --json: ${OUT}")
endif()

# Bad input: exit 2.
xpm_plan_run(2 "bs in dims" max-batch --model "${model}" --dims bs=2,l=128 --capacity-bytes 1580000)
expect_match("bs in dims" "${ERR}" "'bs' is the batch-size variable")
xpm_plan_run(2 "missing dim" max-batch --model "${model}" --capacity-bytes 1580000)
expect_match("missing dim" "${ERR}" "'l'")
xpm_plan_run(2 "bad fraction" max-batch --model "${model}" --dims l=128 --capacity-bytes 1580000
             --memory-fraction 1.5)
expect_match("bad fraction" "${ERR}" "--memory-fraction must be in \\(0, 1\\], got 1.5")
xpm_plan_run(2 "zero capacity" max-batch --model "${model}" --dims l=128 --capacity-bytes 0)
expect_match("zero capacity" "${ERR}" "--capacity-bytes must be > 0, got 0")
xpm_plan_run(2 "no capacity" max-batch --model "${model}" --dims l=128)
expect_match("no capacity" "${ERR}" "capacity-bytes")
xpm_plan_run(2 "bad dim value" max-batch --model "${model}" --dims l=abc --capacity-bytes 1580000)
expect_match("bad dim value" "${ERR}" "--dims l: 'abc' is not a finite number")
