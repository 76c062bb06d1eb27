// xpm-plan-probe — the LibTorch half of xpm-plan: runs the `probe` verb (the bundled task's
// probes through xpm::trainer). `xpm-plan probe ...` executes it with the same arguments, so
// only this verb pays for loading LibTorch. Usage, output and exit codes: xpm-plan probe --help.
#include <vector>

#include "dispatch.hpp"
#include "verbs.hpp"

int main(int argc, char** argv) {
  using namespace xpm_plan;
  static const std::vector<Verb> verbs = {
      {"probe", "measure training steps of the bundled task at chosen dims", probe_options,
       run_probe, nullptr},
  };
  return dispatch(argc, argv, verbs);
}
