# xpm-train report RUN_DIR: on a small metrics.jsonl written here (4 steps, one without a loss,
# two validation lines) and a summary.json, writes loss.svg, validation_accuracy.svg,
# tokens_per_s.svg and memory.svg with the expected series and values (tooltips carry
# "<series>, step <n>: <value>"); --out and --tensorboard; bad input exits 2 with one line naming
# the folder, or the file and line number.
# Run as: cmake -DXPM_TRAIN=<xpm-train> -DWORK_DIR=<dir> -P xpm_train_report_test.cmake
cmake_minimum_required(VERSION 3.22)
include("${CMAKE_CURRENT_LIST_DIR}/cli_test_helpers.cmake")
set(run "${WORK_DIR}/xpm_train_report_test")
file(REMOVE_RECURSE "${run}")
file(MAKE_DIRECTORY "${run}")
# 50 MiB = 52428800, 51 MiB = 53477376, 100 MiB = 104857600 bytes.
file(WRITE "${run}/metrics.jsonl"
"{\"step\":1,\"epoch\":0,\"loss\":2.5,\"tokens_per_s\":1000.0,\"peak_allocated_bytes\":52428800,\"predicted_peak_bytes\":53477376,\"capacity_bytes\":104857600}
{\"step\":2,\"epoch\":0,\"loss\":2.0,\"tokens_per_s\":1500.0,\"peak_allocated_bytes\":62914560,\"predicted_peak_bytes\":62914560,\"capacity_bytes\":104857600}
{\"step\":2,\"epoch\":0,\"validation\":{\"token_accuracy\":0.5,\"loss\":2.25,\"tokens\":100},\"best\":true}

{\"step\":3,\"epoch\":1,\"loss\":null,\"oom\":true,\"tokens_per_s\":0.0,\"peak_allocated_bytes\":104857600,\"predicted_peak_bytes\":73400320,\"capacity_bytes\":104857600}
{\"step\":4,\"epoch\":1,\"loss\":1.0,\"tokens_per_s\":1200.0,\"peak_allocated_bytes\":57671680,\"predicted_peak_bytes\":57671680,\"capacity_bytes\":104857600}
{\"step\":4,\"epoch\":1,\"validation\":{\"token_accuracy\":0.75,\"loss\":1.5,\"tokens\":100},\"best\":true}
")
file(WRITE "${run}/summary.json"
     "{\"batcher\":\"predictive\",\"world_size\":1,\"train_steps\":4,\"final_loss\":1.0,\"val_token_accuracy\":0.75,\"tokens_per_s\":1175.5}\n")

function(run_report expected label)
  execute_process(COMMAND "${XPM_TRAIN}" report ${ARGN}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc STREQUAL "${expected}")
    message(FATAL_ERROR "${label}: exit code ${rc}, expected ${expected}\nstdout: ${out}\nstderr: ${err}")
  endif()
  set(OUT "${out}" PARENT_SCOPE)
  set(ERR "${err}" PARENT_SCOPE)
endfunction()

# expect_contains(<file> <text>...): each text occurs in the file.
function(expect_contains path)
  if(NOT EXISTS "${path}")
    message(FATAL_ERROR "${path} was not written")
  endif()
  file(READ "${path}" content)
  foreach(text IN LISTS ARGN)
    string(FIND "${content}" "${text}" at)
    if(at EQUAL -1)
      message(FATAL_ERROR "${path} lacks [${text}]")
    endif()
  endforeach()
endfunction()

function(expect_lacks path text)
  file(READ "${path}" content)
  string(FIND "${content}" "${text}" at)
  if(NOT at EQUAL -1)
    message(FATAL_ERROR "${path} holds [${text}]")
  endif()
endfunction()

run_report(0 "report" "${run}")
set(report "${run}/report")
if(NOT OUT MATCHES "4 steps, 2 validation lines")
  message(FATAL_ERROR "report: stdout [${OUT}] does not count 4 steps and 2 validation lines")
endif()
expect_contains("${report}/loss.svg" "<svg" "training loss" "validation loss"
                "training loss, step 1: 2.5" "training loss, step 4: 1<"
                "validation loss, step 4: 1.5"
                "summary.json: predictive batcher, world size 1, 4 steps"
                "final loss 1, validation token accuracy 75.00 %, 1176 tokens/s")
expect_lacks("${report}/loss.svg" "training loss, step 3")  # its loss is null (out of memory)
expect_contains("${report}/validation_accuracy.svg" "validation token accuracy"
                "token accuracy (%)" "validation token accuracy, step 2: 50 %"
                "validation token accuracy, step 4: 75 %")
expect_contains("${report}/tokens_per_s.svg" "tokens/s, step 2: 1500" "tokens/s, step 3: 0<")
expect_contains("${report}/memory.svg" "peak allocated" "predicted peak" "capacity"
                "peak allocated, step 1: 50 MiB" "predicted peak, step 1: 51 MiB"
                "peak allocated, step 3: 100 MiB" "predicted peak, step 3: 70 MiB"
                "capacity, step 4: 100 MiB"
                # |70 - 100| / 100 at step 3, the largest of the 4 steps
                "predicted vs peak allocated: max |relative error| 30 % over 4 steps"
                "max peak allocated 100.0 MiB of 100.0 MiB capacity")

# --out elsewhere, and a TensorBoard event file.
run_report(0 "report --out --tensorboard" "${run}" --out "${run}/elsewhere" --tensorboard)
expect_contains("${run}/elsewhere/memory.svg" "peak allocated, step 4: 55 MiB")
file(GLOB events "${run}/elsewhere/tensorboard/events.out.tfevents.*.xpm-train")
list(LENGTH events n_events)
if(NOT n_events EQUAL 1)
  message(FATAL_ERROR "--tensorboard: expected one event file, found [${events}]")
endif()
file(SIZE "${events}" events_bytes)
if(events_bytes LESS 500)
  message(FATAL_ERROR "--tensorboard: the event file has only ${events_bytes} bytes")
endif()

# Bad input: exit code 2 and one line naming the folder, or the file and line.
function(expect_input_error label pattern)
  run_report(2 "${label}" ${ARGN})
  if(NOT ERR MATCHES "^xpm-train report: error: [^\n]*${pattern}[^\n]*\n$")
    message(FATAL_ERROR "${label}: stderr [${ERR}] is not one line matching '${pattern}'")
  endif()
endfunction()
expect_input_error("missing folder" "the run folder '${run}/nope' does not exist" "${run}/nope")
expect_input_error("no folder given" "no RUN_DIR given")
expect_input_error("unknown option" "unrecognised option '--bogus'" "${run}" --bogus)
file(MAKE_DIRECTORY "${run}/bad")
expect_input_error("missing metrics" "metrics.jsonl: cannot open the file" "${run}/bad")
file(WRITE "${run}/bad/metrics.jsonl" "{\"step\":1,\"loss\":1.0}\n{\"step\":2,\"loss\":0.5}\n{\"step\":3,\"loss\":\n")
expect_input_error("malformed line" "metrics.jsonl line 3: not valid JSON" "${run}/bad")
file(WRITE "${run}/bad/metrics.jsonl" "{\"step\":1,\"loss\":1.0}\n{\"loss\":0.5}\n")
expect_input_error("line without a step" "metrics.jsonl line 2: no integer \"step\"" "${run}/bad")
file(WRITE "${run}/bad/metrics.jsonl" "{\"step\":1,\"loss\":\"low\"}\n")
expect_input_error("loss not a number" "metrics.jsonl line 1: \"loss\" is not a number: \"low\"" "${run}/bad")
file(WRITE "${run}/bad/metrics.jsonl" "\n")
expect_input_error("no step lines" "metrics.jsonl: no optimizer-step lines" "${run}/bad")
file(WRITE "${run}/bad/metrics.jsonl" "{\"step\":1,\"loss\":1.0}\n")
file(WRITE "${run}/bad/summary.json" "{\"final_loss\": ")
expect_input_error("bad summary" "summary.json: not valid JSON" "${run}/bad")
if(EXISTS "${run}/bad/report")
  message(FATAL_ERROR "bad input: a report folder was written")
endif()
# Passed (a failed check above stops the script): its run folders are removed.
cli_remove_run_folders("${run}")
