// What every `loom` command does the same way with its arguments: --help, a
// flag's value in either form (--steps=3 or --steps 3), and the output paths
// a command writes at its end, checked before its work.
#pragma once
#include <optional>
#include <string>
#include <string_view>

#include "commands.hpp"

namespace loom::app {

// -h or --help anywhere among `args` but as the value of --set.
bool wants_help(const Args& args);

// args[i] is the flag `name` with its value, "--name=value" or "--name value":
// returns the value and leaves i on the last argument used; nullopt when
// args[i] is anything else. "--name" last, or followed by another option
// ("--..."), is refused naming both forms.
std::optional<std::string> flag_value(const Args& args, size_t& i, std::string_view name);

// A folder a command writes into after its work (compare --out): walked as
// run.out_dir is (train/outputs.hpp check_output_walk), created now and
// written to (a small file created and removed), so that a place that cannot
// hold the output is refused before the work, naming the flag, the path and
// why (a file in the way, a link to nowhere, /proc, /sys or /dev, a read-only
// or full file system, no permission).
void check_output_folder(std::string_view flag, const std::string& dir);
// A file a command writes after its work (bench --json): a name, not a
// folder, in a folder check_output_folder accepts; an existing file must be
// writable. Nothing is created but missing folders.
void check_output_file(std::string_view flag, const std::string& file);

}  // namespace loom::app
