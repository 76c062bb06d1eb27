# cmake -DHEADER=<a public header> -DOUTPUT=<file> -P xpm_header_example.cmake
#
# Writes the usage example at the top of a public header (its first run of comment lines that
# start with "//   ") as C++ statements to OUTPUT, after a #line directive so that an error in
# it points into the header. tests/planner/header_examples_test.cpp includes each such file in
# a test case: an example that goes stale fails the build.
file(READ "${HEADER}" content)
set(content "\n${content}")  # every line, the first too, after a newline: matched at line starts
string(REGEX MATCH "\n(//   [^\n]*\n)+" block "${content}")
if(block STREQUAL "")
  message(FATAL_ERROR "${HEADER}: no usage example (comment lines starting with '//   ')")
endif()
string(SUBSTRING "${block}" 1 -1 block)
string(FIND "${content}" "${block}" start)
math(EXPR start "${start} - 1")  # without the added newline
string(SUBSTRING "${content}" 0 ${start} before)
string(REGEX MATCHALL "\n" newlines "${before}")
list(LENGTH newlines line)
math(EXPR line "${line} + 1")
string(REGEX REPLACE "(^|\n)//   " "\\1" code "${block}")
file(WRITE "${OUTPUT}.tmp" "#line ${line} \"${HEADER}\"\n${code}")
file(COPY_FILE "${OUTPUT}.tmp" "${OUTPUT}" ONLY_IF_DIFFERENT)
file(REMOVE "${OUTPUT}.tmp")
