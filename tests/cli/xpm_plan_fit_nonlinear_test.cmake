# xpm-plan fit with formulas the linear fit cannot take: max(...), a fitted exponent with
# --nonlinear and --initial; a robust loss against an outlier; a fit that is not usable (its
# prediction decreases as bs grows) exits with code 1 and writes no file.
include("${CMAKE_CURRENT_LIST_DIR}/xpm_plan_test_helpers.cmake")
set(dir "${WORK_DIR}/xpm_plan_fit_nonlinear_test")
file(REMOVE_RECURSE "${dir}")
file(MAKE_DIRECTORY "${dir}")

# bytes = max(3*bs*l^2, 400*bs*l) + 1000000: the linear term wins below l = 133, the quadratic
# one above. peak_p = 200*bs*l^1.5 + 1000000 (l = 16, 64, 144, 256 are squares).
set(csv "${dir}/probes.csv")
file(WRITE "${csv}" "bs,l,peak_max,peak_p\n")
foreach(bs 1 2 4 8)
  foreach(pair "16;64" "64;512" "144;1728" "256;4096")
    list(GET pair 0 l)
    list(GET pair 1 l_to_1_5)
    math(EXPR quadratic "3 * ${bs} * ${l} * ${l}")
    math(EXPR linear "400 * ${bs} * ${l}")
    if(quadratic GREATER linear)
      math(EXPR peak_max "${quadratic} + 1000000")
    else()
      math(EXPR peak_max "${linear} + 1000000")
    endif()
    math(EXPR peak_p "200 * ${bs} * ${l_to_1_5} + 1000000")
    file(APPEND "${csv}" "${bs},${l},${peak_max},${peak_p}\n")
  endforeach()
endforeach()

# max(...): fitted by the non-linear fit from the given start, saved, predicted back.
set(model "${dir}/max_model.json")
xpm_plan_run(0 "fit max()" fit "${csv}" --formula "max(a*bs*l^2, b*bs*l) + c" --variables bs,l
             --bytes-column peak_max --initial a=1,b=100,c=1e6 --output "${model}" --json)
string(JSON a GET "${OUT}" coefficients a)
string(JSON b GET "${OUT}" coefficients b)
string(JSON c GET "${OUT}" coefficients c)
string(JSON usable GET "${OUT}" usable)
string(JSON linear GET "${OUT}" linear)
expect_between("max() a" "${a}" 2.999 3.001)
expect_between("max() b" "${b}" 399.9 400.1)
expect_between("max() c" "${c}" 999000 1001000)
if(NOT usable OR linear)
  message(FATAL_ERROR "fit max(): usable ${usable}, linear ${linear}: ${OUT}")
endif()
# bs=2, l=100: max(60000, 80000) + 1000000 = 1080000.
xpm_plan_run(0 "predict max()" predict --model "${model}" --dims bs=2,l=100 --json)
string(JSON predicted GET "${OUT}" predicted_bytes 0)
expect_between("predict max()" "${predicted}" 1079000 1081000)
xpm_plan_run(0 "show max()" show "${model}")
expect_match("show max()" "${OUT}" "canonical +max\\(")

# A fitted exponent needs --nonlinear.
xpm_plan_run(2 "exponent without --nonlinear" fit "${csv}" --formula "a*bs*l^p + c"
             --variables bs,l --bytes-column peak_p)
expect_match("exponent without --nonlinear" "${ERR}" "symbol 'p'.*--nonlinear allows it")
xpm_plan_run(0 "fit l^p" fit "${csv}" --formula "a*bs*l^p + c" --variables bs,l
             --bytes-column peak_p --nonlinear --initial p=1.2,a=100,c=1e6 --json)
string(JSON p GET "${OUT}" coefficients p)
string(JSON a GET "${OUT}" coefficients a)
expect_between("exponent p" "${p}" 1.4999 1.5001)
expect_between("l^p a" "${a}" 199.9 200.1)
xpm_plan_run(2 "--initial on a linear formula" fit "${csv}" --formula "a*bs*l^2 + c"
             --variables bs,l --bytes-column peak_p --initial a=1)
expect_match("--initial on a linear formula" "${ERR}" "--initial applies to non-linear formulas")
xpm_plan_run(2 "--initial names no coefficient" fit "${csv}" --formula "max(a*bs*l^2, b*bs*l) + c"
             --variables bs,l --bytes-column peak_max --initial q=1)
expect_match("--initial names no coefficient" "${ERR}" "'q' is not a coefficient")

# A robust loss keeps one outlier (x1.5 at bs=4, l=128) from pulling the fit.
set(outlier "${dir}/outlier.csv")
file(WRITE "${outlier}" "bs,l,peak\n")
foreach(bs 1 2 4 8)
  foreach(l 16 64 128 256)
    math(EXPR bytes "3 * ${bs} * ${l} * ${l} + 50 * ${bs} * ${l} + 1000000")
    if(bs EQUAL 4 AND l EQUAL 128)
      math(EXPR bytes "${bytes} * 3 / 2")
    endif()
    file(APPEND "${outlier}" "${bs},${l},${bytes}\n")
  endforeach()
endforeach()
xpm_plan_run(0 "huber" fit "${outlier}" --formula "a*bs*l^2 + b*bs*l + c" --variables bs,l
             --bytes-column peak --robust-loss huber --usable-max-rel-error 0.6 --json)
string(JSON a GET "${OUT}" coefficients a)
string(JSON loss GET "${OUT}" robust_loss)
expect_between("huber a" "${a}" 2.95 3.05)
if(NOT loss STREQUAL "huber")
  message(FATAL_ERROR "robust_loss ${loss}, expected huber")
endif()
# Without raising the limit, the outlier's 33 % error makes the fit not usable: exit 1.
xpm_plan_run(1 "outlier not usable" fit "${outlier}" --formula "a*bs*l^2 + b*bs*l + c"
             --variables bs,l --bytes-column peak --robust-loss huber --output "${dir}/no.json")
expect_match("outlier not usable" "${ERR}" "the fit is not usable: max relative error [0-9.]+ % at line 12 [(]bs = 4, l = 128[)]")

# A prediction that decreases as bs grows (negative coefficient allowed): not usable, exit 1.
set(decreasing "${dir}/decreasing.csv")
file(WRITE "${decreasing}" "bs,l,peak\n")
foreach(bs 1 2 4 8)
  foreach(l 16 64)
    math(EXPR bytes "2000000 - 1000 * ${bs} * ${l}")
    file(APPEND "${decreasing}" "${bs},${l},${bytes}\n")
  endforeach()
endforeach()
xpm_plan_run(1 "decreasing in bs" fit "${decreasing}" --formula "a*bs*l + c" --variables bs,l
             --bytes-column peak --allow-negative --output "${dir}/no.json" --figure "${dir}/no.svg")
expect_match("decreasing in bs" "${ERR}" "not usable: the prediction decreases as bs grows")
if(EXISTS "${dir}/no.json" OR EXISTS "${dir}/no.svg")
  message(FATAL_ERROR "a fit that is not usable wrote a file")
endif()
expect_no_temporaries("not usable" "${dir}")

# Identifiability: every probe at one l cannot separate a*bs*l^2 from b*bs*l (exit 2).
file(WRITE "${dir}/one_l.csv" "bs,l,peak\n1,64,1015488\n2,64,1030976\n4,64,1061952\n8,64,1123904\n")
xpm_plan_run(2 "unidentifiable" fit "${dir}/one_l.csv" --formula "a*bs*l^2 + b*bs*l + c"
             --variables bs,l --bytes-column peak)
expect_match("unidentifiable" "${ERR}" "one_l[.]csv: .*cannot be separated")

# A floor and a quadratic piece that wins at 3 of 12 shapes: without one of the three, the
# piece's three coefficients rest on two shapes, so those refits give no held-out figure; the
# fit is usable (exit 0), and the report says what each rests on and needs.
set(floored "${dir}/floored.csv")
file(WRITE "${floored}" "bs,l,peak\n")
foreach(shape "1;16" "2;16" "4;16" "1;32" "2;32" "4;32" "1;64" "2;64" "4;64" "16;128" "4;256" "8;512")
  list(GET shape 0 bs)
  list(GET shape 1 l)
  math(EXPR piece "100 * ${bs} * ${l} * ${l} + 20000 * ${bs} * ${l} + 40000000")
  if(piece LESS 60000000)
    set(piece 60000000)
  endif()
  file(APPEND "${floored}" "${bs},${l},${piece}\n")
endforeach()
xpm_plan_run(0 "floor with 3 shapes above" fit "${floored}" --formula "max(f, a*bs*l^2 + b*bs*l + c)"
             --variables bs,l --bytes-column peak --json)
string(JSON usable GET "${OUT}" usable)
string(JSON undetermined LENGTH "${OUT}" held_out_undetermined)
string(JSON note GET "${OUT}" held_out_note)
if(NOT usable OR NOT undetermined EQUAL 3)
  message(FATAL_ERROR "floor with 3 shapes above: usable ${usable}, ${undetermined} shapes without a figure: ${OUT}")
endif()
expect_match("floor with 3 shapes above" "${note}"
             "no held-out figure at 3 of 12 shapes: without line 11 [(]bs = 16, l = 128[)] the fit rests on 2 other shapes where a, b and c act and needs 3")

# A plateau of the forward/backward peaks above the floor column (small shapes peak at one
# shape-independent moment of backward, 1.2 MB, above the optimizer step's 1.005 MB): with
# --above-floor-only the plateau is tried as the floor, as training does, and kept because its
# fit misses the step peaks least; the shapes on it (within 1 %) are not fitted.
set(plateau "${dir}/plateau.csv")
file(WRITE "${plateau}" "bs,l,fb,opt\n")
foreach(shape "1;4" "2;8" "4;16" "8;32" "16;32" "8;64" "16;64" "32;64" "4;64" "32;32")
  list(GET shape 0 bs)
  list(GET shape 1 l)
  math(EXPR fb "1000000 + 10 * ${bs} * ${l} * ${l} + 1000 * ${bs} * ${l}")
  math(EXPR on_plateau "1200000 + ${bs} * ${l}")
  if(fb LESS on_plateau)
    set(fb ${on_plateau})
  endif()
  file(APPEND "${plateau}" "${bs},${l},${fb},1005000\n")
endforeach()
xpm_plan_run(0 "plateau floor" fit "${plateau}" --formula "a*bs*l^2 + b*bs*l + c" --variables bs,l
             --bytes-column fb --floor-column opt --above-floor-only --json)
string(JSON floor GET "${OUT}" floor_bytes)
string(JSON floor_report GET "${OUT}" floor_report)
string(JSON below LENGTH "${OUT}" below_floor_not_fitted)
string(JSON a GET "${OUT}" coefficients a)
string(JSON b GET "${OUT}" coefficients b)
if(NOT floor EQUAL 1200004 OR NOT below EQUAL 3)
  message(FATAL_ERROR "plateau floor: floor ${floor}, ${below} not fitted (expected 1200004 and 3): ${OUT}")
endif()
expect_between("plateau a" "${a}" 9.999 10.001)
expect_between("plateau b" "${b}" 999.9 1000.1)
string(JSON on_plateau GET "${OUT}" below_floor_sources 0)
if(NOT on_plateau STREQUAL "line 2")
  message(FATAL_ERROR "plateau floor: the first measurement not fitted is from ${on_plateau}, expected line 2")
endif()
expect_match("plateau floor" "${floor_report}" "the plateau of the forward/backward peaks, 1200004 bytes [(]3 probes within 1 % of the smallest")
# --floor-model constant keeps the floor column's largest value: no plateau.
xpm_plan_run(1 "constant floor, no plateau" fit "${plateau}" --formula "a*bs*l^2 + b*bs*l + c" --variables bs,l
             --bytes-column fb --floor-column opt --floor-model constant --above-floor-only --json)
string(JSON floor GET "${OUT}" floor_bytes)
if(NOT floor EQUAL 1005000)
  message(FATAL_ERROR "constant floor: floor ${floor}, expected the column's 1005000: ${OUT}")
endif()
