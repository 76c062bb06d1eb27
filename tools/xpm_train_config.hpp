// xpm-train's settings: the command-line options and the config file (`--config run.ini`),
// both read with Boost.Program_options into a TaggingJobConfig.
//
//   TrainSettings settings = parse_train_settings(argc, argv);  // throws std::invalid_argument
//   if (settings.help) { std::cout << settings.help_text; return 0; }
//   xpm::run_tagging_job(settings.config, dist);
//
// Config file: INI as Boost.Program_options reads it (parse_config_file, unregistered keys
// refused): one `name = value` per line, `#` starts a comment, names are the long option names
// without the dashes (max-steps = 200, resume = true); every option but --help and --config is
// valid there. A value given on the command line overrides the file's. docs/user-guide.md,
// "Config file", has an example; examples/default.ini is one.
#pragma once

#include <optional>
#include <string>

#include "xpm/trainer/distributed/local_launcher.hpp"
#include "xpm/tasks/tagging_job.hpp"

namespace xpm_train {

struct TrainSettings {
  xpm::TaggingJobConfig config;  // validated
  int nproc = 1;                 // local workers to start (--nproc)
  int max_restarts = 0;          // restarts of the --nproc group after a failure (--max-restarts)
  std::string config_file;       // --config, "" when none
  bool help = false;             // --help: print help_text and exit
  std::string help_text;
};

/// Reads the command line and the --config file into a validated config. Throws
/// std::invalid_argument with a message naming the option (and for the config file the file
/// and the key: "config file 'run.ini': unrecognised option 'max-stpes'"), for unknown options
/// or keys, a positional argument ("unexpected argument 'garbage' (...)"; one after the switch
/// --resume is taken for a run folder: "--resume takes no value ('runs/x' given); the run
/// folder to resume is --run-dir runs/x"), bad values, a missing file, a config that
/// TaggingJobConfig::validate refuses (renamed to option names), and a missing corpus.
TrainSettings parse_train_settings(int argc, char** argv);

}  // namespace xpm_train
