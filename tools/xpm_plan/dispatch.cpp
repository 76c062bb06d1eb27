// xpm-plan command dispatch (see dispatch.hpp).
#include "dispatch.hpp"

#include <algorithm>
#include <iostream>

#include "cli_arguments.hpp"
#include "common.hpp"

namespace xpm_plan {
namespace {

std::vector<std::string>& argv_store() {
  static std::vector<std::string> args;
  return args;
}

std::string verb_names(const std::vector<Verb>& verbs) {
  std::string names;
  for (const Verb& v : verbs) names += (names.empty() ? "" : ", ") + std::string(v.name);
  return names;
}

void print_usage(std::ostream& os, const std::vector<Verb>& verbs) {
  os << "usage: xpm-plan COMMAND [options]   (xpm-plan COMMAND --help for one command)\n\n"
     << "commands:\n";
  for (const Verb& v : verbs) {
    const std::string name = v.name;
    os << "  " << name << std::string(name.size() < 11 ? 11 - name.size() : 1, ' ') << v.summary
       << "\n";
  }
  os << "\nEvery command takes --help and --json (one JSON object or list on stdout); xpm-plan --version\n"
     << "prints the version.\n"
     << "exit codes: 0 success, 1 infeasible (e.g. nothing fits the budget), 2 bad input,\n"
     << "3 internal error; errors are one line on stderr starting 'xpm-plan: error:'.\n";
}

// What a verb takes besides options, for the error naming a token it does not take.
std::string positional_hint(const Verb& verb) {
  const std::string name = verb.name;
  const std::string takes = verb.positional != nullptr
                                ? "takes one positional argument, its --" + std::string(verb.positional)
                                : "takes no positional arguments";
  return name + " " + takes + "; see xpm-plan " + name + " --help";
}

int run(int argc, char** argv, const std::vector<Verb>& verbs) {
  if (argc < 2) {
    throw InputError("missing command (" + verb_names(verbs) + "); see xpm-plan --help");
  }
  const std::string name = argv[1];
  if (name == "--version") {
    if (argc > 2) {
      throw InputError(xpm_cli::unexpected_arguments_message(std::vector<std::string>(argv + 2, argv + argc),
                                                             "xpm-plan --version takes none"));
    }
    std::cout << "xpm-plan " << XPM_VERSION << "\n";
    return 0;
  }
  if (name == "--help" || name == "-h" || name == "help") {
    if (argc > 2) {
      throw InputError(xpm_cli::unexpected_arguments_message(
          std::vector<std::string>(argv + 2, argv + argc),
          "xpm-plan " + name + " takes none; xpm-plan COMMAND --help describes a command"));
    }
    print_usage(std::cout, verbs);
    return 0;
  }
  auto it = std::find_if(verbs.begin(), verbs.end(), [&](const Verb& v) { return name == v.name; });
  if (it == verbs.end()) {
    throw InputError("unknown command '" + name + "' (" + verb_names(verbs) +
                     "); see xpm-plan --help");
  }
  const po::options_description desc = it->options();
  po::positional_options_description positional;
  if (it->positional != nullptr) positional.add(it->positional, 1);
  po::variables_map vm;
  po::store(xpm_cli::parse_command_line(std::vector<std::string>(argv + 2, argv + argc), desc, positional,
                                        positional_hint(*it)),
            vm);
  if (vm.count("help")) {
    std::cout << desc;
    return 0;
  }
  po::notify(vm);
  return it->run(vm);
}

// "xpm-plan: error: <the first line>", without the "xpm: " the library's own messages begin with.
void report(const char* kind, const std::exception& e) {
  std::string line = first_line(e.what());
  if (line.rfind("xpm: ", 0) == 0) line.erase(0, 5);
  std::cerr << "xpm-plan: " << kind << ": " << line << "\n";
}

}  // namespace

const std::vector<std::string>& command_line() { return argv_store(); }

int dispatch(int argc, char** argv, const std::vector<Verb>& verbs) {
  argv_store().assign(argv, argv + argc);
  try {
    return run(argc, argv, verbs);
  } catch (const InfeasibleError& e) {
    report("error", e);
    return 1;
  } catch (const po::error& e) {
    report("error", e);
  } catch (const InputError& e) {
    report("error", e);
  } catch (const std::invalid_argument& e) {  // planner errors not mapped by a verb
    report("error", e);
  } catch (const std::runtime_error& e) {  // unreadable or unwritable files
    report("error", e);
  } catch (const std::exception& e) {
    report("internal error", e);
    return 3;
  }
  return 2;
}

}  // namespace xpm_plan
