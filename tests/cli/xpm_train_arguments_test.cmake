# xpm-train ignores no argument: a stray word (before or after options, under --nproc too), a
# value given to the switch --resume (on the command line or in the config file) and a stray
# word after `report RUN_DIR` exit with code 2 and one line naming it, and write no run folder.
# A correct command line (--resume followed by options, -q) still trains.
# Run as: cmake -DXPM_TRAIN=<xpm-train> -DDATA_DIR=<data/brown> -DWORK_DIR=<dir> -P ...
cmake_minimum_required(VERSION 3.22)
include("${CMAKE_CURRENT_LIST_DIR}/cli_test_helpers.cmake")
if(NOT EXISTS "${DATA_DIR}/cats.txt")
  message(FATAL_ERROR "no corpus in ${DATA_DIR}: run tools/setup.sh (make test does)")
endif()
set(dir "${WORK_DIR}/xpm_train_arguments_test")
file(REMOVE_RECURSE "${dir}")
file(MAKE_DIRECTORY "${dir}")
set(run "${dir}/run")

function(expect_refused label pattern)
  cli_expect_error("${label}" 2 "^xpm-train: error: ${pattern}$" "${XPM_TRAIN}" ${ARGN})
  if(EXISTS "${run}")
    message(FATAL_ERROR "${label}: a run folder was written")
  endif()
endfunction()

set(no_positional "\\(xpm-train takes no positional arguments; see --help\\)")
expect_refused("a stray word" "unexpected argument 'garbage' ${no_positional}"
               garbage --run-dir "${run}" --data-dir "${DATA_DIR}")
expect_refused("stray words after options" "unexpected arguments 'garbage', 'more' ${no_positional}"
               --run-dir "${run}" --data-dir "${DATA_DIR}" --max-steps 1 garbage more)
expect_refused("a stray word under --nproc 2" "unexpected argument 'garbage' ${no_positional}"
               --run-dir "${run}" --data-dir "${DATA_DIR}" --nproc 2 garbage)
expect_refused("--resume with a folder"
               "--resume takes no value \\('runs/x' given\\); the run folder to resume is --run-dir runs/x"
               --run-dir "${run}" --data-dir "${DATA_DIR}" --resume runs/x)
expect_refused("--resume=folder"
               "--resume takes no value \\('runs/x' given\\); the run folder to resume is --run-dir runs/x"
               --run-dir "${run}" --data-dir "${DATA_DIR}" --resume=runs/x)
file(WRITE "${dir}/resume.ini" "resume = runs/x\n")
expect_refused("resume = folder in the config file"
               "config file '[^']*resume.ini': .*'runs/x'.*the run folder to resume is run-dir\\)"
               --run-dir "${run}" --data-dir "${DATA_DIR}" --config "${dir}/resume.ini")

# report RUN_DIR takes nothing else.
file(MAKE_DIRECTORY "${dir}/finished")
cli_expect_error("report with a stray word" 2
                 "^xpm-train report: error: unexpected argument 'garbage' \\(xpm-train report takes one RUN_DIR; see xpm-train report --help\\)$"
                 "${XPM_TRAIN}" report "${dir}/finished" garbage)

# Correct command lines: --help, and a short run where the switch --resume (no checkpoint yet:
# step 0) is followed by options.
cli_expect_success("--help" "${XPM_TRAIN}" --help)
if(NOT OUT MATCHES "--run-dir")
  message(FATAL_ERROR "--help does not list --run-dir: ${OUT}")
endif()
cli_expect_success("a correct command line" "${XPM_TRAIN}" --run-dir "${run}" --data-dir "${DATA_DIR}"
                   --resume --max-steps 1 --batcher fixed --microbatch-size 8 --outer-batch-size 8
                   --max-validation-sentences 20 --threads 1 -q)
file(READ "${run}/summary.json" summary)
string(JSON steps GET "${summary}" train_steps)
if(NOT steps EQUAL 1)
  message(FATAL_ERROR "the correct command line trained ${steps} steps, expected 1")
endif()
# Passed (a failed check above stops the script): its run folders are removed.
cli_remove_run_folders("${dir}")
