# xpm-train --config FILE: an unknown key and a bad value (also one only the job's checks
# refuse) are errors naming the key and the file (exit code 2); the command line overrides the file; examples/default.ini runs (2 steps).
# Run as: cmake -DXPM_TRAIN=<xpm-train> -DDATA_DIR=<data/brown> -DEXAMPLE=<examples/default.ini>
#               -DWORK_DIR=<dir> -P ...
cmake_minimum_required(VERSION 3.22)
include("${CMAKE_CURRENT_LIST_DIR}/cli_test_helpers.cmake")
if(NOT EXISTS "${DATA_DIR}/cats.txt")
  message(FATAL_ERROR "no corpus in ${DATA_DIR}: run tools/setup.sh (make test does)")
endif()
set(dir "${WORK_DIR}/xpm_train_config_test")
file(REMOVE_RECURSE "${dir}")
file(MAKE_DIRECTORY "${dir}")

function(expect_error ini_text expected)
  file(WRITE "${dir}/bad.ini" "${ini_text}")
  execute_process(COMMAND "${XPM_TRAIN}" --config "${dir}/bad.ini" --data-dir "${DATA_DIR}"
                          --run-dir "${dir}/bad-run" --quiet
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 2)
    message(FATAL_ERROR "config '${ini_text}': exit code ${rc}, expected 2: ${err}")
  endif()
  foreach(part "${dir}/bad.ini" ${expected})
    string(FIND "${err}" "${part}" at)
    if(at EQUAL -1)
      message(FATAL_ERROR "config '${ini_text}': error does not name '${part}': ${err}")
    endif()
  endforeach()
endfunction()

expect_error("max-steps = 2\nmax-stpes = 3\n" "max-stpes")              # unknown key
expect_error("outer-batch-size = sixteen\n" "outer-batch-size;sixteen")  # not a number
expect_error("[train]\nepochs = 1\n" "train.epochs")                     # sections are not options

# Values the option parser accepts but the config refuses: named as the option, and as the
# file's key when the file set them.
expect_error("validation-mode = lower\n" "--validation-mode must be;key 'validation-mode'")
expect_error("precision = bf17\n" "--precision;bf17;key 'precision'")
expect_error("sharding = full_shard\n" "--sharding;full_shard;key 'sharding'")
# The same bad value on the command line is the command line's: the file is not blamed.
file(WRITE "${dir}/good.ini" "max-steps = 2\n")
execute_process(COMMAND "${XPM_TRAIN}" --config "${dir}/good.ini" --data-dir "${DATA_DIR}" --sharding nope
                        --quiet RESULT_VARIABLE rc ERROR_VARIABLE err)
string(FIND "${err}" "--sharding" at)
string(FIND "${err}" "good.ini" blamed)
if(NOT rc EQUAL 2 OR at EQUAL -1 OR NOT blamed EQUAL -1)
  message(FATAL_ERROR "--sharding nope with a good file: exit ${rc}: ${err}")
endif()

# A missing file.
execute_process(COMMAND "${XPM_TRAIN}" --config "${dir}/none.ini" RESULT_VARIABLE rc ERROR_VARIABLE err)
string(FIND "${err}" "none.ini" at)
if(NOT rc EQUAL 2 OR at EQUAL -1)
  message(FATAL_ERROR "missing config file: exit ${rc}: ${err}")
endif()

# The example file, with the command line overriding it: 2 steps instead of 2 epochs, its own
# run folder, a 100-sentence validation. Values only the file sets show up in config.json.
set(run "${dir}/example-run")
execute_process(COMMAND "${XPM_TRAIN}" --config "${EXAMPLE}" --data-dir "${DATA_DIR}" --run-dir "${run}"
                        --max-steps 2 --outer-batch-size 16 --max-validation-sentences 100 --quiet
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "xpm-train --config ${EXAMPLE} exited with ${rc}: ${err}")
endif()
file(READ "${run}/config.json" config)
string(JSON max_steps GET "${config}" max_steps)
string(JSON outer GET "${config}" outer_batch_size)
string(JSON patience GET "${config}" early_stopping_patience)
string(JSON checkpoint_every GET "${config}" checkpoint_every_steps)
string(JSON metric GET "${config}" validation_metric)
if(NOT max_steps EQUAL 2 OR NOT outer EQUAL 16)
  message(FATAL_ERROR "command line did not override the file: max_steps ${max_steps}, outer ${outer}")
endif()
if(NOT patience EQUAL 3 OR NOT checkpoint_every EQUAL 200 OR NOT metric STREQUAL "token_accuracy")
  message(FATAL_ERROR "file values lost: patience ${patience}, checkpoint every ${checkpoint_every}, "
                      "metric ${metric}")
endif()
file(READ "${run}/summary.json" summary)
string(JSON steps GET "${summary}" train_steps)
if(NOT steps EQUAL 2)
  message(FATAL_ERROR "train_steps ${steps}, expected 2")
endif()
# Passed (a failed check above stops the script): its run folders are removed.
cli_remove_run_folders("${dir}")
