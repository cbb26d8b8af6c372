// A valid shared library without the plugin entry: the registry must load it
// and then refuse it as "not a Loom plugin".
extern "C" __attribute__((visibility("default"))) int loom_test_not_a_plugin_answer() { return 42; }
