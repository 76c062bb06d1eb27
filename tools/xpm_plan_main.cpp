// xpm-plan — model peak memory offline: probe the bundled task, fit a cost formula to
// measurements, save the memory model, and query it (predicted bytes, largest microbatch size,
// microbatch plan of an outer batch). See docs/xpm-plan.md.
//
//   xpm-plan probe --probe-points 8x64,16x128,32x180 --memory-cap-factor 3 -o probes.csv
//   xpm-plan fit probes.csv --formula 'a*bs*l^2 + b*bs*l + c' --variables bs,l
//                --bytes-column forward_backward_peak_bytes --floor-column optimizer_step_peak_bytes
//                --output model.json --figure fit.svg
//   xpm-plan show model.json
//   xpm-plan predict --model model.json --dims bs=8,l=128
//   xpm-plan max-batch --model model.json --dims l=128 --capacity-bytes 85899345920
//   xpm-plan plan --model model.json --csv records.csv --capacity-bytes 85899345920 --sort-by l
//
// Exit codes: 0 success; 1 infeasible (nothing fits the budget, a record is over budget alone,
// every probe ran out of memory, the fit is not usable); 2 bad input (options, files, CSV cells,
// JSON fields, formula, budget); 3 internal error. Errors are one line on stderr starting
// "xpm-plan: error:". Files are written atomically (temporary file, then rename) and only after
// everything else succeeded, so a failed run leaves nothing half-written.
//
// Layout: tools/xpm_plan/ — dispatch (options, exit codes), common (errors, option helpers,
// atomic writes), csv_table, measurements (CSV/JSON input of fit), fit_report, svg_plot and
// figures, one verb_<name>.cpp per verb. The probe verb needs LibTorch, whose shared libraries
// take about a second to load; so that the other verbs start at once, it runs in a helper,
// xpm-plan-probe (probe_main.cpp, linked with xpm::trainer), which `xpm-plan probe` executes
// from its own folder.
#include <vector>

#include "xpm_plan/dispatch.hpp"
#include "xpm_plan/verbs.hpp"

int main(int argc, char** argv) {
  using namespace xpm_plan;
  static const std::vector<Verb> verbs = {
      {"probe", "measure training steps of the bundled task at chosen dims (needs LibTorch)",
       probe_options, run_probe, nullptr},
      {"fit", "fit a cost formula to measured peak bytes (CSV or JSON); save the memory model",
       fit_options, run_fit, "measurements"},
      {"show", "print a memory model file: formula, coefficients, floor, metadata, probes",
       show_options, run_show, "model"},
      {"predict", "predicted peak bytes at given dims (CSV rows or --dims)", predict_options,
       run_predict, "csv"},
      {"max-batch", "largest microbatch size a memory model predicts within budget",
       max_batch_options, run_max_batch, nullptr},
      {"plan", "split an outer batch (records file) into microbatches that fit the budget",
       plan_options, run_plan, "csv"},
  };
  return dispatch(argc, argv, verbs);
}
