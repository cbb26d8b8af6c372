#!/usr/bin/env python3
"""The SDK is the whole contract (docs/PLUGINS.md): a plugin compiles
against the installed SDK headers (core/include) and its own folder only.

    check_plugin_includes.py --source DIR --build DIR PLUGIN_DIR...

For every plugin folder given (relative to --source, e.g. plugins/data/tokens;
a kind's common/ folder counts as a plugin folder of its own). blocks/, the
model's block variants, is checked the same way: built into libloom, it still
sees only the SDK and its own folder (its own headers are included by file
name, so no folder but core/include is on its include path).

1. Include paths. Every compile command of a file in the folder (from
   <build>/compile_commands.json, which plugins/CMakeLists.txt asks CMake to
   write) may name, inside the source tree, only core/include (the installed
   SDK) and plugins/ (so that a plugin reaches its own headers as
   "kind/name/x.hpp"). core/src, apps/, tests/ or any other folder of the tree
   is a failure naming the plugin, the file and the flag. Folders outside the
   source tree (system headers, cuDNN, the build tree) are not the SDK's
   business.
2. Includes. Every #include of every source and header in the folder is
   resolved as the compiler would (the including file's folder, then the
   include paths); one that lands in the source tree must be in the plugin's
   own folder, in its kind's common/ folder, or an installed SDK header
   (core/include/loom/..., installed whole by core/CMakeLists.txt).

Exit status 1 with one line per problem; 0 with a line per folder checked.
--self-test builds a leaking plugin in a scratch folder and checks that both
kinds of leak are found and a clean plugin passes (so this check can fail).
"""
import argparse
import json
import os
import re
import shlex
import sys
import tempfile

SOURCE_SUFFIXES = (".cpp", ".cc", ".cxx", ".cu", ".hpp", ".h", ".cuh", ".inl")
INCLUDE_RE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.MULTILINE)


def under(path, folder):
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder + os.sep)


def include_dirs(command, directory):
    """The -I / -isystem / -iquote folders of one compile command, absolute."""
    args = command["arguments"] if "arguments" in command else shlex.split(command["command"])
    dirs, i = [], 0
    while i < len(args):
        a = args[i]
        for flag in ("-isystem", "-iquote", "-idirafter", "-I"):
            if a == flag and i + 1 < len(args):
                dirs.append((flag, args[i + 1]))
                i += 1
                break
            if a.startswith(flag) and a != flag and not (flag == "-I" and a.startswith("-isystem")):
                dirs.append((flag, a[len(flag):]))
                break
        i += 1
    return [(f, d if os.path.isabs(d) else os.path.normpath(os.path.join(directory, d))) for f, d in dirs]


def check(source, build, folders, commands_file=None):
    source = os.path.realpath(source)
    commands_file = commands_file or os.path.join(build, "compile_commands.json")
    if not os.path.isfile(commands_file):
        return [f"{commands_file} is missing: configure the build with CMake's Ninja or Makefile generator "
                "(plugins/CMakeLists.txt sets CMAKE_EXPORT_COMPILE_COMMANDS)"], []
    with open(commands_file) as f:
        commands = json.load(f)
    sdk = os.path.join(source, "core", "include")
    sdk_headers = os.path.join(sdk, "loom")
    plugins_root = os.path.join(source, "plugins")
    problems, done = [], []
    for rel in folders:
        folder = os.path.realpath(os.path.join(source, rel))
        if not os.path.isdir(folder):
            problems.append(f"{rel}: not a folder under {source}")
            continue
        in_plugins = under(folder, plugins_root)
        # A plugin reaches its own and its kind's common/ headers as "kind/name/x.hpp"
        # (plugins/ on its path); a folder outside plugins/ (blocks/) by file name.
        root = plugins_root if in_plugins else folder
        common = os.path.join(os.path.dirname(folder), "common") if in_plugins else folder
        own = [c for c in commands if under(os.path.join(c["directory"], c["file"]), folder)]
        # 1. What the compiler is told to search.
        search = []
        for c in own:
            for flag, d in include_dirs(c, c["directory"]):
                if d not in search:
                    search.append(d)
                if under(d, source) and not (under(d, sdk) or os.path.realpath(d) == os.path.realpath(root)
                                             or under(d, build)):
                    problems.append(f"{rel}: {os.path.relpath(c['file'], source)} is compiled with {flag}{d}, a "
                                    f"folder of the source tree outside the installed SDK (core/include): a plugin "
                                    f"sees only the SDK and its own folder")
        if not own:
            # Not built in this configuration (cudnn without cuDNN): its #includes are
            # still checked, against what every plugin gets.
            search = [sdk, root]
        # 2. What the sources include.
        files = []
        for root, _, names in os.walk(folder):
            files += [os.path.join(root, n) for n in sorted(names) if n.endswith(SOURCE_SUFFIXES)]
        for path in files:
            with open(path, errors="replace") as f:
                text = f.read()
            for m in INCLUDE_RE.finditer(text):
                kind, name = m.group(1), m.group(2)
                candidates = ([os.path.dirname(path)] if kind == '"' else []) + search
                found = next((os.path.join(d, name) for d in candidates if os.path.isfile(os.path.join(d, name))), None)
                if found is None or not under(found, source) or under(found, build):
                    continue  # a system or third-party header, or a generated one
                if under(found, folder) or under(found, common) or under(found, sdk_headers):
                    continue
                line = text.count("\n", 0, m.start()) + 1
                problems.append(f"{rel}: {os.path.relpath(path, source)}:{line} includes {kind}{name}"
                                f"{'>' if kind == '<' else kind}, which is {os.path.relpath(found, source)}: not an "
                                f"installed SDK header (core/include/loom/...) nor the plugin's own")
        done.append(f"{rel}: {len(files)} file(s), {len(own)} compile command(s)"
                    + ("" if own else " (not built here: #includes checked against core/include and plugins/)"))
    return problems, done


def self_test():
    with tempfile.TemporaryDirectory() as tmp:
        src, build = os.path.join(tmp, "src"), os.path.join(tmp, "build")
        for d in ("core/include/loom", "core/src/util", "plugins/data/good", "plugins/data/leaky",
                  "plugins/data/common", "plugins/attention/other", "blocks", "blocks_leaky", build):
            os.makedirs(os.path.join(src, d) if d != build else d, exist_ok=True)
        files = {
            "core/include/loom/data.hpp": "#pragma once\n",
            "core/src/util/files.hpp": "#pragma once\n",
            "plugins/data/common/shared.hpp": "#pragma once\n",
            "plugins/attention/other/other.hpp": "#pragma once\n",
            "plugins/data/good/good.hpp": "#pragma once\n#include \"loom/data.hpp\"\n",
            "plugins/data/good/good.cpp": "#include \"data/good/good.hpp\"\n#include \"data/common/shared.hpp\"\n"
                                          "#include <vector>\n",
            "plugins/data/leaky/leaky.cpp": "#include \"loom/data.hpp\"\n#include \"util/files.hpp\"\n"
                                            "#include \"attention/other/other.hpp\"\n",
            "blocks/shared.hpp": "#pragma once\n#include \"loom/data.hpp\"\n",
            "blocks/variant.cpp": "#include \"shared.hpp\"\n#include <vector>\n",
            "blocks_leaky/variant.cpp": "#include \"loom/data.hpp\"\n#include \"util/files.hpp\"\n",
        }
        for rel, text in files.items():
            with open(os.path.join(src, rel), "w") as f:
                f.write(text)
        inc = f"-I{src}/core/include -I{src}/plugins"
        cmds = [{"directory": build, "file": f"{src}/plugins/data/good/good.cpp", "command": f"c++ {inc} -c good.cpp"},
                {"directory": build, "file": f"{src}/plugins/data/leaky/leaky.cpp",
                 "command": f"c++ {inc} -I {src}/core/src -c leaky.cpp"}]
        cmds += [{"directory": build, "file": f"{src}/blocks/variant.cpp", "command": f"c++ -I{src}/core/include -c v.cpp"},
                 {"directory": build, "file": f"{src}/blocks_leaky/variant.cpp",
                  "command": f"c++ -I{src}/core/include -I{src}/core/src -c v.cpp"}]
        with open(os.path.join(build, "compile_commands.json"), "w") as f:
            json.dump(cmds, f)
        good, _ = check(src, build, ["plugins/data/good", "plugins/data/common", "blocks"])
        bad, _ = check(src, build, ["plugins/data/leaky"])
        bad_blocks, _ = check(src, build, ["blocks_leaky"])
        ok = (not good and len(bad) == 3 and any("-I" in p and "core/src" in p for p in bad)
              and any("util/files.hpp" in p for p in bad) and any("attention/other" in p for p in bad)
              and len(bad_blocks) == 2 and any("-I" in p and "core/src" in p for p in bad_blocks)
              and any("util/files.hpp" in p for p in bad_blocks))
        bad += bad_blocks
        print("self-test:", "passed" if ok else "FAILED")
        for p in good + bad:
            print("  ", p)
        return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source")
    ap.add_argument("--build")
    ap.add_argument("--self-test", action="store_true")
    ap.add_argument("folders", nargs="*")
    a = ap.parse_args()
    if a.self_test:
        return self_test()
    if not (a.source and a.build and a.folders):
        ap.error("--source, --build and at least one plugin folder are required")
    problems, done = check(a.source, a.build, a.folders)
    for d in done:
        print("checked", d)
    for p in problems:
        print("LEAK", p)
    print(f"{len(done)} plugin folder(s), {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
