// tools/cli_arguments.hpp — no program of the project ignores a command-line token. An
// unknown option is Boost.Program_options' own error (unregistered options are not allowed);
// a positional argument that no positional_options_description takes is kept by the parser
// but dropped by po::store without a word, so it is refused here, by name:
//
//   const po::parsed_options parsed = po::command_line_parser(argc, argv).options(desc).run();
//   xpm_cli::refuse_positional_arguments(parsed, "xpm-train takes no positional arguments; see --help");
//   // throws std::invalid_argument("unexpected argument 'garbage' (xpm-train takes no ...)")
//
//   parsed = xpm_cli::parse_command_line(args, desc, positional, "show takes one MODEL file");
//   // positional arguments beyond what `positional` takes (less the options given by name)
//   // are refused the same way
#pragma once

#include <cstddef>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include <boost/program_options.hpp>

namespace xpm_cli {

namespace po = boost::program_options;

/// "unexpected argument 'a' (<hint>)" or "unexpected arguments 'a', 'b' (<hint>)".
inline std::string unexpected_arguments_message(const std::vector<std::string>& tokens,
                                                const std::string& hint) {
  std::string names;
  for (const std::string& token : tokens) names += (names.empty() ? "'" : ", '") + token + "'";
  return std::string(tokens.size() == 1 ? "unexpected argument " : "unexpected arguments ") + names +
         " (" + hint + ")";
}

/// Throws std::invalid_argument (unexpected_arguments_message) naming the positional arguments
/// of `parsed` (parsed without a positional description) after the first `allowed` ones.
inline void refuse_positional_arguments(const po::parsed_options& parsed, const std::string& hint,
                                        std::size_t allowed = 0) {
  std::vector<std::string> tokens = po::collect_unrecognized(parsed.options, po::include_positional);
  if (tokens.size() <= allowed) return;
  tokens.erase(tokens.begin(), tokens.begin() + static_cast<std::ptrdiff_t>(allowed));
  throw std::invalid_argument(unexpected_arguments_message(tokens, hint));
}

/// The positions of `positional` still free in `parsed`: those whose option was not given by
/// name ("show --model m.json extra": 'extra' has no place left).
inline std::size_t free_positions(const po::parsed_options& parsed,
                                  const po::positional_options_description& positional) {
  const unsigned total = positional.max_total_count();
  if (total == std::numeric_limits<unsigned>::max()) return total;  // a list: takes any number
  std::size_t free = 0;
  for (unsigned position = 0; position < total; ++position) {
    const std::string& name = positional.name_for_position(position);
    bool given = false;
    for (const po::option& option : parsed.options) given = given || option.string_key == name;
    free += given ? 0 : 1;
  }
  return free;
}

/// Boost's command-line style without guessing: an option is written in full (--variables, not
/// --var), so a shortened or mistyped name is refused instead of read as another option.
inline int exact_option_style() {
  return po::command_line_style::default_style & ~po::command_line_style::allow_guessing;
}

/// po::command_line_parser(args).options(options).positional(positional).run(), once the
/// positional arguments beyond the free positions of `positional` have been refused (by name,
/// with `hint`). Throws po::error for an unknown option or a bad value.
inline po::parsed_options parse_command_line(const std::vector<std::string>& args,
                                             const po::options_description& options,
                                             const po::positional_options_description& positional,
                                             const std::string& hint) {
  const po::parsed_options unplaced =
      po::command_line_parser(args).options(options).style(exact_option_style()).run();
  refuse_positional_arguments(unplaced, hint, free_positions(unplaced, positional));
  return po::command_line_parser(args).options(options).positional(positional).style(exact_option_style()).run();
}

}  // namespace xpm_cli
