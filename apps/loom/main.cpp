// `loom`: train, check, plugins, prepare, bench, convert, compare, plot.
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <new>
#include <string>

#include "comm/launch.hpp"
#include "commands.hpp"
#include "loom/error.hpp"
#include "loom/version.hpp"

namespace {
void usage() {
  std::printf(
      "loom %s — a Llama trainer with pluggable precision, attention, sharding and data\n\n"
      "usage: loom <command> [args]\n\n"
      "  train CONFIG [--set k=v]...   train a model (mpirun/srun for several ranks)\n"
      "  check CONFIG [--set k=v]... [--world N [--gpus-per-node G]] [--no-scan]\n"
      "                                validate a config, print model size and memory plan (of N ranks),\n"
      "                                read every token of the data against the vocabulary (not with --no-scan)\n"
      "  plugins [--path DIR]...       list every plugin found, with kind, version and file\n"
      "  prepare text OUT INPUT...     turn UTF-8 text into token shards (--tokenizer: SentencePiece, tiktoken, tokenizer.json)\n"
      "  convert CKPT --to-hf DIR [--dtype fp32|bf16] [--force]\n"
      "                                export a checkpoint's weights as an HF Llama/Mixtral folder\n"
      "                                (--force: replace a model already in DIR, old shards and index too)\n"
      "  bench CONFIG [--steps N]      time training steps on synthetic data (median, tokens/s, MFU, memory)\n"
      "  compare CONFIG --strategies=a,b,...   run each sharding strategy (or --configs) for the same steps;\n"
      "                                table, CSV and PNG of step time, tokens/s, memory, traffic and losses\n"
      "  plot RUN_DIR... [--out F]     loss, validation loss, lr and tokens/s curves of runs (PNG)\n"
      "  version                       print version and build id\n\n"
      "'loom <command> --help' prints a command's own usage; flags that take a value accept --flag=V and --flag V.\n",
      loom::version_string());
}
// " (rank 3 of 8)" when this process is one rank of several.
std::string rank_tag() {
  const loom::LaunchInfo l = loom::launch_from_env();
  if (!l.under_launcher || l.world == 1) return "";
  return " (rank " + std::to_string(l.rank) + " of " + std::to_string(l.world) + ")";
}

// The message of an error, without a "loom <cmd>: " its thrower already put
// in front: main names the command itself ("loom check: error: ...").
std::string message_of(const std::string& cmd, const char* what) {
  const std::string own = "loom " + cmd + ": ", msg = what;
  return msg.rfind(own, 0) == 0 ? msg.substr(own.size()) : msg;
}

// After an error on one rank the others may be waiting in a collective that
// will never come: take the whole job down instead of leaving them to time out.
void stop_all_ranks(int code) {
  const loom::LaunchInfo l = loom::launch_from_env();
  if (l.under_launcher && l.world != 1 && loom::mpi_initialized()) loom::abort_all(code);
}
}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || !std::strcmp(argv[1], "-h") || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "help")) {
    usage();
    return argc < 2 ? 2 : 0;
  }
  std::string cmd = argv[1];
  loom::app::Args args(argv + 2, argv + argc);
  try {
    if (cmd == "train") return loom::app::cmd_train(args);
    if (cmd == "check") return loom::app::cmd_check(args);
    if (cmd == "plugins") return loom::app::cmd_plugins(args);
    if (cmd == "prepare") return loom::app::cmd_prepare(args);
    if (cmd == "convert") return loom::app::cmd_convert(args);
    if (cmd == "bench") return loom::app::cmd_bench(args);
    if (cmd == "compare") return loom::app::cmd_compare(args);
    if (cmd == "plot") return loom::app::cmd_plot(args);
    if (cmd == "version" || cmd == "--version") {
      if (!args.empty()) throw loom::Error(loom::cat("takes no arguments, got '", args.front(), "'; usage: loom version"));
      std::printf("loom %s (%s)\n", loom::version_string(), loom::build_id());
      return 0;
    }
    std::fprintf(stderr, "loom: unknown command '%s'. Run 'loom --help' for the list.\n", cmd.c_str());
    return 2;
  } catch (const loom::Error& e) {
    std::fprintf(stderr, "loom %s%s: error: %s\n", cmd.c_str(), rank_tag().c_str(), message_of(cmd, e.what()).c_str());
    stop_all_ranks(1);
    return 1;
  } catch (const std::filesystem::filesystem_error& e) {
    // Paths a user names are checked with their key first (run.out_dir,
    // checkpoint.dir, ...); whatever file system failure is left is still the
    // user's to fix, so it is an error naming the paths, not an internal one.
    std::fprintf(stderr, "loom %s%s: error: %s (%s%s%s)\n", cmd.c_str(), rank_tag().c_str(), e.code().message().c_str(),
                 e.path1().c_str(), e.path2().empty() ? "" : ", ", e.path2().c_str());
    stop_all_ranks(1);
    return 1;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "loom %s%s: error: out of memory; 'loom check' prints the memory plan of a config\n",
                 cmd.c_str(), rank_tag().c_str());
    stop_all_ranks(1);
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "loom %s%s: internal error: %s\n", cmd.c_str(), rank_tag().c_str(), e.what());
    stop_all_ranks(3);
    return 3;
  }
}
