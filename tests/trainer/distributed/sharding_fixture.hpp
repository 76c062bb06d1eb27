// Shared by the sharded-optimizer tests and their worker program (xpm-sharding-worker): real
// Brown sentences, the model built from them, the per-rank gradient of a step, and a launcher
// that runs the worker as a world of N processes over c10d/gloo on loopback.
#pragma once

#include <cstdint>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <torch/torch.h>

#include "xpm/tasks/brown_corpus.hpp"
#include "xpm/tasks/tagging_batch.hpp"
#include "xpm/tasks/transformer_tagger.hpp"

extern char** environ;

namespace sharding_fixture {

constexpr std::int64_t kGlobalBatchSentences = 16;  // per optimizer step, both ranks together
constexpr int kWorld = 2;

struct Corpus {
  std::vector<xpm::EncodedSentence> sentences;
  std::int64_t vocab_size = 0;
  std::int64_t num_tags = 0;
};

// Four real files of the Brown corpus (news, editorial, reviews), encoded with their own
// vocabulary (every word, so no unknowns) and tag set.
inline Corpus load_corpus() {
  std::vector<xpm::TaggedSentence> sentences;
  for (const char* name : {"ca01", "ca02", "cb01", "cc01"}) {
    const std::string path = std::string(XPM_SOURCE_DIR) + "/data/brown/" + name;
    std::ifstream in(path);
    if (!in) throw std::runtime_error("cannot read " + path);
    std::stringstream text;
    text << in.rdbuf();
    for (auto& s : xpm::parse_brown_text(text.str(), path)) sentences.push_back(std::move(s));
  }
  const xpm::Vocabulary vocab = xpm::Vocabulary::build(sentences, 1 << 20, 1);
  const xpm::TagSet tags = xpm::TagSet::build(sentences);
  Corpus corpus;
  corpus.sentences = xpm::encode(sentences, vocab, tags);
  corpus.vocab_size = static_cast<std::int64_t>(vocab.size());
  corpus.num_tags = static_cast<std::int64_t>(tags.size());
  return corpus;
}

// Small enough for a quick test, the bundled architecture; no dropout, so every process computes
// bit-identical gradients from the same batch.
inline xpm::TransformerTaggerOptions model_options(const Corpus& corpus) {
  xpm::TransformerTaggerOptions options;
  options.vocab_size = corpus.vocab_size;
  options.num_tags = corpus.num_tags;
  options.d_model = 32;
  options.nhead = 4;
  options.dim_feedforward = 64;
  options.num_layers = 2;
  options.dropout = 0.0;
  options.max_length = 256;
  return options;
}

inline xpm::TransformerTagger make_model(const Corpus& corpus) {
  torch::manual_seed(11);
  return xpm::TransformerTagger(model_options(corpus));
}

// Sentence ids of `rank`'s half of step `step`'s global batch (rank 0 the first half).
inline std::vector<std::size_t> rank_records(const Corpus& corpus, std::int64_t step, int rank) {
  std::vector<std::size_t> ids;
  const std::int64_t half = kGlobalBatchSentences / kWorld;
  for (std::int64_t i = 0; i < half; ++i) {
    ids.push_back(static_cast<std::size_t>((step * kGlobalBatchSentences + rank * half + i) %
                                           static_cast<std::int64_t>(corpus.sentences.size())));
  }
  return ids;
}

inline std::int64_t global_tokens(const Corpus& corpus, std::int64_t step) {
  std::int64_t tokens = 0;
  for (int rank = 0; rank < kWorld; ++rank) {
    for (std::size_t id : rank_records(corpus, step, rank)) {
      tokens += static_cast<std::int64_t>(corpus.sentences[id].token_ids.size());
    }
  }
  return tokens;
}

// Backward of rank's share of the step's mean token loss (its summed loss / global tokens):
// gradients accumulate into .grad, as in a data-parallel step (docs/design.md section 4).
inline void backward_rank_share(xpm::TransformerTagger& model, const Corpus& corpus, std::int64_t step, int rank) {
  const xpm::TaggingBatch batch = xpm::collate(corpus.sentences, rank_records(corpus, step, rank));
  const torch::Tensor loss =
      xpm::token_cross_entropy_sum(model->forward(batch.token_ids, batch.padding_mask), batch.tag_ids) /
      static_cast<double>(global_tokens(corpus, step));
  loss.backward();
}

inline void save_tensors(const std::vector<torch::Tensor>& tensors, const std::string& path) {
  torch::serialize::OutputArchive archive;
  for (std::size_t i = 0; i < tensors.size(); ++i) archive.write(std::to_string(i), tensors[i]);
  archive.save_to(path);
}

inline std::vector<torch::Tensor> load_tensors(const std::string& path) {
  torch::serialize::InputArchive archive;
  archive.load_from(path);
  std::vector<torch::Tensor> out;
  for (std::size_t i = 0;; ++i) {
    torch::Tensor tensor;  // a fresh one each time: try_read set_()s into a defined tensor
    if (!archive.try_read(std::to_string(i), tensor)) return out;
    out.push_back(tensor);
  }
}

inline int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;
  ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address);
  socklen_t length = sizeof address;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  const int port = ntohs(address.sin_port);
  ::close(fd);
  return port;
}

// Runs `program arguments...` as ranks 0..world-1 (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
// set as torchrun does), each rank's output in `log_prefix`<rank>.log. Returns the exit codes.
inline std::vector<int> run_world(const std::string& program, const std::vector<std::string>& arguments,
                                  int world, const std::string& log_prefix) {
  const int port = free_port();
  std::vector<pid_t> pids;
  for (int rank = 0; rank < world; ++rank) {
    std::vector<std::string> env_strings = {"RANK=" + std::to_string(rank), "WORLD_SIZE=" + std::to_string(world),
                                            "LOCAL_RANK=" + std::to_string(rank),
                                            "LOCAL_WORLD_SIZE=" + std::to_string(world),
                                            "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + std::to_string(port)};
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string entry = *e;
      bool replaced = false;
      for (const char* name : {"RANK=", "WORLD_SIZE=", "LOCAL_RANK=", "LOCAL_WORLD_SIZE=", "MASTER_ADDR=", "MASTER_PORT="}) {
        replaced = replaced || entry.rfind(name, 0) == 0;
      }
      if (!replaced) env_strings.push_back(entry);
    }
    std::vector<char*> envp;
    for (std::string& s : env_strings) envp.push_back(s.data());
    envp.push_back(nullptr);
    std::vector<std::string> argv_strings = {program};
    argv_strings.insert(argv_strings.end(), arguments.begin(), arguments.end());
    std::vector<char*> argv;
    for (std::string& s : argv_strings) argv.push_back(s.data());
    argv.push_back(nullptr);
    const std::string log = log_prefix + std::to_string(rank) + ".log";
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&actions, 1, 2);
    pid_t pid = 0;
    if (posix_spawn(&pid, program.c_str(), &actions, nullptr, argv.data(), envp.data()) != 0) {
      throw std::runtime_error("cannot start " + program);
    }
    posix_spawn_file_actions_destroy(&actions);
    pids.push_back(pid);
  }
  std::vector<int> codes;
  for (pid_t pid : pids) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    codes.push_back(WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
  }
  return codes;
}

inline std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace sharding_fixture
