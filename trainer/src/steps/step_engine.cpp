#include "xpm/trainer/steps/step_engine.hpp"

#include <stdexcept>
#include <string>
#include <utility>

namespace xpm {

void StepEngine::check_world_size(int world_size) const {
  if (world_size > 1) {
    throw std::invalid_argument("this step engine runs in a single process only, got world_size " +
                                std::to_string(world_size) + ": data parallelism needs the predictive one");
  }
}

void StepEngine::set_loss_scaler(DynamicLossScaler* scaler) {
  if (scaler != nullptr) throw std::invalid_argument("this step engine does not scale losses");
}

}  // namespace xpm
