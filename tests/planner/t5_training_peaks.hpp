// t5_training_peaks.hpp — a small T5 (random weights) trained under the HF Seq2SeqTrainer's
// drop-in on a CPU capped at 24 MB, dims {bs, ls, lt}: the memory model its probes gave ("auto"
// chose a max() of two pieces; a fit of its first microbatch's phase apart) and, per optimizer
// step of two epochs, every microbatch's dims, measured peak and position in its step. Real
// measurements for the training refit's tests: the probes' fit errs from -5.4 % to +4.3 % on
// the microbatches of a step's middle, differently from shape to shape.
#pragma once

#include <string>
#include <vector>

#include "xpm/planner/training_refit.hpp"

namespace xpm_test {

inline std::string t5_probed_model_json() {
  return
      R"json({"aggregation":{"bs":"count","ls":"max","lt":"max"},"batch_size_variable":"bs","coefficients":{"a1":)json"
      R"json(6093.722347086523,"a2":4200.165793151257,"a3":72.19678406153095,"a4":0.0,"b1":4725.9928558788515,"b2)json"
      R"json(":20187.411512525236,"b3":72.1013674009179,"b4":0.0,"c1":3483054.900431069,"c2":3173147.6025919584},)json"
      R"json("floor_bytes":3155084.0,"format_version":1,"formula":{"canonical":"max(a1*bs*ls + a2*bs*lt + a3*bs*l)json"
      R"json(s^2 + a4*lt + c1, b1*bs*ls + b2*bs*lt + b3*bs*ls^2 + b4*lt + c2)","coefficient_names":["a1","a2","a3)json"
      R"json(","a4","c1","b1","b2","b3","b4","c2"],"text":"max(a1*bs*ls + a2*bs*lt + a3*bs*ls^2 + a4*lt + c1, b1*)json"
      R"json(bs*ls + b2*bs*lt + b3*bs*ls^2 + b4*lt + c2)","variable_names":["bs","ls","lt"]},"infeasible_probes":)json"
      R"json([{"dims":[4.0,256.0,160.0],"exceeds_bytes":24000000.0},{"dims":[3.0,256.0,160.0],"exceeds_bytes":240)json"
      R"json(00000.0},{"dims":[8.0,135.0,117.0],"exceeds_bytes":24000000.0},{"dims":[6.0,124.0,88.0],"exceeds_byt)json"
      R"json(es":24000000.0},{"dims":[16.0,66.0,51.0],"exceeds_bytes":24000000.0},{"dims":[16.0,64.0,49.0],"excee)json"
      R"json(ds_bytes":24000000.0},{"dims":[32.0,38.0,32.0],"exceeds_bytes":24000000.0},{"dims":[24.0,38.0,32.0],)json"
      R"json("exceeds_bytes":24000000.0},{"dims":[32.0,36.0,32.0],"exceeds_bytes":24000000.0},{"dims":[4.0,256.0,)json"
      R"json(2.0],"exceeds_bytes":24000000.0}],"metadata":{"formula_selection":"chosen from the probes","phases":)json"
      R"json({"without_gradients":{"coefficients":{"a1":4765.376837831482,"a2":955.678394370966,"a3":74.562996889)json"
      R"json(5268,"a4":585.1912051716159,"b1":5020.3898137256065,"b2":19811.379791788793,"b3":70.69734007305748,")json"
      R"json(b4":0.0,"c1":3157833.8394584158,"c2":2390480.356067601},"fitted_points":37,"max_rel_error":0.0363367)json"
      R"json(7726856613,"single_record_factor":1.0}}},"probed_ranges":{"bs":[1.0,24.0],"ls":[19.0,256.0],"lt":[2.)json"
      R"json(0,160.0]}})json";
}

/// Per optimizer step (the first epoch's 10, then the second's), its microbatches.
inline std::vector<std::vector<xpm::TrainingPoint>> t5_training_steps() {
  using P = xpm::MicrobatchPosition;
  return {
      {{{2, 200, 160}, 14274028, P::kFirst}, {{2, 160, 94}, 10598152, P::kMiddle},
       {{6, 82, 48}, 12616028, P::kMiddle}, {{12, 56, 37}, 16468066, P::kMiddle},
       {{10, 25, 11}, 5657480, P::kLast}},
      {{{3, 156, 117}, 17389614, P::kFirst}, {{5, 95, 48}, 13383253, P::kMiddle},
       {{3, 69, 60}, 8924511, P::kMiddle}, {{9, 57, 36}, 14276473, P::kMiddle},
       {{12, 25, 18}, 9488356, P::kLast}},
      {{{4, 118, 81}, 15271586, P::kFirst}, {{5, 88, 62}, 14374844, P::kMiddle},
       {{13, 56, 37}, 19272942, P::kMiddle}, {{10, 26, 16}, 8191708, P::kLast}},
      {{{5, 129, 81}, 19491639, P::kFirst}, {{8, 67, 51}, 16580038, P::kMiddle},
       {{6, 45, 26}, 8538382, P::kMiddle}, {{13, 25, 14}, 9103885, P::kLast}},
      {{{1, 256, 160}, 11286144, P::kFirst}, {{3, 183, 125}, 20829385, P::kMiddle},
       {{3, 102, 88}, 12531356, P::kMiddle}, {{11, 68, 39}, 19015834, P::kMiddle},
       {{14, 30, 19}, 11517338, P::kLast}},
      {{{1, 256, 160}, 11282320, P::kFirst}, {{2, 244, 153}, 20359590, P::kMiddle},
       {{2, 174, 95}, 12882130, P::kMiddle}, {{6, 83, 49}, 14410500, P::kMiddle},
       {{10, 36, 24}, 10693024, P::kMiddle}, {{11, 18, 8}, 6331528, P::kLast}},
      {{{3, 132, 59}, 11276750, P::kFirst}, {{9, 62, 35}, 14679030, P::kMiddle},
       {{20, 31, 18}, 14918844, P::kLast}},
      {{{2, 247, 160}, 18229640, P::kFirst}, {{6, 106, 64}, 18666580, P::kMiddle},
       {{7, 68, 51}, 15020110, P::kMiddle}, {{6, 36, 28}, 8142772, P::kMiddle},
       {{11, 25, 14}, 8201767, P::kLast}},
      {{{1, 256, 114}, 9851704, P::kFirst}, {{2, 163, 117}, 13626304, P::kMiddle},
       {{4, 131, 93}, 18302006, P::kMiddle}, {{4, 107, 68}, 14001008, P::kMiddle},
       {{4, 56, 45}, 8817058, P::kMiddle}, {{8, 39, 27}, 9912774, P::kMiddle}, {{9, 12, 9}, 5413822, P::kLast}},
      {{{1, 256, 2}, 8978464, P::kFirst}, {{1, 158, 115}, 8082010, P::kMiddle},
       {{4, 132, 64}, 15458096, P::kMiddle}, {{9, 66, 48}, 17559840, P::kMiddle},
       {{8, 49, 32}, 11617000, P::kMiddle}, {{9, 20, 12}, 6537580, P::kLast}},
      {{{3, 179, 104}, 17892447, P::kFirst}, {{3, 107, 88}, 12803315, P::kMiddle},
       {{10, 75, 45}, 19806540, P::kMiddle}, {{16, 40, 22}, 15319772, P::kLast}},
      {{{1, 200, 160}, 9669800, P::kFirst}, {{5, 124, 81}, 19801338, P::kMiddle},
       {{11, 70, 46}, 20899156, P::kMiddle}, {{15, 27, 16}, 10843735, P::kLast}},
      {{{1, 256, 160}, 11283496, P::kFirst}, {{2, 183, 125}, 15091152, P::kMiddle},
       {{2, 129, 32}, 7814434, P::kMiddle}, {{10, 64, 49}, 19082566, P::kMiddle},
       {{17, 38, 25}, 16624594, P::kLast}},
      {{{1, 247, 160}, 10997124, P::kFirst}, {{1, 165, 61}, 6852174, P::kMiddle},
       {{3, 74, 51}, 8552970, P::kMiddle}, {{12, 54, 36}, 17489132, P::kMiddle},
       {{15, 25, 18}, 11053619, P::kLast}},
      {{{6, 118, 62}, 18866384, P::kFirst}, {{8, 66, 42}, 14976508, P::kMiddle},
       {{18, 43, 19}, 16458476, P::kLast}},
      {{{1, 256, 160}, 11282160, P::kFirst}, {{1, 244, 153}, 11475298, P::kMiddle},
       {{6, 95, 77}, 19370176, P::kMiddle}, {{7, 67, 39}, 13182373, P::kMiddle},
       {{17, 32, 20}, 13958576, P::kLast}},
      {{{1, 247, 102}, 9253668, P::kFirst}, {{2, 200, 160}, 18268084, P::kMiddle},
       {{3, 174, 117}, 19462994, P::kMiddle}, {{5, 124, 84}, 20196140, P::kMiddle},
       {{11, 67, 49}, 21140325, P::kMiddle}, {{10, 27, 23}, 9552512, P::kLast}},
      {{{1, 256, 2}, 8983160, P::kFirst}, {{2, 160, 117}, 13485574, P::kMiddle},
       {{3, 132, 45}, 11095566, P::kMiddle}, {{5, 88, 56}, 13710988, P::kMiddle},
       {{11, 56, 45}, 18574582, P::kMiddle}, {{10, 28, 21}, 9287606, P::kLast}},
      {{{4, 115, 81}, 15042654, P::kFirst}, {{7, 77, 53}, 16228261, P::kMiddle},
       {{7, 52, 32}, 10821712, P::kMiddle}, {{14, 25, 12}, 9075586, P::kLast}},
      {{{1, 256, 114}, 9845424, P::kFirst}, {{3, 131, 93}, 14575329, P::kMiddle},
       {{7, 83, 61}, 18099689, P::kMiddle}, {{8, 43, 30}, 10729412, P::kMiddle},
       {{13, 25, 14}, 9106585, P::kLast}},
  };
}

}  // namespace xpm_test
