# xpm-plan fit --formula auto: no formula written; the formula is chosen from the measurements
# (two length variables here), reported with its candidates, saved and predicted back; the
# options that name coefficients are refused with it.
include("${CMAKE_CURRENT_LIST_DIR}/xpm_plan_test_helpers.cmake")
set(dir "${WORK_DIR}/xpm_plan_fit_auto_test")
file(REMOVE_RECURSE "${dir}")
file(MAKE_DIRECTORY "${dir}")

# peak = 30*bs*ls^2 + 20*bs*lt^2 + 10*bs*ls*lt + 2000000 at shapes that move ls and lt apart.
set(csv "${dir}/probes.csv")
file(WRITE "${csv}" "bs,ls,lt,peak\n")
foreach(bs 1 2 4 8)
  foreach(pair "64;48" "48;36" "32;24" "32;48" "64;24")
    list(GET pair 0 ls)
    list(GET pair 1 lt)
    math(EXPR peak "30*${bs}*${ls}*${ls} + 20*${bs}*${lt}*${lt} + 10*${bs}*${ls}*${lt} + 2000000")
    file(APPEND "${csv}" "${bs},${ls},${lt},${peak}\n")
  endforeach()
endforeach()

set(model "${dir}/model.json")
xpm_plan_run(0 "fit auto" fit "${csv}" --formula auto --variables bs,ls,lt --bytes-column peak
             --output "${model}" --json)
string(JSON usable GET "${OUT}" usable)
string(JSON selection GET "${OUT}" formula_selection)
string(JSON held_out GET "${OUT}" leave_one_out_max_rel_error)
if(NOT usable)
  message(FATAL_ERROR "fit auto: not usable: ${OUT}")
endif()
expect_match("fit auto selection" "${selection}" "formula chosen from the probes: .*bs\\*ls\\^2")
expect_between("fit auto held-out error" "${held_out}" 0 0.001)
# bs=3, ls=40, lt=30: 30*3*1600 + 20*3*900 + 10*3*1200 + 2000000 = 2234000.
xpm_plan_run(0 "predict auto" predict --model "${model}" --dims bs=3,ls=40,lt=30 --json)
string(JSON predicted GET "${OUT}" predicted_bytes 0)
expect_between("predict auto" "${predicted}" 2233000 2235000)
xpm_plan_run(0 "fit auto text" fit "${csv}" --formula auto --variables bs,ls,lt --bytes-column peak)
expect_match("fit auto text" "${OUT}" "candidates; ranked by root-mean-square held-out error")

xpm_plan_run(2 "auto in capitals" fit "${csv}" --formula AUTO --variables bs,ls,lt --bytes-column peak)
expect_match("auto in capitals" "${ERR}" "--formula 'AUTO' is a constant named AUTO; .* write --formula auto")

xpm_plan_run(2 "auto with --coefficients" fit "${csv}" --formula auto --coefficients a
             --variables bs,ls,lt --bytes-column peak)
expect_match("auto with --coefficients" "${ERR}" "--coefficients does not apply to --formula auto")

# A summed variable (--aggregation t=sum, real tokens): t grows with the records by itself, so
# the chosen formula has a t term, never bs*t. peak = 300*bs*l + 2000*t + 1000000, mixes of
# lengths (t below bs*l).
set(mixes "${dir}/mixes.csv")
file(WRITE "${mixes}" "bs,l,t,peak\n")
foreach(bs 1 2 4 8 16)
  foreach(l 32 64 96)
    foreach(fill 10 7 4)
      math(EXPR t "${bs} * ${l} * ${fill} / 10")
      if(t LESS l)
        set(t ${l})
      endif()
      math(EXPR peak "300*${bs}*${l} + 2000*${t} + 1000000")
      file(APPEND "${mixes}" "${bs},${l},${t},${peak}\n")
    endforeach()
  endforeach()
endforeach()
xpm_plan_run(0 "fit auto summed" fit "${mixes}" --formula auto --variables bs,l,t --aggregation t=sum
             --bytes-column peak --json)
string(JSON canonical GET "${OUT}" canonical)
if(NOT canonical STREQUAL "a1*bs*l + a2*t + c")
  message(FATAL_ERROR "fit auto summed: chose '${canonical}', expected 'a1*bs*l + a2*t + c'")
endif()
