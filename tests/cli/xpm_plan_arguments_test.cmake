# xpm-plan ignores no argument: a stray word after each verb (and after --help) exits with code 2
# and one line naming it and what the verb takes; the same command lines without it succeed.
# Run as: cmake -DXPM_PLAN=<xpm-plan> -DWORK_DIR=<dir> -P ...
include("${CMAKE_CURRENT_LIST_DIR}/xpm_plan_test_helpers.cmake")
include("${CMAKE_CURRENT_LIST_DIR}/cli_test_helpers.cmake")
set(dir "${WORK_DIR}/xpm_plan_arguments_test")
file(REMOVE_RECURSE "${dir}")
file(MAKE_DIRECTORY "${dir}")
set(model "${dir}/model.json")
write_test_model("${model}")
file(WRITE "${dir}/points.csv" "bs,l\n1,16\n8,128\n")
file(WRITE "${dir}/records.csv" "l\n16\n128\n")
file(WRITE "${dir}/probes.csv" "bs,l,bytes\n1,16,1001568\n2,16,1003136\n1,32,1004672\n4,64,1061952\n8,128,1444416\n")

# expect_stray(<verb> <what the verb takes> <args>...): `xpm-plan <verb> <args>... garbage` is
# refused naming 'garbage'; `xpm-plan <verb> <args>...` succeeds.
function(expect_stray verb takes)
  cli_expect_error("${verb} with a stray word" 2
                   "^xpm-plan: error: unexpected argument 'garbage' \\(${verb} ${takes}; see xpm-plan ${verb} --help\\)$"
                   "${XPM_PLAN}" ${verb} ${ARGN} garbage)
  cli_expect_success("${verb} without it" "${XPM_PLAN}" ${verb} ${ARGN})
endfunction()

set(one "takes one positional argument, its")
expect_stray(show "${one} --model" "${model}")
expect_stray(show "${one} --model" --model "${model}")
expect_stray(predict "${one} --csv" --model "${model}" --csv "${dir}/points.csv")
expect_stray(predict "${one} --csv" --model "${model}" "${dir}/points.csv")
expect_stray(max-batch "takes no positional arguments" --model "${model}" --dims l=128
             --capacity-bytes 4000000)
expect_stray(plan "${one} --csv" --model "${model}" --csv "${dir}/records.csv" --capacity-bytes 4000000)
expect_stray(fit "${one} --measurements" "${dir}/probes.csv" --formula "a*bs*l^2 + b*bs*l + c" --variables bs,l
             --bytes-column bytes)
# probe needs LibTorch and the corpus to succeed; its command line is refused before either.
cli_expect_error("probe with a stray word" 2
                 "^xpm-plan: error: unexpected argument 'garbage' \\(probe takes no positional arguments; see xpm-plan probe --help\\)$"
                 "${XPM_PLAN}" probe --probe-points 8x64 garbage)
cli_expect_error("--help with a stray word" 2 "^xpm-plan: error: unexpected argument 'garbage' \\(xpm-plan --help takes none; "
                 "${XPM_PLAN}" --help garbage)
cli_expect_success("--help" "${XPM_PLAN}" --help)
