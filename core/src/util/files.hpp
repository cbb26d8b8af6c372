// Opening files a user names without trusting what they are: a FIFO blocks
// open() until a writer comes, a device (/dev/zero) never ends, a directory
// or socket cannot be read as a file. Every input file Loom reads through a
// path (configs, token shards, checkpoint metadata, HF folders, plugin files)
// is checked here first, so each of those is one clear message instead of a
// hang or an out-of-memory kill.
#pragma once
#include <sys/types.h>

#include <cstddef>
#include <string>

namespace loom {

// "a FIFO (named pipe)", "a character device", "a directory", ... for st_mode.
std::string file_type_name(mode_t mode);

// Throws loom::Error unless `path` (symlinks followed) is a regular file,
// naming `what` ("config file", "token shard", ...), the path and its type.
// Only stat()s the path: nothing is opened, so a FIFO cannot block here.
void require_regular_file(const std::string& path, const std::string& what);

// Opens `path` for reading without blocking (O_NONBLOCK, then cleared), and
// checks with fstat that what was opened is a regular file: a path swapped
// for a FIFO between a check and the open still cannot hang. Returns the fd
// (O_CLOEXEC); throws naming `what` and the path.
int open_regular_file(const std::string& path, const std::string& what);

// The whole of a regular file of at most `max_bytes` bytes (more is an error
// naming the limit: a config or a metadata file is small, and a read must
// end). Throws loom::Error naming `what` and the path.
std::string read_bounded_file(const std::string& path, const std::string& what, size_t max_bytes);

}  // namespace loom
