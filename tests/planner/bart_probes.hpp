// bart_probes.hpp — measured probes of a small BART (1.26 M parameters, random weights) under
// the HF Seq2SeqTrainer on a CPU capped at 40 MB, dims {bs, ls, lt} (records, source and
// target length): the forward-backward peaks above its optimizer step (20,140,988 bytes) and
// the probes that ran out of memory. Real measurements for the fit and selection tests.
#pragma once

#include <vector>

#include "xpm/planner/fit.hpp"

namespace xpm_test {

inline std::vector<xpm::Measurement> bart_peaks() {
  return {{{1, 256, 96}, 31387336}, {{1, 36, 18}, 26859552}, {{2, 56, 24}, 28122688},
          {{4, 75, 42}, 37436696},  {{3, 67, 41}, 32436360}, {{1, 56, 23}, 27178752},
          {{2, 56, 23}, 28122688},  {{4, 56, 23}, 30675584}, {{1, 29, 28}, 26747832},
          {{2, 39, 35}, 27554208},  {{4, 47, 23}, 29991008}, {{1, 36, 16}, 26859552},
          {{2, 36, 16}, 27454848},  {{4, 36, 16}, 28624704}, {{6, 36, 16}, 30756232},
          {{1, 24, 15}, 26668032},  {{2, 29, 28}, 27224128}, {{4, 32, 29}, 30526640},
          {{8, 34, 23}, 37881472},  {{6, 33, 30}, 36248216}, {{3, 52, 23}, 28839648}};
}

inline std::vector<xpm::InfeasibleBound> bart_out_of_memory() {
  return {{{2, 256, 96}, 4e7}, {{8, 56, 51}, 4e7}, {{6, 56, 51}, 4e7},
          {{8, 50, 42}, 4e7},  {{6, 49, 37}, 4e7}, {{8, 36, 31}, 4e7}};
}

}  // namespace xpm_test
