// xpm-plan verbs: each has an options description (its --help) and a runner returning the exit
// code. Runners throw InputError (exit 2) or InfeasibleError (exit 1); see xpm_plan_main.cpp.
#pragma once

#include <boost/program_options.hpp>

namespace xpm_plan {

namespace po = boost::program_options;

struct Verb {
  const char* name;
  const char* summary;
  po::options_description (*options)();
  int (*run)(const po::variables_map&);
  const char* positional;  // option that takes one positional argument, or nullptr
};

po::options_description fit_options();
int run_fit(const po::variables_map& vm);
po::options_description predict_options();
int run_predict(const po::variables_map& vm);
po::options_description max_batch_options();
int run_max_batch(const po::variables_map& vm);
po::options_description plan_options();
int run_plan(const po::variables_map& vm);
po::options_description probe_options();
int run_probe(const po::variables_map& vm);
po::options_description show_options();
int run_show(const po::variables_map& vm);

}  // namespace xpm_plan
