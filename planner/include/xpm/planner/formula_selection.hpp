// xpm/planner/formula_selection.hpp — no formula needed: choose a cost formula from the probes.
//
//   FormulaSelectionOptions options;
//   options.batch_size_variable = "bs";
//   FormulaSelection chosen = select_formula({"bs", "ls", "lt"}, measurements, {}, options);
//   chosen.formula.canonical();     // e.g. "a1*bs*ls^2 + a2*bs*lt^2 + a3*bs*ls*lt + c"
//   chosen.fit.summary.usable;      // the chosen formula's fit, as fit_coefficients gives it
//   std::cout << chosen.report();   // every candidate: coefficients, fit and held-out error
//
// Candidates, from the declared variables alone (dims in variable order, bytes measured):
//  - terms: the batch-size variable times every monomial of degree 0 to 2 in the other
//    variables (bs; bs*l, bs*l^2; with two length variables also bs*ls*lt, ...), and those
//    monomials alone (l, l^2: memory per shape that does not grow with the records, such as a
//    convolution's workspace at batch size 1);
//  - linear: a constant plus any subset of the terms that grow with the records (every subset
//    up to 6 of them, else a forward selection), the three best then grown by the other terms
//    while one lowers the score;
//  - max(): 2 or 3 pieces, each an affine piece (own coefficients and constant) over a disjoint
//    subset of the terms of the best linear set (with the second best's too when together
//    they are at most 4 terms), or two pieces over all of them: a peak that moves between
//    operations or regimes; each shape quickly fitted, the
//    three best by fit error kept; and, with FormulaSelectionOptions::floor, max(f, best
//    linear) (a floor in the same formula).
// Every candidate is fitted by fit_coefficients (with held-out, leave-one-shape-out, error) and
// ranked by the root mean square of its held-out relative errors + size_penalty * coefficients
// (the mean, not the max: one extreme shape, predicted from the others by extrapolation,
// would decide every ranking); the best usable one is
// chosen (the best unusable one when none is usable: its summary says why); ties go to fewer
// coefficients, then to the candidate tried first (the order above). Measurements must be more
// than the coefficients of a candidate for it to be tried. With FormulaSelectionOptions::
// formulas, those formulas are the candidates instead (each fitted with its held-out refits):
// the adaptive probe design refits its rivals that way after each probe it adds.
// Pure and deterministic: every rank given the same measurements gets the same formula (no
// collective; PredictiveBatcher calls it on rank 0 and shares the model); no clock is read.
// Thread-safe. Time: one linear fit per subset, quick fits of the max() shapes, a few non-linear
// fits with their held-out refits: 0.8 s for 56 probes of two variables, 2.5 s of three
// (bench/fit_bench.cpp, BM_SelectFormula).
#pragma once

#include <string>
#include <vector>

#include "xpm/planner/fit.hpp"
#include "xpm/planner/formula.hpp"

namespace xpm {

struct FormulaSelectionOptions {
  std::string batch_size_variable = "bs";  // a variable of the selection; it multiplies every term
  /// Variables summed over a microbatch's records (DimAggregation::kSum, e.g. real tokens): a
  /// sum grows with the records itself, so t and t times another variable join the terms that
  /// grow with the records, and bs*t (quadratic in the records) is not a candidate.
  std::vector<std::string> summed_variables;
  int max_pieces = 3;                      // max() of up to this many pieces; 1: linear only
  bool floor = true;                       // also try max(f, best linear formula)
  double size_penalty = 0.0005;            // added to the held-out rms error per coefficient
  /// When not empty, the candidates (formula texts over the variables, in this order) instead of
  /// those generated from the variables; max_pieces and floor do not apply then.
  std::vector<std::string> formulas;
  FitOptions fit;                          // for every candidate's fit (batch_size_variable set)
  /// Throws std::invalid_argument naming the bad field.
  void validate() const;
};

/// One candidate formula and how it did.
struct FormulaCandidate {
  std::string text;                   // e.g. "a1*bs*l + a2*bs*l^2 + c"
  std::size_t coefficient_count = 0;
  double max_rel_error = 0;           // at the fitted points
  double held_out_max_rel_error = 0;  // leave-one-shape-out; NaN when not computed
  double held_out_rms_rel_error = 0;  // root mean square of the same; NaN when not computed
  bool usable = false;                // FitSummary::usable
  double score = 0;                   // held-out rms + size_penalty * coefficients (ranking)
  std::string note;                   // why it was not fitted ("" when it was)
};

/// A fitted formula other than the chosen one.
struct FittedFormula {
  CostFormula formula;
  std::vector<double> coefficients;  // formula.coefficient_names() order
  double max_rel_error = 0;          // at the fitted points
};

struct FormulaSelection {
  CostFormula formula;                      // the chosen formula
  FitResult fit;                            // its fit
  std::vector<FormulaCandidate> candidates;  // every candidate tried, in order tried
  std::size_t chosen = 0;                   // index into candidates
  /// Up to four other formulas the measurements explain best (by fit error, usable or not, max()
  /// shapes fitted without held-out refits included): where they and the chosen one disagree,
  /// a probe tells them apart (the adaptive probe design uses them).
  std::vector<FittedFormula> alternatives;
  /// "chose ... of N candidates" and one line per candidate (text, coefficients, fit and
  /// held-out error, usable), best score first.
  std::string report() const;
};

/// The sum of every candidate term and a constant, coefficients named `prefix` + a1, a2, ...
/// and `prefix` + c: for variables {bs, l}, "a1*bs + a2*bs*l + a3*bs*l^2 + c" (prefix "").
/// Throws std::invalid_argument when the batch-size variable is not among `variable_names`.
std::string all_terms_formula(const std::vector<std::string>& variable_names,
                              const std::string& batch_size_variable, const std::string& prefix);

/// Chooses a formula over `variable_names` for `measurements` (bounds as in fit_coefficients).
/// Throws std::invalid_argument when the batch-size variable is not among `variable_names`, the
/// measurements are invalid (as fit_coefficients says), a text of options.formulas does not parse
/// over them, or no candidate can be fitted (too few measurements, shapes that separate no terms;
/// the message says which).
FormulaSelection select_formula(const std::vector<std::string>& variable_names,
                                const std::vector<Measurement>& measurements,
                                const std::vector<InfeasibleBound>& bounds,
                                const FormulaSelectionOptions& options = {});

}  // namespace xpm
