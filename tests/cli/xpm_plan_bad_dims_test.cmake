# xpm-plan fit, predict, plan and max-batch reject negative, zero batch sizes, non-finite or
# non-numeric dims with exit code 2 and one stderr line naming the verb, the file, the line
# (1-based, header included) and the column (or the JSON entry and variable); nothing on stdout,
# no file written.
# Run as: cmake -DXPM_PLAN=<xpm-plan> -DWORK_DIR=<dir> -P xpm_plan_bad_dims_test.cmake
include("${CMAKE_CURRENT_LIST_DIR}/xpm_plan_test_helpers.cmake")
set(dir "${WORK_DIR}/xpm_plan_bad_dims_test")
file(REMOVE_RECURSE "${dir}")
file(MAKE_DIRECTORY "${dir}")
set(model "${dir}/model.json")
write_test_model("${model}")
set(output "${dir}/fitted.json")

# expect_bad_dims(<label> <regex the stderr line must match> <xpm-plan args>...)
function(expect_bad_dims label pattern)
  xpm_plan_run(2 "${label}" ${ARGN})  # exit 2, one stderr line "xpm-plan: error: ..."
  string(REGEX REPLACE "\n$" "" line "${ERR}")
  if(NOT line MATCHES "${pattern}")
    message(FATAL_ERROR "${label}: stderr [${line}] does not match '${pattern}'")
  endif()
  if(NOT OUT STREQUAL "")
    message(FATAL_ERROR "${label}: unexpected stdout: [${OUT}]")
  endif()
  if(EXISTS "${output}")
    message(FATAL_ERROR "${label}: ${output} was written")
  endif()
endfunction()

# predict --csv: the example of the documentation, then zero, infinite and non-numeric cells.
file(WRITE "${dir}/data.csv" "bs,l\n1,16\n2,-4\n")
expect_bad_dims("negative l" [[^xpm-plan: error: predict: .*data[.]csv line 3, column l: -4 is negative; dims must be >= 0$]]
                predict --model "${model}" --csv "${dir}/data.csv" --json)
file(WRITE "${dir}/zero_bs.csv" "l,bs\n\n16,1\n64,0\n")
expect_bad_dims("zero bs" "predict: .*zero_bs[.]csv line 4, column bs: 0 is not a valid bs: the batch-size variable counts records and must be > 0"
                predict --model "${model}" --csv "${dir}/zero_bs.csv")
file(WRITE "${dir}/inf.csv" "bs,l\n1,inf\n")
expect_bad_dims("infinite l" "predict: .*inf[.]csv line 2, column l: inf is not finite"
                predict --model "${model}" --csv "${dir}/inf.csv")
file(WRITE "${dir}/nan.csv" "bs,l\nnan,16\n")
expect_bad_dims("nan bs" "predict: .*nan[.]csv line 2, column bs: nan is not finite"
                predict --model "${model}" --csv "${dir}/nan.csv")
file(WRITE "${dir}/text.csv" "bs,l,note\n1,16,ok\n2,long,ok\n")
expect_bad_dims("text l" "predict: .*text[.]csv line 3, column l: 'long' is not a number"
                predict --model "${model}" --csv "${dir}/text.csv")
expect_bad_dims("negative --dims" "predict: --dims l: -4 is negative; dims must be >= 0"
                predict --model "${model}" --dims bs=1,l=-4)
expect_bad_dims("zero bs --dims" "predict: --dims bs: 0 is not a valid bs"
                predict --model "${model}" --dims bs=0,l=16)
expect_bad_dims("trailing comma --dims" "--dims: empty item in 'bs=8,l=120,'"
                predict --model "${model}" --dims "bs=8,l=120,")

# max-batch --dims.
expect_bad_dims("max-batch negative" "max-batch: --dims l: -1 is negative"
                max-batch --model "${model}" --dims l=-1 --capacity-bytes 4000000)

# plan: a CSV of records and a plain list of lengths (line numbers are the file's).
file(WRITE "${dir}/records.csv" "l\n16\n32\n-8\n")
expect_bad_dims("plan csv" "plan: .*records[.]csv line 4, column l: -8 is negative"
                plan --model "${model}" --csv "${dir}/records.csv" --capacity-bytes 4000000)
file(WRITE "${dir}/lengths.txt" "16\n-8\n32\n")
expect_bad_dims("plan list" "plan: .*lengths[.]txt line 2, column l: -8 is negative"
                plan --model "${model}" --csv "${dir}/lengths.txt" --capacity-bytes 4000000)

# fit: CSV and JSON measurements; the batch-size variable must be > 0, other dims >= 0.
set(fit_args --formula "a*bs*l + c" --bytes-column bytes --output "${output}")
file(WRITE "${dir}/fit.csv" "bs,l,bytes\n1,16,1000000\n-2,64,1100000\n4,128,1200000\n")
expect_bad_dims("fit csv" "fit: .*fit[.]csv line 3, column bs: -2 is negative"
                fit --csv "${dir}/fit.csv" --variables bs,l ${fit_args})
file(WRITE "${dir}/fit_zero.csv" "bs,l,bytes,feasible\n1,16,1000000,1\n2,64,1100000,1\n0,128,,0\n")
expect_bad_dims("fit csv zero bs, infeasible row" "fit: .*fit_zero[.]csv line 4, column bs: 0 is not a valid bs"
                fit --csv "${dir}/fit_zero.csv" --variables bs,l ${fit_args})
file(WRITE "${dir}/fit.json"
     "[{\"bs\": 1, \"l\": 16, \"bytes\": 1000000}, {\"bs\": 2, \"l\": -64, \"bytes\": 1100000}]")
expect_bad_dims("fit json" "fit: .*fit[.]json: \\[1\\], variable l: -64 is negative; dims must be >= 0"
                fit "${dir}/fit.json" --variables bs,l ${fit_args})
file(WRITE "${dir}/fit_probes.json"
     "{\"variable_names\": [\"bs\", \"l\"], \"probes\": [{\"dims\": [0, 16], \"bytes\": 1000000}]}")
expect_bad_dims("fit probes json" "fit: .*fit_probes[.]json: probes\\[0\\], variable bs: 0 is not a valid bs"
                fit "${dir}/fit_probes.json" ${fit_args})

# Zero is a valid length: l = 0 predicts the constant terms.
xpm_plan_run(0 "zero l" predict --model "${model}" --dims bs=1,l=0 --json)
expect_match("zero l" "${OUT}" "\"predicted_bytes\":\\[1100000\\]")
