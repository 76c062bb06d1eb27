# Exact resume through the program (CPU, --threads 1): run A trains 6 steps without a break;
# run B stops after step 4 (--stop-after-steps, same schedule) and is resumed (--resume) to
# step 6: final_parameters.pt must be the same bytes. Then B's newest checkpoint is corrupted
# (10 bytes of model.pt overwritten) in a copy of the stopped B, which is then resumed: the
# resume warns, naming the checkpoint, falls back to the previous one (step 3) and still ends
# with A's bytes.
# Run as: cmake -DXPM_TRAIN=<xpm-train> -DDATA_DIR=<data/brown> -DWORK_DIR=<dir> -P ...
cmake_minimum_required(VERSION 3.22)
include("${CMAKE_CURRENT_LIST_DIR}/cli_test_helpers.cmake")
if(NOT EXISTS "${DATA_DIR}/cats.txt")
  message(FATAL_ERROR "no corpus in ${DATA_DIR}: run tools/setup.sh (make test does)")
endif()
set(dir "${WORK_DIR}/xpm_train_resume_test")
file(REMOVE_RECURSE "${dir}")
set(common --data-dir "${DATA_DIR}" --max-steps 6 --outer-batch-size 16 --threads 1
           --memory-cap-factor 2.0 --max-validation-sentences 100 --validate-every 3
           --checkpoint-every-steps 2 --warmup-steps 2 --memory-model-cache "${dir}/cache" --quiet)

function(train run_dir)
  execute_process(COMMAND "${XPM_TRAIN}" ${common} --run-dir "${dir}/${run_dir}" ${ARGN}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "xpm-train --run-dir ${run_dir} ${ARGN} exited with ${rc}: ${err}")
  endif()
  set(last_stderr "${err}" PARENT_SCOPE)
endfunction()

function(expect_same_parameters run_dir)
  file(SHA256 "${dir}/a/final_parameters.pt" a)
  file(SHA256 "${dir}/${run_dir}/final_parameters.pt" b)
  if(NOT a STREQUAL b)
    message(FATAL_ERROR "${run_dir}/final_parameters.pt differs from the uninterrupted run's")
  endif()
endfunction()

train(a)
train(b --stop-after-steps 4)
if(EXISTS "${dir}/b/final_parameters.pt")
  message(FATAL_ERROR "a run stopped by --stop-after-steps wrote final_parameters.pt")
endif()
file(COPY "${dir}/b/" DESTINATION "${dir}/c")  # the stopped run, for the corruption case
train(b --resume)
expect_same_parameters(b)
file(READ "${dir}/b/summary.json" summary)
string(JSON resumed GET "${summary}" resumed_from_step)
string(JSON steps GET "${summary}" train_steps)
if(NOT resumed EQUAL 4 OR NOT steps EQUAL 6)
  message(FATAL_ERROR "resumed_from_step ${resumed}, train_steps ${steps}; expected 4 and 6")
endif()
file(STRINGS "${dir}/b/metrics.jsonl" lines_b)
file(STRINGS "${dir}/a/metrics.jsonl" lines_a)
list(LENGTH lines_a count_a)
list(LENGTH lines_b count_b)
if(NOT count_a EQUAL count_b)
  message(FATAL_ERROR "metrics.jsonl: ${count_b} lines after the resume, ${count_a} uninterrupted")
endif()

# Corrupt the newest checkpoint of the stopped copy (step 4): 10 bytes in the middle of model.pt.
set(newest "${dir}/c/checkpoints/step-00000004")
file(SIZE "${newest}/model.pt" size)
math(EXPR middle "${size} / 2")
execute_process(COMMAND sh -c "printf XPMCORRUPT | dd of='${newest}/model.pt' bs=1 seek=${middle} conv=notrunc"
                RESULT_VARIABLE rc ERROR_QUIET)
file(SIZE "${newest}/model.pt" size_after)
if(NOT rc EQUAL 0 OR NOT size EQUAL size_after)
  message(FATAL_ERROR "could not overwrite bytes of ${newest}/model.pt (${rc})")
endif()
train(c --resume)
foreach(part "warning" "step-00000004")
  string(FIND "${last_stderr}" "${part}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "resume past a corrupt checkpoint did not warn with '${part}': ${last_stderr}")
  endif()
endforeach()
file(READ "${dir}/c/summary.json" summary)
string(JSON resumed GET "${summary}" resumed_from_step)
# B's checkpoints: step 2, step 3 (the first validation, a new best, is checkpointed and marked
# best), step 4; the newest 2 are kept (3 and 4), so the one before the corrupt step 4 is step 3.
if(NOT resumed EQUAL 3)
  message(FATAL_ERROR "resumed from step ${resumed} past the corrupt step-4 checkpoint, expected 3")
endif()
expect_same_parameters(c)
# Passed (a failed check above stops the script): its run folders are removed.
cli_remove_run_folders("${dir}")
