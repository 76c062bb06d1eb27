// bench/bench_options.hpp — the command-line parsing every bench program shares
// (Boost.Program_options): parse, print the options for --help, notify.
#pragma once

#include <iostream>
#include <optional>

#include <boost/program_options.hpp>

#include "cli_arguments.hpp"

namespace xpm_bench {

/// argv parsed against `options` and notified (values stored in their variables), or nullopt
/// after printing `options` to stdout when --help was given (the program then exits 0).
/// Throws boost::program_options::error for an unknown option or a bad value, naming it, and
/// std::invalid_argument for a positional argument ("unexpected argument 'garbage' (...)").
inline std::optional<boost::program_options::variables_map> parse_bench_options(
    int argc, char** argv, const boost::program_options::options_description& options) {
  namespace po = boost::program_options;
  const po::parsed_options parsed = po::command_line_parser(argc, argv).options(options).run();
  xpm_cli::refuse_positional_arguments(parsed, "no positional arguments are taken; see --help");
  po::variables_map vm;
  po::store(parsed, vm);
  if (vm.count("help") != 0U) {
    std::cout << options << "\n";
    return std::nullopt;
  }
  po::notify(vm);
  return vm;
}

}  // namespace xpm_bench
