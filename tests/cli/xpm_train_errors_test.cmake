# A LibTorch error reaches the user as one line saying where, exit code 3, and its full text
# (backtrace included) in the run folder's error.log. The error: a checkpoint's optimizer.pt
# that LibTorch reads but cannot restore (taken from a run with --weight-decay-groups, two
# parameter groups instead of one, and left out of the manifest so the checksums pass), on
# --resume, in one process and under --nproc 2 (every rank: one line, its own error log). A file
# LibTorch cannot read at all is skipped like any damaged checkpoint (xpm_train_resume_test).
# Run as: cmake -DXPM_TRAIN=<xpm-train> -DDATA_DIR=<data/brown> -DWORK_DIR=<dir> -P ...
cmake_minimum_required(VERSION 3.22)
include("${CMAKE_CURRENT_LIST_DIR}/cli_test_helpers.cmake")
if(NOT EXISTS "${DATA_DIR}/cats.txt")
  message(FATAL_ERROR "no corpus in ${DATA_DIR}: run tools/setup.sh (make test does)")
endif()
set(dir "${WORK_DIR}/xpm_train_errors_test")
file(REMOVE_RECURSE "${dir}")
set(common --data-dir "${DATA_DIR}" --max-steps 3 --outer-batch-size 8 --threads 1
           --memory-cap-factor 2.0 --max-validation-sentences 20 --checkpoint-every-steps 1
           --memory-model-cache "${WORK_DIR}/xpm_train_errors_test_cache" --quiet)

cli_expect_success("the stopped run" "${XPM_TRAIN}" ${common} --run-dir "${dir}/stopped" --stop-after-steps 2)
cli_expect_success("a run with two parameter groups" "${XPM_TRAIN}" ${common} --run-dir "${dir}/groups"
                   --stop-after-steps 2 --weight-decay-groups)

# remove_from_manifest(<checkpoint folder> <file>): the file's checksum no longer guards it.
function(remove_from_manifest checkpoint file)
  file(READ "${checkpoint}/manifest.json" manifest)
  string(JSON manifest REMOVE "${manifest}" files ${file})
  file(WRITE "${checkpoint}/manifest.json" "${manifest}")
endfunction()

# A model.pt LibTorch cannot read: the checkpoint is skipped with a warning, the run resumes
# from the one before.
file(COPY "${dir}/stopped/" DESTINATION "${dir}/fallback")
file(WRITE "${dir}/fallback/checkpoints/step-00000002/model.pt" "not a torch archive\n")
remove_from_manifest("${dir}/fallback/checkpoints/step-00000002" model.pt)
execute_process(COMMAND "${XPM_TRAIN}" ${common} --run-dir "${dir}/fallback" --resume
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 300)
if(NOT rc EQUAL 0 OR NOT err MATCHES "warning: checkpoint '[^']*step-00000002' skipped [^\n]*model.pt' cannot be read by LibTorch")
  message(FATAL_ERROR "unreadable model.pt: exit code ${rc}, expected 0 and a warning (stderr: ${err})")
endif()
file(READ "${dir}/fallback/summary.json" summary)
string(JSON resumed GET "${summary}" resumed_from_step)
if(NOT resumed EQUAL 1)
  message(FATAL_ERROR "unreadable model.pt: resumed from step ${resumed}, expected 1")
endif()

set(checkpoint "${dir}/stopped/checkpoints/step-00000002")
file(COPY_FILE "${dir}/groups/checkpoints/step-00000002/optimizer.pt" "${checkpoint}/optimizer.pt")
remove_from_manifest("${checkpoint}" optimizer.pt)
file(COPY "${dir}/stopped/" DESTINATION "${dir}/single")
file(COPY "${dir}/stopped/" DESTINATION "${dir}/pair")

# expect_error_log(<label> <file> <first line regex>): the log starts with the error's line and
# holds LibTorch's full text.
function(expect_error_log label file pattern)
  if(NOT EXISTS "${file}")
    message(FATAL_ERROR "${label}: no ${file}")
  endif()
  file(READ "${file}" log)
  if(NOT log MATCHES "^${pattern}\n" OR NOT log MATCHES "Exception raised from")
    message(FATAL_ERROR "${label}: ${file} lacks the error line or the full text: [${log}]")
  endif()
endfunction()

set(where "resume: restoring the optimizer from '[^']*/checkpoints/step-00000002/optimizer.pt': [^\n]+")
cli_expect_error("resume with an optimizer of another layout" 3 "^xpm-train: error: ${where}$"
                 "${XPM_TRAIN}" ${common} --run-dir "${dir}/single" --resume)
expect_error_log("resume with an optimizer of another layout" "${dir}/single/error.log"
                 "xpm-train: error: ${where}")

execute_process(COMMAND "${XPM_TRAIN}" ${common} --run-dir "${dir}/pair" --resume --nproc 2
                        --rendezvous-timeout-s 60 --collective-timeout-s 30
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 300)
if(NOT rc EQUAL 3)
  message(FATAL_ERROR "--nproc 2: exit code ${rc}, expected 3 (stderr: ${err})")
endif()
cli_expect_no_backtrace("--nproc 2" "${err}")
string(REGEX REPLACE "\n$" "" lines "${err}")
string(REPLACE "\n" ";" lines "${lines}")
foreach(line IN LISTS lines)
  if(NOT line MATCHES "^xpm-train: rank [01]( exited with code 3|: error: ${where})$")
    message(FATAL_ERROR "--nproc 2: unexpected stderr line [${line}] (stderr: ${err})")
  endif()
endforeach()
foreach(rank 0 1)
  if(NOT err MATCHES "xpm-train: rank ${rank}: error: ")
    message(FATAL_ERROR "--nproc 2: rank ${rank} printed no error line (stderr: ${err})")
  endif()
endforeach()
expect_error_log("--nproc 2, rank 0" "${dir}/pair/error.log" "xpm-train: rank 0: error: ${where}")
expect_error_log("--nproc 2, rank 1" "${dir}/pair/error-rank1.log" "xpm-train: rank 1: error: ${where}")
# Passed (a failed check above stops the script): its run folders are removed.
cli_remove_run_folders("${dir}")
