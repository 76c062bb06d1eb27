# Without LibTorch, xpm-plan probe exits 2 with one line saying the verb is unavailable.
include("${CMAKE_CURRENT_LIST_DIR}/xpm_plan_test_helpers.cmake")
xpm_plan_run(2 "probe without LibTorch" probe --probe-points 2x16)
expect_match("probe without LibTorch" "${ERR}" "probe verb is unavailable.*without LibTorch")
