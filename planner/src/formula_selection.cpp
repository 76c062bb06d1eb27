// formula_selection.cpp — select_formula: candidate formulas from the declared variables, each
// fitted, the best by held-out error with a penalty for size (formula_selection.hpp).
#include "xpm/planner/formula_selection.hpp"

#include <algorithm>
#include <cmath>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>
#include <tuple>
#include <string>
#include <utility>
#include <vector>

#include "fit_points.hpp"
#include "number_format.hpp"

namespace xpm {
namespace {

using Term = std::vector<int>;  // power of each variable, variable order
using TermSet = std::vector<std::size_t>;  // indices into the term pool, ascending

// Which variables are summed over the records (FormulaSelectionOptions::summed_variables).
std::vector<bool> summed_flags(const std::vector<std::string>& names, const FormulaSelectionOptions& options) {
  std::vector<bool> summed(names.size(), false);
  for (const std::string& name : options.summed_variables) {
    const auto it = std::find(names.begin(), names.end(), name);
    if (it == names.end()) {
      throw std::invalid_argument("FormulaSelectionOptions.summed_variables names '" + name +
                                  "', which is not one of the variables (" + detail::comma_list(names) + ")");
    }
    summed[static_cast<std::size_t>(it - names.begin())] = true;
  }
  return summed;
}

// The degree of `term` in the summed variables.
int summed_degree(const Term& term, const std::vector<bool>& summed) {
  int degree = 0;
  for (std::size_t v = 0; v < term.size(); ++v) degree += summed[v] ? term[v] : 0;
  return degree;
}

// A term grows with the records: bs times a monomial of the others, or a sum (t, t*l).
bool grows_with_records(const Term& term, std::size_t bs, const std::vector<bool>& summed) {
  return term[bs] > 0 || summed_degree(term, summed) == 1;
}

// bs times every monomial of degree 0 to 2 in the other variables, then those monomials of
// degree 1 and 2 alone (memory that does not grow with the records: a workspace per shape; or,
// with a summed variable, memory that grows with its sum); bs times a summed variable is left
// out (quadratic in the records).
std::vector<Term> term_pool(std::size_t variables, std::size_t bs, const std::vector<bool>& summed) {
  std::vector<Term> pool;
  Term base(variables, 0);
  base[bs] = 1;
  pool.push_back(base);
  for (std::size_t v = 0; v < variables; ++v) {
    if (v == bs) continue;
    Term linear = base;
    linear[v] = 1;
    pool.push_back(linear);
  }
  for (std::size_t v = 0; v < variables; ++v) {
    for (std::size_t w = v; w < variables; ++w) {
      if (v == bs || w == bs) continue;
      Term quadratic = base;
      ++quadratic[v];
      ++quadratic[w];
      pool.push_back(quadratic);
    }
  }
  const std::size_t with_bs = pool.size();
  for (std::size_t t = 1; t < with_bs; ++t) {
    Term alone = pool[t];
    alone[bs] = 0;
    pool.push_back(alone);
  }
  pool.erase(std::remove_if(pool.begin(), pool.end(),
                            [&](const Term& term) { return term[bs] > 0 && summed_degree(term, summed) > 0; }),
             pool.end());
  return pool;
}

std::string term_text(const Term& term, const std::vector<std::string>& names) {
  std::string out;
  for (std::size_t v = 0; v < term.size(); ++v) {
    if (term[v] == 0) continue;
    out += "*" + names[v] + (term[v] > 1 ? "^" + std::to_string(term[v]) : "");
  }
  return out;
}

class Namer {
 public:
  explicit Namer(const std::vector<std::string>& variables) : variables_(variables) {}
  std::string operator()(const std::string& name) const {
    const bool taken = std::find(variables_.begin(), variables_.end(), name) != variables_.end();
    return taken ? "xpm_" + name : name;
  }

 private:
  const std::vector<std::string>& variables_;
};

// One affine piece: `letter`1*term + `letter`2*term + ... + `constant`.
std::string piece_text(const std::vector<Term>& pool, const TermSet& set, const std::string& letter,
                       const std::string& constant, const std::vector<std::string>& names,
                       const Namer& name) {
  std::string out;
  for (std::size_t i = 0; i < set.size(); ++i) {
    out += name(letter + std::to_string(i + 1)) + term_text(pool[set[i]], names) + " + ";
  }
  return out + name(constant);
}

// The root mean square of the values that are not NaN (held-out errors: a shape the others do
// not determine has none); NaN when there are none.
double rms(const std::vector<double>& values) {
  double sum = 0;
  std::size_t count = 0;
  for (double v : values) {
    if (!std::isnan(v)) sum += v * v, ++count;
  }
  return count == 0 ? std::nan("") : std::sqrt(sum / static_cast<double>(count));
}

struct Tried {
  FormulaCandidate candidate;
  std::optional<CostFormula> formula;
  FitResult fit;
};

class Selector {
 public:
  Selector(const std::vector<std::string>& names, const std::vector<Measurement>& measurements,
           const std::vector<InfeasibleBound>& bounds, const FormulaSelectionOptions& options)
      : names_(names), measurements_(measurements), bounds_(bounds), options_(options),
        name_(names) {
    fit_options_ = options.fit;
    fit_options_.batch_size_variable = options.batch_size_variable;
  }

  // Fits `text` (or notes why not) and returns its score; +inf when not fitted. Without
  // `held_out`, a quick fit without the held-out refits, scored by its fit error (not kept).
  double try_formula(const std::string& text, std::size_t coefficient_count, bool held_out = true) {
    for (const Tried& t : tried_) {
      if (t.candidate.text == text) return t.candidate.score;
    }
    if (!held_out) return quick_score(text, coefficient_count);
    Tried t;
    t.candidate.text = text;
    t.candidate.coefficient_count = coefficient_count;
    t.candidate.score = HUGE_VAL;
    t.candidate.held_out_max_rel_error = std::nan("");
    if (coefficient_count >= measurements_.size()) {
      t.candidate.note = "not tried: " + std::to_string(coefficient_count) + " coefficients for " +
                         std::to_string(measurements_.size()) + " measurements";
      tried_.push_back(std::move(t));
      return HUGE_VAL;
    }
    try {
      t.formula = CostFormula::with_variables(text, names_);
      t.fit = fit_coefficients(*t.formula, measurements_, bounds_, fit_options_);
      const FitSummary& s = t.fit.summary;
      t.candidate.max_rel_error = s.max_rel_error;
      t.candidate.held_out_max_rel_error = s.leave_one_out_max_rel_error;
      t.candidate.held_out_rms_rel_error = rms(s.leave_one_out_rel_errors);
      t.candidate.usable = s.usable;
      const double error = std::isnan(t.candidate.held_out_rms_rel_error) ? rms(s.rel_errors) + 1
                                                                          : t.candidate.held_out_rms_rel_error;
      t.candidate.score = std::isnan(error) ? HUGE_VAL
                                            : error + options_.size_penalty * static_cast<double>(coefficient_count);
    } catch (const std::invalid_argument& e) {  // the shapes cannot separate its terms
      t.formula.reset();
      t.candidate.note = std::string("not fitted: ") + e.what();
      t.candidate.note = t.candidate.note.substr(0, t.candidate.note.find('\n'));
    }
    const double score = t.candidate.score;
    tried_.push_back(std::move(t));
    return score;
  }

  double quick_score(const std::string& text, std::size_t coefficient_count) {
    if (coefficient_count + 1 >= measurements_.size()) return HUGE_VAL;
    FitOptions quick = fit_options_;
    quick.leave_one_out = false;
    try {
      CostFormula formula = CostFormula::with_variables(text, names_);
      FitResult fit = fit_coefficients(formula, measurements_, bounds_, quick);
      const double error = rms(fit.summary.rel_errors);
      if (std::isfinite(error)) fitted_.push_back({formula, fit.coefficients, fit.summary.max_rel_error});
      if (!fit.summary.usable) return HUGE_VAL;
      return error + options_.size_penalty * static_cast<double>(coefficient_count);
    } catch (const std::invalid_argument&) {
      return HUGE_VAL;
    }
  }

  // Every fit with a finite error but `text`'s, best first, at most `count`.
  std::vector<FittedFormula> alternatives(const std::string& chosen_text, std::size_t count) const {
    std::vector<FittedFormula> all = fitted_;
    for (const Tried& t : tried_) {
      if (t.formula && std::isfinite(t.candidate.max_rel_error)) {
        all.push_back({*t.formula, t.fit.coefficients, t.candidate.max_rel_error});
      }
    }
    std::stable_sort(all.begin(), all.end(), [](const FittedFormula& a, const FittedFormula& b) {
      return a.max_rel_error < b.max_rel_error;
    });
    std::vector<FittedFormula> out;
    for (const FittedFormula& f : all) {
      if (out.size() == count) break;
      const bool seen = f.formula.text() == chosen_text ||
                        std::any_of(out.begin(), out.end(), [&](const FittedFormula& o) {
                          return o.formula.text() == f.formula.text();
                        });
      if (!seen) out.push_back(f);
    }
    return out;
  }

  double try_linear(const std::vector<Term>& pool, const TermSet& set) {
    return try_formula(piece_text(pool, set, "a", "c", names_, name_), set.size() + 1);
  }

  // max() of one affine piece per term set, each with its own constant.
  static std::pair<std::string, std::size_t> pieces_formula(const std::vector<Term>& pool,
                                                            const std::vector<TermSet>& pieces,
                                                            const std::vector<std::string>& names,
                                                            const Namer& name) {
    static const char* const kLetters[] = {"a", "b", "d"};
    std::string text = "max(";
    std::size_t count = 0;
    for (std::size_t p = 0; p < pieces.size(); ++p) {
      text += (p ? ", " : "") + piece_text(pool, pieces[p], kLetters[p], "c" + std::to_string(p + 1), names, name);
      count += pieces[p].size() + 1;
    }
    return {text + ")", count};
  }

  std::pair<std::string, std::size_t> pieces_formula(const std::vector<Term>& pool,
                                                     const std::vector<TermSet>& pieces) const {
    return pieces_formula(pool, pieces, names_, name_);
  }

  double try_floor(const std::vector<Term>& pool, const TermSet& set) {
    return try_formula("max(" + name_("f") + ", " + piece_text(pool, set, "a", "c", names_, name_) + ")",
                       set.size() + 2);
  }

  std::vector<Tried>& tried() { return tried_; }

 private:
  const std::vector<std::string>& names_;
  const std::vector<Measurement>& measurements_;
  const std::vector<InfeasibleBound>& bounds_;
  const FormulaSelectionOptions& options_;
  FitOptions fit_options_;
  Namer name_;
  std::vector<Tried> tried_;
  std::vector<FittedFormula> fitted_;  // the quick fits
};

// Adds terms of `candidates` to `set` one at a time while one lowers the score (forward
// selection); every set tried joins `scored`.
void grow(Selector& selector, const std::vector<Term>& pool, TermSet set, double score,
          const TermSet& candidates, std::vector<std::pair<double, TermSet>>& scored) {
  for (bool improved = true; improved;) {
    improved = false;
    TermSet best_set = set;
    for (std::size_t i : candidates) {
      if (std::find(set.begin(), set.end(), i) != set.end()) continue;
      TermSet grown = set;
      grown.push_back(i);
      std::sort(grown.begin(), grown.end());
      const double grown_score = selector.try_linear(pool, grown);
      scored.push_back({grown_score, grown});
      if (grown_score < score) {
        score = grown_score;
        best_set = grown;
        improved = true;
      }
    }
    set = best_set;
  }
}

// Every non-empty subset of the terms that grow with the records (up to 6 of them; else a
// forward selection), then, from the three best, the other terms added while they help.
std::vector<std::pair<double, TermSet>> linear_sets(Selector& selector, const std::vector<Term>& pool,
                                                    const TermSet& with_bs) {
  std::vector<std::pair<double, TermSet>> scored;
  if (with_bs.size() <= 6) {
    for (unsigned mask = 1; mask < (1u << with_bs.size()); ++mask) {
      TermSet set;
      for (std::size_t i = 0; i < with_bs.size(); ++i) {
        if (mask & (1u << i)) set.push_back(with_bs[i]);
      }
      scored.push_back({selector.try_linear(pool, set), set});
    }
  } else {
    grow(selector, pool, {}, HUGE_VAL, with_bs, scored);
  }
  const auto by_score = [](const auto& x, const auto& y) {
    return x.first < y.first || (x.first == y.first && x.second.size() < y.second.size());
  };
  std::sort(scored.begin(), scored.end(), by_score);
  TermSet others;
  for (std::size_t t = 0; t < pool.size(); ++t) {
    if (std::find(with_bs.begin(), with_bs.end(), t) == with_bs.end()) others.push_back(t);
  }
  const std::vector<std::pair<double, TermSet>> best(scored.begin(), scored.begin() + std::min<std::ptrdiff_t>(3, static_cast<std::ptrdiff_t>(scored.size())));
  for (const auto& [score, set] : best) {
    if (std::isfinite(score)) grow(selector, pool, set, score, others, scored);
  }
  std::sort(scored.begin(), scored.end(), by_score);
  return scored;
}

// Every way to give 2 to `max_pieces` pieces disjoint non-empty subsets of `terms`.
std::vector<std::vector<TermSet>> piece_shapes(const TermSet& terms, int max_pieces) {
  std::set<std::vector<TermSet>> shapes;
  std::size_t assignments = 1;
  const std::size_t slots = static_cast<std::size_t>(max_pieces) + 1;  // a piece, or unused
  for (std::size_t t = 0; t < terms.size(); ++t) assignments *= slots;
  for (std::size_t code = 0; code < assignments; ++code) {
    std::vector<TermSet> pieces(static_cast<std::size_t>(max_pieces));
    std::size_t rest = code;
    for (std::size_t t = 0; t < terms.size(); ++t, rest /= slots) {
      if (rest % slots > 0) pieces[rest % slots - 1].push_back(terms[t]);
    }
    pieces.erase(std::remove_if(pieces.begin(), pieces.end(), [](const TermSet& p) { return p.empty(); }),
                 pieces.end());
    if (pieces.size() < 2) continue;
    std::sort(pieces.begin(), pieces.end());  // the order of max() arguments does not matter
    shapes.insert(pieces);
  }
  return {shapes.begin(), shapes.end()};
}

// Quick fits of every max() shape; the three best by fit error (with the size penalty) are
// then fitted with their held-out refits and join the candidates.
void try_piece_shapes(Selector& selector, const std::vector<Term>& pool, const TermSet& terms,
                      const TermSet& with_bs, int max_pieces) {
  if (max_pieces < 2) return;
  std::vector<std::pair<double, std::pair<std::string, std::size_t>>> quick;
  std::vector<std::vector<TermSet>> shapes;
  if (terms.size() >= 2) {
    shapes = piece_shapes(terms, max_pieces);
    shapes.push_back({terms, terms});  // two pieces of every term: the same operations, two regimes
  }
  // One term that grows with the records per piece: a peak that moves between operations
  // (pairs; triples too when there are at most 6 such terms).
  const std::size_t m = with_bs.size();
  const auto add = [&](std::vector<TermSet> pieces) {
    if (std::find(shapes.begin(), shapes.end(), pieces) == shapes.end()) shapes.push_back(std::move(pieces));
  };
  for (std::size_t a = 0; a < m; ++a) {
    for (std::size_t b = a + 1; b < m; ++b) {
      add({{with_bs[a]}, {with_bs[b]}});
      for (std::size_t c = b + 1; c < m && m <= 6 && max_pieces >= 3; ++c) {
        add({{with_bs[a]}, {with_bs[b]}, {with_bs[c]}});
      }
    }
  }
  for (const std::vector<TermSet>& pieces : shapes) {
    const auto formula = selector.pieces_formula(pool, pieces);
    quick.push_back({selector.try_formula(formula.first, formula.second, false), formula});
  }
  std::sort(quick.begin(), quick.end());
  for (std::size_t i = 0; i < quick.size() && i < 3 && std::isfinite(quick[i].first); ++i) {
    selector.try_formula(quick[i].second.first, quick[i].second.second);
  }
}

// The candidates from the variables: linear sets, the floor, max() shapes (the header's list).
void generate_candidates(Selector& selector, const std::vector<Term>& pool, const TermSet& with_bs,
                         const FormulaSelectionOptions& options) {
  const auto linear = linear_sets(selector, pool, with_bs);
  TermSet shaped;  // the best linear set's terms (and the second's, together at most 4): the pieces
  for (std::size_t i = 0; i < linear.size() && i < 2 && std::isfinite(linear[i].first); ++i) {
    if (options.floor) selector.try_floor(pool, linear[i].second);
    TermSet joined = shaped;
    joined.insert(joined.end(), linear[i].second.begin(), linear[i].second.end());
    std::sort(joined.begin(), joined.end());
    joined.erase(std::unique(joined.begin(), joined.end()), joined.end());
    if (i == 0 || joined.size() <= 4) shaped = joined;
  }
  try_piece_shapes(selector, pool, shaped, with_bs, options.max_pieces);
}

}  // namespace

void FormulaSelectionOptions::validate() const {
  if (max_pieces < 1 || max_pieces > 3) {
    throw std::invalid_argument("FormulaSelectionOptions.max_pieces must be 1, 2 or 3, got " +
                                std::to_string(max_pieces));
  }
  if (!(size_penalty >= 0 && std::isfinite(size_penalty))) {
    throw std::invalid_argument("FormulaSelectionOptions.size_penalty must be finite and >= 0, got " +
                                detail::format_double(size_penalty));
  }
  fit.validate();
}

namespace {

std::size_t batch_size_index(const std::vector<std::string>& variable_names, const std::string& name) {
  const auto bs = std::find(variable_names.begin(), variable_names.end(), name);
  if (bs == variable_names.end()) {
    throw std::invalid_argument("select_formula: the batch-size variable '" + name +
                                "' is not one of the variables");
  }
  return static_cast<std::size_t>(bs - variable_names.begin());
}

}  // namespace

std::string all_terms_formula(const std::vector<std::string>& variable_names,
                              const std::string& batch_size_variable, const std::string& prefix) {
  const std::vector<Term> pool = term_pool(variable_names.size(), batch_size_index(variable_names, batch_size_variable),
                                             std::vector<bool>(variable_names.size(), false));
  TermSet all(pool.size());
  for (std::size_t i = 0; i < pool.size(); ++i) all[i] = i;
  const Namer name(variable_names);
  return piece_text(pool, all, prefix + "a", prefix + "c", variable_names, name);
}

FormulaSelection select_formula(const std::vector<std::string>& variable_names,
                                const std::vector<Measurement>& measurements,
                                const std::vector<InfeasibleBound>& bounds,
                                const FormulaSelectionOptions& options) {
  options.validate();
  detail::validate_measurements("select_formula", variable_names, measurements);  // before any candidate
  const std::size_t bs = batch_size_index(variable_names, options.batch_size_variable);
  const std::vector<bool> summed = summed_flags(variable_names, options);
  const std::vector<Term> pool = term_pool(variable_names.size(), bs, summed);
  Selector selector(variable_names, measurements, bounds, options);
  TermSet with_bs;  // the terms that grow with the records
  for (std::size_t t = 0; t < pool.size(); ++t) {
    if (grows_with_records(pool[t], bs, summed)) with_bs.push_back(t);
  }
  if (options.formulas.empty()) {
    generate_candidates(selector, pool, with_bs, options);
  } else {
    for (const std::string& text : options.formulas) {
      selector.try_formula(text, CostFormula::with_variables(text, variable_names).coefficient_names().size());
    }
  }
  std::vector<Tried>& tried = selector.tried();
  std::size_t best = tried.size();
  for (std::size_t i = 0; i < tried.size(); ++i) {
    if (!tried[i].formula) continue;
    const auto rank = [&](std::size_t j) {
      return std::make_tuple(!tried[j].candidate.usable, tried[j].candidate.score,
                             tried[j].candidate.coefficient_count);
    };
    if (best == tried.size() || rank(i) < rank(best)) best = i;
  }
  if (best == tried.size()) {
    throw std::invalid_argument("select_formula: no candidate formula could be fitted to " +
                                std::to_string(measurements.size()) + " measurements (first: " +
                                (tried.empty() ? std::string("none") : tried.front().candidate.note) + ")");
  }
  FormulaSelection out{*tried[best].formula, tried[best].fit, {}, best, {}};
  for (const Tried& t : tried) out.candidates.push_back(t.candidate);
  out.alternatives = selector.alternatives(tried[best].formula->text(), 4);
  return out;
}

std::string FormulaSelection::report() const {
  std::ostringstream os;
  os << "formula chosen from the probes: " << formula.canonical() << " (" << candidates.size()
     << " candidates; ranked by root-mean-square held-out error + a penalty per coefficient)\n";
  std::vector<std::size_t> order(candidates.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return candidates[a].score < candidates[b].score;
  });
  for (std::size_t i : order) {
    const FormulaCandidate& c = candidates[i];
    os << (i == chosen ? "* " : "  ") << c.text << ": " << c.coefficient_count << " coefficients";
    if (!c.note.empty()) {
      os << ", " << c.note << "\n";
      continue;
    }
    os << ", fit " << detail::percent(c.max_rel_error) << ", held-out "
       << (std::isnan(c.held_out_max_rel_error)
               ? std::string("not computed")
               : detail::percent(c.held_out_rms_rel_error) + " rms, " + detail::percent(c.held_out_max_rel_error) + " max")
       << (c.usable ? "" : ", not usable") << "\n";
  }
  return os.str();
}

}  // namespace xpm
