// xpm/trainer/options/option_setters.hpp — XPM_OPTION_SETTER, the chainable setters of every
// options struct; defined with the planner (xpm/planner/option_setters.hpp), whose options
// use it too.
//
//   auto options = xpm::LearnerOptions().set_run_dir("runs/mine").set_epochs(2);
#pragma once

#include "xpm/planner/option_setters.hpp"
