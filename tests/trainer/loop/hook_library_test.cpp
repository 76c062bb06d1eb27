// LayerFreezer, LayerSharer, GradientClipper (hook_library.hpp) and HookList (hooks.hpp) on a
// tiny language model trained with real AdamW steps (weight decay on, so a parameter the
// optimizer touched always moves): frozen parameters stay bitwise equal and AdamW keeps no
// state for them; until_step unfreezes; tied parameters stay equal, their gradient is the one
// of a single shared matrix (computed functionally as a second method) and AdamW holds one
// copy; clipping matches a hand computation of the global norm; hooks run in order.
#include "torch_doctest.hpp"

#include <cmath>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "xpm/trainer/loop/hook_library.hpp"
#include "xpm/trainer/loop/hooks.hpp"
#include "xpm/trainer/loop/train_context.hpp"

namespace {

namespace F = torch::nn::functional;

// Predicts the next token: embedding [vocab, dim] -> tanh(hidden) -> output [vocab, dim] + bias.
struct TinyLmImpl : torch::nn::Module {
  TinyLmImpl(std::int64_t vocab, std::int64_t dim)
      : embedding(register_module("embedding", torch::nn::Embedding(vocab, dim))),
        hidden(register_module("hidden", torch::nn::Linear(dim, dim))),
        output(register_module("output", torch::nn::Linear(dim, vocab))) {}
  torch::Tensor forward(const torch::Tensor& ids) {
    return output(torch::tanh(hidden(embedding(ids))));
  }
  torch::nn::Embedding embedding;
  torch::nn::Linear hidden, output;
};
TORCH_MODULE(TinyLm);

constexpr std::int64_t kVocab = 11;
constexpr std::int64_t kDim = 6;

TinyLm make_model() {
  torch::manual_seed(5);
  TinyLm model(kVocab, kDim);
  model->to(torch::kFloat64);
  return model;
}

torch::Tensor batch_ids(std::int64_t step) {
  torch::manual_seed(100 + step);
  return torch::randint(0, kVocab, {16}, torch::kLong);
}

// Sum of next-token cross-entropies over a random sequence.
torch::Tensor loss_of(TinyLm& model, std::int64_t step) {
  const torch::Tensor ids = batch_ids(step);
  const torch::Tensor logits = model->forward(ids.slice(0, 0, -1));
  return F::cross_entropy(logits, ids.slice(0, 1), F::CrossEntropyFuncOptions().reduction(torch::kSum));
}

torch::optim::AdamW make_adamw(TinyLm& model) {
  return torch::optim::AdamW(model->parameters(),
                             torch::optim::AdamWOptions(0.05).weight_decay(0.1));
}

// One training step as the Learner runs it, with the hook points in their documented order.
void train_steps(TinyLm& model, torch::optim::Optimizer& optimizer, xpm::HookList& hooks,
                 xpm::TrainerContext& context, std::int64_t steps) {
  for (std::int64_t i = 0; i < steps; ++i) {
    hooks.before_step(context);
    optimizer.zero_grad();
    loss_of(model, context.state().step).backward();
    hooks.before_optimizer_step(context);
    optimizer.step();
    ++context.state().step;
    hooks.after_step(context);
  }
}

bool has_state(const torch::optim::Optimizer& optimizer, const torch::Tensor& parameter) {
  return optimizer.state().count(parameter.unsafeGetTensorImpl()) != 0;
}

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no exception)";
}

}  // namespace

TEST_CASE("a layer freezer keeps frozen parameters bitwise unchanged through AdamW steps and AdamW keeps no state for them") {
  TinyLm model = make_model();
  xpm::TrainState state;
  state.model = model.get();
  xpm::TrainerContext context(state);
  xpm::HookList hooks;
  auto freezer = std::make_shared<xpm::LayerFreezer>(xpm::LayerFreezerOptions{"^embedding\\.", {}});
  hooks.add(freezer);
  // A gradient allocated by earlier code (as a setup that preallocates gradients does).
  model->embedding->weight.mutable_grad() = torch::ones_like(model->embedding->weight);
  hooks.before_initialization(context);
  hooks.after_initialization(context);
  CHECK(freezer->parameter_names() == std::vector<std::string>{"embedding.weight"});
  CHECK(freezer->frozen());
  CHECK_FALSE(model->embedding->weight.requires_grad());
  CHECK_FALSE(model->embedding->weight.grad().defined());  // freed

  torch::optim::AdamW optimizer = make_adamw(model);  // built after, from all the parameters
  state.optimizer = &optimizer;
  const torch::Tensor embedding_before = model->embedding->weight.detach().clone();
  const torch::Tensor hidden_before = model->hidden->weight.detach().clone();
  train_steps(model, optimizer, hooks, context, 5);

  CHECK(torch::equal(model->embedding->weight.detach(), embedding_before));
  CHECK_FALSE(model->embedding->weight.grad().defined());
  CHECK_FALSE(has_state(optimizer, model->embedding->weight));
  CHECK(optimizer.state().size() == 4);  // hidden and output, weight and bias
  CHECK(has_state(optimizer, model->hidden->weight));
  CHECK((model->hidden->weight.detach() - hidden_before).abs().max().item<double>() > 1e-3);
}

TEST_CASE("a layer freezer with until_step unfreezes at that step and AdamW then starts updating the parameters") {
  TinyLm model = make_model();
  xpm::TrainState state;
  state.model = model.get();
  xpm::TrainerContext context(state);
  xpm::HookList hooks;
  auto freezer =
      std::make_shared<xpm::LayerFreezer>(xpm::LayerFreezerOptions{"^output\\.(weight|bias)$", 3});
  hooks.add(freezer);
  hooks.after_initialization(context);
  CHECK(freezer->parameter_names() == std::vector<std::string>{"output.weight", "output.bias"});
  CHECK(freezer->unfreeze_step() == 3);
  torch::optim::AdamW optimizer = make_adamw(model);
  state.optimizer = &optimizer;
  const torch::Tensor before = model->output->weight.detach().clone();

  train_steps(model, optimizer, hooks, context, 3);  // steps 0, 1, 2: frozen
  CHECK(freezer->frozen());
  CHECK(torch::equal(model->output->weight.detach(), before));
  CHECK_FALSE(has_state(optimizer, model->output->weight));

  train_steps(model, optimizer, hooks, context, 1);  // step 3: before_step unfreezes
  CHECK_FALSE(freezer->frozen());
  CHECK(model->output->weight.requires_grad());
  CHECK(has_state(optimizer, model->output->weight));
  const auto& adamw_state = static_cast<const torch::optim::AdamWParamState&>(
      *optimizer.state().at(model->output->weight.unsafeGetTensorImpl()));
  CHECK(adamw_state.step() == 1);  // its first update
  CHECK((model->output->weight.detach() - before).abs().max().item<double>() > 1e-3);
}

TEST_CASE("a layer freezer does not freeze in a run resumed past its until_step") {
  TinyLm model = make_model();
  xpm::TrainState state;
  state.model = model.get();
  state.step = 7;
  xpm::TrainerContext context(state);
  xpm::LayerFreezer freezer(xpm::LayerFreezerOptions{"^hidden\\.", 5});
  freezer.after_initialization(context);
  CHECK(freezer.parameter_names().size() == 2);
  CHECK_FALSE(freezer.frozen());
  CHECK(model->hidden->weight.requires_grad());
}

TEST_CASE("a layer freezer refuses a bad regex, a pattern matching nothing and a model with an optimizer, naming the pattern") {
  CHECK(message_of([] { xpm::LayerFreezer f(xpm::LayerFreezerOptions{"embedding.(", {}}); })
            .find("'embedding.('") != std::string::npos);
  CHECK_THROWS_AS(xpm::LayerFreezer(xpm::LayerFreezerOptions{"embedding.(", {}}), std::invalid_argument);
  CHECK(message_of([] { xpm::LayerFreezer f(xpm::LayerFreezerOptions{"x", 0}); }).find("until_step") !=
        std::string::npos);

  TinyLm model = make_model();
  xpm::TrainState state;
  xpm::TrainerContext context(state);
  xpm::LayerFreezer no_match(xpm::LayerFreezerOptions{"^encoder\\.", {}});
  CHECK_THROWS_AS(no_match.after_initialization(context), std::invalid_argument);  // no model
  state.model = model.get();
  const std::string message = message_of([&] { no_match.after_initialization(context); });
  CHECK(message.find("'^encoder\\.'") != std::string::npos);
  CHECK(message.find("none of the model's 5 parameters") != std::string::npos);

  torch::optim::AdamW optimizer = make_adamw(model);
  state.optimizer = &optimizer;
  xpm::LayerFreezer late(xpm::LayerFreezerOptions{"^embedding\\.", {}});
  CHECK_THROWS_AS(late.after_initialization(context), std::logic_error);
}

TEST_CASE("a layer sharer ties the output matrix to the embedding: equal after AdamW steps, the gradient of one shared matrix, one parameter and one AdamW state") {
  TinyLm model = make_model();
  // Second method: the same network written functionally with ONE matrix W for both uses.
  const torch::Tensor W = model->embedding->weight.detach().clone().requires_grad_(true);
  const torch::Tensor hidden_w = model->hidden->weight.detach().clone();
  const torch::Tensor hidden_b = model->hidden->bias.detach().clone();
  const torch::Tensor output_b = model->output->bias.detach().clone();

  xpm::TrainState state;
  state.model = model.get();
  xpm::TrainerContext context(state);
  xpm::HookList hooks;
  auto sharer = std::make_shared<xpm::LayerSharer>(
      xpm::LayerSharerOptions{{{"output.weight", "embedding.weight"}}, false});
  hooks.add(sharer);
  REQUIRE(model->parameters().size() == 5);
  hooks.before_initialization(context);
  hooks.after_initialization(context);  // already tied: no-op
  CHECK(sharer->tied().size() == 1);
  CHECK(model->parameters().size() == 4);  // the output matrix is the embedding
  CHECK_FALSE(model->named_parameters().contains("output.weight"));
  CHECK(model->output->weight.data_ptr() == model->embedding->weight.data_ptr());
  CHECK(torch::equal(model->output->weight, model->embedding->weight));

  // Gradient: both uses flow into the embedding's .grad.
  loss_of(model, 0).backward();
  const torch::Tensor ids = batch_ids(0);
  const torch::Tensor h = torch::tanh(F::linear(F::embedding(ids.slice(0, 0, -1), W), hidden_w, hidden_b));
  F::cross_entropy(F::linear(h, W, output_b), ids.slice(0, 1),
                   F::CrossEntropyFuncOptions().reduction(torch::kSum))
      .backward();
  const double scale = W.grad().abs().max().item<double>();
  CHECK((model->embedding->weight.grad() - W.grad()).abs().max().item<double>() / scale < 1e-12);
  model->zero_grad();

  torch::optim::AdamW optimizer = make_adamw(model);
  state.optimizer = &optimizer;
  const torch::Tensor before = model->embedding->weight.detach().clone();
  train_steps(model, optimizer, hooks, context, 4);
  CHECK(torch::equal(model->output->weight, model->embedding->weight));
  CHECK((model->embedding->weight.detach() - before).abs().max().item<double>() > 1e-3);
  CHECK(optimizer.state().size() == 4);  // one state for the tied pair
  std::size_t listed = 0;
  for (const auto& group : optimizer.param_groups()) listed += group.params().size();
  CHECK(listed == 4);
}

TEST_CASE("a checkpoint of a tied model loads into a model tied the same way") {
  TinyLm trained = make_model();
  xpm::TrainState state;
  state.model = trained.get();
  xpm::TrainerContext context(state);
  xpm::LayerSharer sharer(xpm::LayerSharerOptions{{{"output.weight", "embedding.weight"}}, false});
  sharer.before_initialization(context);
  {
    torch::NoGradGuard no_grad;
    trained->embedding->weight.add_(1.5);  // differs from a fresh model
  }
  std::stringstream bytes;
  torch::serialize::OutputArchive out;
  for (const auto& item : trained->named_parameters()) out.write(item.key(), item.value());
  out.save_to(bytes);

  TinyLm fresh = make_model();
  xpm::TrainState fresh_state;
  fresh_state.model = fresh.get();
  xpm::TrainerContext fresh_context(fresh_state);
  xpm::LayerSharer fresh_sharer(xpm::LayerSharerOptions{{{"output.weight", "embedding.weight"}}, false});
  fresh_sharer.before_initialization(fresh_context);  // tie, then load (hooks.hpp order)
  torch::serialize::InputArchive in;
  in.load_from(bytes);
  torch::NoGradGuard no_grad;
  for (auto& item : fresh->named_parameters()) {
    torch::Tensor stored;
    REQUIRE(in.try_read(item.key(), stored));
    item.value().copy_(stored);
  }
  CHECK(torch::equal(fresh->output->weight, trained->embedding->weight));
  CHECK(torch::equal(fresh->embedding->weight, trained->embedding->weight));
}

TEST_CASE("a layer sharer in regex mode ties every matching target to its formatted source") {
  struct TwoTowersImpl : torch::nn::Module {
    TwoTowersImpl() {
      for (int i = 0; i < 2; ++i) {
        enc.push_back(register_module("enc" + std::to_string(i), torch::nn::Linear(3, 3)));
        dec.push_back(register_module("dec" + std::to_string(i), torch::nn::Linear(3, 3)));
      }
    }
    std::vector<torch::nn::Linear> enc, dec;
  };
  auto model = std::make_shared<TwoTowersImpl>();
  xpm::TrainState state;
  state.model = model.get();
  xpm::TrainerContext context(state);
  xpm::LayerSharer sharer(xpm::LayerSharerOptions{{{"dec(\\d)\\.weight", "enc$1.weight"}}, true});
  sharer.after_initialization(context);
  CHECK(sharer.tied() == std::vector<std::pair<std::string, std::string>>{
                             {"dec0.weight", "enc0.weight"}, {"dec1.weight", "enc1.weight"}});
  CHECK(model->parameters().size() == 6);
  CHECK(model->dec[1]->weight.data_ptr() == model->enc[1]->weight.data_ptr());
  CHECK(model->dec[0]->bias.data_ptr() != model->enc[0]->bias.data_ptr());
}

TEST_CASE("a layer sharer refuses ties it cannot make, naming the parameters") {
  TinyLm model = make_model();
  xpm::TrainState state;
  state.model = model.get();
  xpm::TrainerContext context(state);
  const auto tie_error = [&](xpm::LayerSharerOptions options) {
    return message_of([&] { xpm::LayerSharer(options).before_initialization(context); });
  };
  const std::string shapes = tie_error({{{"hidden.weight", "embedding.weight"}}, false});
  CHECK(shapes.find("'hidden.weight' ([6, 6] Double on cpu)") != std::string::npos);
  CHECK(shapes.find("'embedding.weight' ([11, 6] Double on cpu)") != std::string::npos);
  CHECK(tie_error({{{"nothing.weight", "embedding.weight"}}, false}).find("'nothing.weight'") !=
        std::string::npos);
  CHECK(tie_error({{{"output.weight", "missing.weight"}}, false}).find("'missing.weight'") !=
        std::string::npos);
  CHECK(tie_error({{{"output.weight", "output.weight"}}, false}).find("tied to itself") !=
        std::string::npos);
  CHECK(tie_error({{{"output.(", "x"}}, true}).find("'output.('") != std::string::npos);
  CHECK_THROWS_AS(xpm::LayerSharer(xpm::LayerSharerOptions{}), std::invalid_argument);
  CHECK(model->parameters().size() == 5);  // nothing tied by a refused tie
}

TEST_CASE("freezing the source of a tied pair freezes both uses") {
  TinyLm model = make_model();
  xpm::TrainState state;
  state.model = model.get();
  xpm::TrainerContext context(state);
  xpm::HookList hooks;
  hooks.add(std::make_shared<xpm::LayerSharer>(
      xpm::LayerSharerOptions{{{"output.weight", "embedding.weight"}}, false}));
  hooks.add(std::make_shared<xpm::LayerFreezer>(xpm::LayerFreezerOptions{"^embedding\\.", {}}));
  hooks.before_initialization(context);
  hooks.after_initialization(context);
  torch::optim::AdamW optimizer = make_adamw(model);
  state.optimizer = &optimizer;
  const torch::Tensor before = model->embedding->weight.detach().clone();
  train_steps(model, optimizer, hooks, context, 3);
  CHECK(torch::equal(model->embedding->weight.detach(), before));
  CHECK(torch::equal(model->output->weight.detach(), before));
  CHECK_FALSE(model->embedding->weight.grad().defined());
  CHECK(optimizer.state().size() == 3);  // hidden weight and bias, output bias
}

TEST_CASE("a gradient clipper scales the gradients by max_norm over the global norm computed by hand and records the pre-clip norm") {
  TinyLm model = make_model();
  torch::optim::AdamW optimizer = make_adamw(model);
  xpm::TrainState state;
  state.model = model.get();
  state.optimizer = &optimizer;
  xpm::TrainerContext context(state);
  loss_of(model, 0).backward();
  std::vector<torch::Tensor> before;
  double squares = 0;  // by hand: sum of squares of every gradient entry
  for (const auto& p : model->parameters()) {
    before.push_back(p.grad().clone());
    const auto g = p.grad().contiguous();
    const double* data = g.data_ptr<double>();
    for (std::int64_t i = 0; i < g.numel(); ++i) squares += data[i] * data[i];
  }
  const double norm = std::sqrt(squares);
  REQUIRE(norm > 1.0);

  xpm::GradientClipper clipper(xpm::GradientClipperOptions{norm / 4, 2.0});
  {
    auto scope = context.scope("train");
    clipper.before_optimizer_step(context);
  }
  CHECK(clipper.last_norm() == doctest::Approx(norm).epsilon(1e-12));
  CHECK(context.metrics().at("train/grad_norm") == doctest::Approx(norm).epsilon(1e-12));
  const double factor = (norm / 4) / (norm + 1e-6);
  double clipped_squares = 0;
  const auto parameters = model->parameters();
  for (std::size_t i = 0; i < parameters.size(); ++i) {
    const double scale = before[i].abs().max().item<double>() + 1e-300;
    CHECK((parameters[i].grad() - before[i] * factor).abs().max().item<double>() / scale < 1e-12);
    clipped_squares += parameters[i].grad().pow(2).sum().item<double>();
  }
  CHECK(std::sqrt(clipped_squares) == doctest::Approx(norm / 4).epsilon(1e-6));

  // Below max_norm: unchanged.
  xpm::GradientClipper loose(xpm::GradientClipperOptions{1e6, 2.0});
  const torch::Tensor g0 = parameters[0].grad().clone();
  loose.before_optimizer_step(context);
  CHECK(torch::equal(parameters[0].grad(), g0));
  CHECK(context.metrics().at("grad_norm") == doctest::Approx(norm / 4).epsilon(1e-6));
  CHECK_THROWS_AS(xpm::GradientClipper(xpm::GradientClipperOptions{0.0, 2.0}), std::invalid_argument);
  CHECK_THROWS_AS(xpm::GradientClipper(xpm::GradientClipperOptions{1.0, -1.0}), std::invalid_argument);
}

namespace {

// Implements every interface and logs "<name>:<point>".
struct CountingHook : xpm::InitializationTrainingHook, xpm::StepTrainingHook, xpm::ValidationHook {
  CountingHook(std::string hook_name, std::vector<std::string>& log) : name_(std::move(hook_name)), log_(log) {}
  std::string name() const override { return name_; }
  void before_initialization(xpm::TrainerContext&) override { log_.push_back(name_ + ":before_initialization"); }
  void after_initialization(xpm::TrainerContext&) override { log_.push_back(name_ + ":after_initialization"); }
  void before_step(xpm::TrainerContext&) override { log_.push_back(name_ + ":before_step"); }
  void before_optimizer_step(xpm::TrainerContext&) override { log_.push_back(name_ + ":before_optimizer_step"); }
  void after_step(xpm::TrainerContext&) override { log_.push_back(name_ + ":after_step"); }
  void before_validation(xpm::TrainerContext&) override { log_.push_back(name_ + ":before_validation"); }
  void after_validation(xpm::TrainerContext&) override { log_.push_back(name_ + ":after_validation"); }
  std::string name_;
  std::vector<std::string>& log_;
};

struct NotAHook : xpm::TrainingHook {
  std::string name() const override { return "not-a-hook"; }
};

}  // namespace

TEST_CASE("a hook list calls every hook once per point, in registration order") {
  std::vector<std::string> log;
  xpm::HookList hooks;
  hooks.add(std::make_shared<CountingHook>("a", log));
  hooks.add(std::make_shared<CountingHook>("b", log));
  CHECK(hooks.size() == 2);
  TinyLm model = make_model();
  xpm::TrainState state;
  state.model = model.get();
  xpm::TrainerContext context(state);
  hooks.before_initialization(context);
  hooks.after_initialization(context);
  torch::optim::AdamW optimizer = make_adamw(model);
  train_steps(model, optimizer, hooks, context, 2);
  hooks.before_validation(context);
  hooks.after_validation(context);
  const std::vector<std::string> step = {"a:before_step", "b:before_step", "a:before_optimizer_step",
                                         "b:before_optimizer_step", "a:after_step", "b:after_step"};
  std::vector<std::string> expected = {"a:before_initialization", "b:before_initialization",
                                       "a:after_initialization", "b:after_initialization"};
  expected.insert(expected.end(), step.begin(), step.end());
  expected.insert(expected.end(), step.begin(), step.end());
  expected.insert(expected.end(), {"a:before_validation", "b:before_validation",
                                   "a:after_validation", "b:after_validation"});
  CHECK(log == expected);
  CHECK_THROWS_AS(hooks.add(nullptr), std::invalid_argument);
  CHECK(message_of([&] { hooks.add(std::make_shared<NotAHook>()); }).find("'not-a-hook'") !=
        std::string::npos);
}
