# xpm-plan rejects bad input with exit code 2, one line on stderr starting "xpm-plan: error:",
# nothing on stdout and no model file written.
# Run as: cmake -DXPM_PLAN=<xpm-plan> -DWORK_DIR=<dir> -P xpm_plan_bad_csv_test.cmake
include("${CMAKE_CURRENT_LIST_DIR}/xpm_plan_test_helpers.cmake")
set(dir "${WORK_DIR}/xpm_plan_bad_csv_test")
file(REMOVE_RECURSE "${dir}")
file(MAKE_DIRECTORY "${dir}")
set(model "${dir}/model.json")

# expect_input_error(<label> <regex the stderr line must match> <xpm-plan args>...)
function(expect_input_error label pattern)
  xpm_plan_run(2 "${label}" ${ARGN})  # exit 2, one stderr line "xpm-plan: error: ..."
  set(out "${OUT}")
  string(REGEX REPLACE "\n$" "" line "${ERR}")
  if(NOT line MATCHES "${pattern}")
    message(FATAL_ERROR "${label}: stderr [${line}] does not match '${pattern}'")
  endif()
  if(NOT out STREQUAL "")
    message(FATAL_ERROR "${label}: unexpected stdout: [${out}]")
  endif()
  if(EXISTS "${model}")
    message(FATAL_ERROR "${label}: ${model} was written")
  endif()
  file(GLOB leftovers "${dir}/*.tmp*")
  if(leftovers)
    message(FATAL_ERROR "${label}: temporary files left behind: ${leftovers}")
  endif()
endfunction()

set(fit_args --formula "a*bs*l^2 + b*bs*l + c" --coefficients a,b,c --variables bs,l
             --bytes-column bytes --output "${model}" --json)

# A non-numeric cell on line 4 (header is line 1).
set(bad "${dir}/bad_cell.csv")
file(WRITE "${bad}" "bs,l,bytes\n1,16,1000768\n2,64,1030000\n4,128,abc\n8,256,2600000\n")
expect_input_error("non-numeric cell" "line 4, column 'bytes': 'abc'" fit --csv "${bad}" ${fit_args})

# A capacity cell on a row that ran (not out of memory) is checked too: no cell is ignored.
set(bad_capacity "${dir}/bad_capacity.csv")
file(WRITE "${bad_capacity}" "bs,l,bytes,feasible,capacity_bytes\n1,16,1000768,1,\n2,64,1030000,1,abc\n4,128,1200000,1,\n8,256,2600000,1,\n")
expect_input_error("capacity cell of a feasible row" "line 3, column 'capacity_bytes': 'abc'" fit --csv "${bad_capacity}" ${fit_args})

# A row with a missing cell.
set(short "${dir}/short_row.csv")
file(WRITE "${short}" "bs,l,bytes\n1,16,1000768\n2,64\n4,128,1200000\n8,256,2600000\n")
expect_input_error("short row" "line 3 has 2 cells" fit --csv "${short}" ${fit_args})

# A column the options name but the file lacks.
set(no_bytes "${dir}/no_bytes.csv")
file(WRITE "${no_bytes}" "bs,l,peak\n1,16,1000768\n2,64,1030000\n4,128,1200000\n")
expect_input_error("missing column" "no column 'bytes'" fit --csv "${no_bytes}" ${fit_args})

# Zero bytes.
set(zero "${dir}/zero_bytes.csv")
file(WRITE "${zero}" "bs,l,bytes\n1,16,1000768\n2,64,0\n4,128,1200000\n8,256,2600000\n")
expect_input_error("zero bytes" "line 3" fit --csv "${zero}" ${fit_args})

# A file that does not exist, a bad formula, an unknown option, an unknown command.
expect_input_error("missing file" "missing[.]csv" fit --csv "${dir}/missing.csv" ${fit_args})
set(good "${dir}/good.csv")
file(WRITE "${good}" "bs,l,bytes\n1,16,1000768\n2,64,1030000\n4,128,1200000\n8,256,2600000\n")
expect_input_error("bad formula" "zz" fit --csv "${good}" --formula "a*bs*zz + b + c"
                   --coefficients a,b,c --variables bs,l --bytes-column bytes --output "${model}")
expect_input_error("unknown option" "--frobnicate" fit --csv "${good}" ${fit_args} --frobnicate)
expect_input_error("unknown command" "unknown command 'fitt'" fitt --csv "${good}")
expect_input_error("missing required option" "bytes-column" fit --csv "${good}"
                   --formula "a*bs" --coefficients a --variables bs)

# A name of the formula that is a column of the file but not in --variables: a variable left out,
# not a coefficient to fit (unless --coefficients declares it).
set(heads "${dir}/heads.csv")
file(WRITE "${heads}" "bs,l,h,bytes\n1,16,8,1000768\n2,64,8,1030000\n4,128,8,1200000\n8,256,8,2600000\n")
expect_input_error("column fitted as a coefficient"
                   "'h' is a column of .*heads[.]csv but not one of --variables, so it would be fitted as a coefficient"
                   fit --csv "${heads}" --formula "h*bs*l + c" --variables bs,l --bytes-column bytes
                   --output "${model}")
expect_input_error("empty formula" "--formula is empty: give a cost formula in bytes"
                   fit --csv "${heads}" --formula " " --variables bs,l --bytes-column bytes --output "${model}")

# Files a fit would write that lose something: the measurements file itself, one file for the
# model and the figure, an empty name. The measurements file is left as it was.
set(keep "${dir}/keep.csv")
file(WRITE "${keep}" "bs,l,bytes,opt\n1,16,1000768,900000\n2,64,1030000,900000\n4,128,1200000,900000\n8,256,2600000,900000\n")
set(keep_args --formula "a*bs*l^2 + b*bs*l + c" --variables bs,l --bytes-column bytes)
expect_input_error("output is the input" "--output '.*keep[.]csv' is the measurements file: writing it would lose it"
                   fit "${keep}" ${keep_args} --output "${dir}/./keep.csv")
file(READ "${keep}" kept)
if(NOT kept MATCHES "^bs,l,bytes,opt")
  message(FATAL_ERROR "output is the input: the measurements file was overwritten: ${kept}")
endif()
expect_input_error("model and figure in one file" "--output and --figure name one file"
                   fit "${keep}" ${keep_args} --output "${model}" --figure "${model}")
# Options that would be ignored or misread, refused in one line.
expect_input_error("auto with spaces" "is a constant named  auto ; for a formula chosen"
                   fit "${keep}" --formula " auto " --variables bs,l --bytes-column bytes)
expect_input_error("aggregation twice" "--aggregation: l is given twice"
                   fit "${keep}" ${keep_args} --aggregation l=sum --aggregation l=max)
expect_input_error("robust scale without a loss" "--robust-scale applies to a robust loss only"
                   fit "${keep}" ${keep_args} --robust-scale 0.05)
expect_input_error("a variable as a coefficient" "--coefficients: 'l' is a variable"
                   fit "${keep}" ${keep_args} --coefficients a,b,l)
expect_input_error("a variable no term uses" "--variables: 'opt' does not appear in --formula"
                   fit "${keep}" --formula "a*bs*l + c" --variables bs,l,opt --bytes-column bytes)
expect_input_error("a floor formula that does not parse" "--floor-formula 'f [+]'"
                   fit "${keep}" ${keep_args} --floor-column opt --floor-formula "f +")
expect_input_error("an unknown floor model" "^xpm-plan: error: --floor-model must be"
                   fit "${keep}" ${keep_args} --floor-column opt --floor-model bogus)
expect_input_error("a directory" "'.*' is a directory, not a file" fit "${dir}" ${keep_args})

# A byte-order mark before the header (spreadsheets write one) is not part of the first column.
set(bom "${dir}/bom.csv")
string(ASCII 239 187 191 mark)
file(WRITE "${bom}" "${mark}bs,l,bytes\n1,16,1000768\n2,64,1030000\n4,128,1200000\n8,256,2600000\n")
xpm_plan_run(0 "byte-order mark" fit "${bom}" --formula "a*bs*l^2 + b*bs*l + c" --variables bs,l --bytes-column bytes)
expect_input_error("unbalanced formula" "--formula 'max[(]': formula error at column 4"
                   fit "${keep}" --formula "max(" --variables bs,l --bytes-column bytes)
