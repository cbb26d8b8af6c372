#!/usr/bin/env python3
"""Checks, from `ctest --show-only=json-v1`, that the properties tests/CMakeLists.txt
gives each GoogleTest suite reached every one of its tests.

A suite's tests are discovered at build time and their properties set when ctest
reads the suite's list; a property lost on the way (as happened when a list value
was passed through gtest_discover_tests) makes a suite run without its fixture,
its timeout or its environment, and fail only on a fresh build tree, where the
fixture's outputs are not left over from an earlier run.

Usage: check_test_properties.py --ctest CTEST --build DIR [--environment VAR=value ...]
                                [suite=PROPERTY=value ...]
"""
import argparse
import json
import os
import subprocess
import sys


def same_scalar(got, value):
    """ctest lists numbers as numbers (TIMEOUT 3600 as 3600.0)."""
    if got is None:
        return False
    try:
        return float(got) == float(value)
    except (TypeError, ValueError):
        return str(got) == value


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctest", required=True)
    ap.add_argument("--build", required=True)
    ap.add_argument("--environment", action="append", default=[])
    ap.add_argument("expect", nargs="*", help="suite=PROPERTY=value")
    a = ap.parse_args()

    out = subprocess.run([a.ctest, "--test-dir", a.build, "--show-only=json-v1"], check=True,
                         capture_output=True, text=True).stdout
    tests = json.loads(out)["tests"]

    def props(t):
        return {p["name"]: p["value"] for p in t.get("properties", [])}

    def suite_of(t):
        cmd = t.get("command") or [""]
        return os.path.basename(cmd[0])

    bin_dir = os.path.join(os.path.realpath(a.build), "bin")
    suites = {}
    for t in tests:
        cmd = t.get("command") or [""]
        if os.path.dirname(os.path.realpath(cmd[0])) == bin_dir and suite_of(t).startswith("test_") and \
                any(c.startswith("--gtest_filter=") for c in cmd[1:]):
            suites.setdefault(suite_of(t), []).append(t)

    errors = []
    setups = {f for t in tests for f in props(t).get("FIXTURES_SETUP", [])}
    expect = {}
    for e in a.expect:
        suite, key, value = e.split("=", 2)
        expect.setdefault(suite, []).append((key, value))
        if suite not in suites:
            errors.append(f"{suite}: no test of this suite is listed by ctest")

    # Suites of tests/mpi set their own environment (one OpenMP thread per rank).
    for suite, ts in sorted(suites.items()):
        for t in ts:
            p = props(t)
            env = p.get("ENVIRONMENT", [])
            if suite not in ("test_sharding_cli", "test_reliability_mpi"):
                for want in a.environment:
                    if want not in env:
                        errors.append(f"{t['name']} ({suite}): ENVIRONMENT {env} lacks {want}")
            for key, value in expect.get(suite, []):
                got = p.get(key)
                ok = (value in got) if isinstance(got, list) else same_scalar(got, value)
                if not ok:
                    errors.append(f"{t['name']} ({suite}): {key} is {got!r}, tests/CMakeLists.txt sets {value}")
                if key == "FIXTURES_REQUIRED" and value not in setups:
                    errors.append(f"{t['name']} ({suite}): fixture {value} has no FIXTURES_SETUP test")
    n = sum(len(v) for v in suites.values())
    if errors:
        for e in errors[:40]:
            print(e)
        print(f"{len(errors)} problem(s) in the properties of {n} tests of {len(suites)} suites")
        return 1
    print(f"{n} tests of {len(suites)} suites carry their environment; checked: {', '.join(a.expect) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
