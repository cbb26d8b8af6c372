// The plugin ABI (docs/PLUGINS.md, docs/ARCHITECTURE.md "Plugin ABI").
//
// A plugin is libloom-<kind>-<name>.so exporting one extern "C" entry,
// `loom_plugin_entry`, through Boost.DLL's alias. The entry returns a plain
// descriptor; the host checks struct size, kind, ABI major/minor and build id
// before it calls the factory. Plugins are never unloaded.
//
// Writing one:
//   class MyAttention final : public loom::Attention { ... };
//   LOOM_PLUGIN(attention, MyAttention, "my_attn", "1.0.0", "what it does")
#pragma once
#include <cstdint>
#include <string>

#include <boost/dll/alias.hpp>

#include "loom/config.hpp"
#include "loom/dtype.hpp"
#include "loom/version.hpp"

namespace loom {

enum class PluginKind : uint32_t { precision = 1, attention = 2, sharding = 3, data = 4 };
const char* plugin_kind_name(PluginKind k);

// Everything a plugin's constructor receives.
struct PluginInit {
  ConfigTable config;        // the plugin's own TOML table; call config.finish() after reading
  Device device = Device::cpu;
  int rank = 0;
  int world = 1;
  int local_rank = 0;
  uint64_t seed = 0;
  bool deterministic = false;
  int local_world = 1;       // ranks on this node
  // True when a launcher (mpirun, srun) started this process; false for a
  // plain `loom train`. A strategy that needs several ranks refuses to run
  // without one (with the command to use), instead of the core guessing from
  // its name. `loom check --world-size N` plans the run as N ranks a launcher
  // started, so true there too (N = 1 included, as `mpirun -np 1`).
  bool under_launcher = false;
  // ABI 8.2: no device exists for this run, which is only planned (`loom
  // check --gpu NAME` or `--device-memory SIZE` on a machine without that
  // GPU). `device` still says where the run would compute. The plugin must
  // answer what planning asks (dtypes, register_linear, supports,
  // workspace_bytes, saved_activation_bytes, plan, scratch, open) without
  // touching a device or a device library, and is never asked to compute.
  // Where a true answer needs the device (cuDNN's workspace for a shape), an
  // upper estimate; where it cannot be known (whether cuDNN has an engine for
  // the shape), the plugin's own rules only.
  bool planning = false;
};

// Base of every plugin object. The host destroys objects through this.
class Plugin {
 public:
  virtual ~Plugin() = default;
};

extern "C" {
// Plain C layout: fields are only ever appended (struct_size tells which exist).
struct PluginDescriptor {
  uint32_t struct_size;
  uint32_t abi_major;
  uint32_t abi_minor;
  uint32_t kind;             // PluginKind
  const char* name;          // "cudnn"
  const char* version;       // plugin's own version, "1.0.0"
  const char* description;   // one line
  const char* build_id;      // LOOM_BUILD_ID of the SDK it was built against
  // Returns a new object of the kind's interface (loom::Precision*, ...) as Plugin*.
  ::loom::Plugin* (*create)(const ::loom::PluginInit* init);
};
typedef const PluginDescriptor* (*PluginEntryFn)();
}

template <PluginKind K> struct PluginInterface;

}  // namespace loom

#define LOOM_PLUGIN_ENTRY_NAME loom_plugin_entry

// Defines the descriptor and exports the entry. KIND is precision, attention,
// sharding or data; CLASS implements that kind's interface and has a
// constructor taking const loom::PluginInit&.
#define LOOM_PLUGIN(KIND, CLASS, NAME, VERSION, DESCRIPTION)                               \
  namespace loom_plugin_detail {                                                            \
  static ::loom::Plugin* create(const ::loom::PluginInit* init) {                           \
    using Iface = ::loom::PluginInterface<::loom::PluginKind::KIND>::type;                  \
    Iface* obj = new CLASS(*init);                                                          \
    return obj;                                                                             \
  }                                                                                         \
  static const ::loom::PluginDescriptor descriptor = {                                      \
      sizeof(::loom::PluginDescriptor), LOOM_ABI_MAJOR, LOOM_ABI_MINOR,                     \
      static_cast<uint32_t>(::loom::PluginKind::KIND), NAME, VERSION, DESCRIPTION,          \
      LOOM_BUILD_ID, &create};                                                              \
  static const ::loom::PluginDescriptor* entry() { return &descriptor; }                    \
  }                                                                                         \
  BOOST_DLL_ALIAS(loom_plugin_detail::entry, loom_plugin_entry)
