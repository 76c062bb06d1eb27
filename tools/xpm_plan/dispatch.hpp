// xpm-plan command dispatch shared by xpm-plan and its LibTorch helper xpm-plan-probe: parse
// the verb's options, run it, map exceptions to exit codes and one-line errors.
#pragma once

#include <string>
#include <vector>

#include "verbs.hpp"

namespace xpm_plan {

/// Runs argv[1] among `verbs` with argv[2..] as its options and returns the exit code:
/// 0 success, 1 InfeasibleError, 2 bad input (InputError, option errors, a positional
/// argument the verb does not take, planner invalid_argument, unreadable/unwritable files), 3
/// internal error. Errors print one line "xpm-plan: error: ..." on stderr. Remembers argv (see
/// command_line()).
int dispatch(int argc, char** argv, const std::vector<Verb>& verbs);

/// The process's argv as given to dispatch().
const std::vector<std::string>& command_line();

}  // namespace xpm_plan
