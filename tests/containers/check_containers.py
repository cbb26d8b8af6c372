#!/usr/bin/env python3
"""Checks containers/ without Docker or Slurm (neither is in CI):

* containers/Dockerfile is multi-stage on an nvidia/cuda:13.0.x-cudnn-devel
  base, copies the repository, and builds with the project's own
  scripts/setup.sh and scripts/build.sh (which must exist), then installs into
  /opt/loom, which the runtime stage copies;
* the sbatch scripts parse (bash -n) and, run against stand-in srun, nsys and
  loom programs, start what they should: loom.sbatch with and without
  LOOM_IMAGE (pyxis flags); nsys.sbatch with nsys on local rank 0 only,
  --capture-range=cudaProfilerApi and the [profile] window;
* containers/README.md shows enroot import dockerd:// and srun --container-image.
Exits 1 naming each failed check.
"""
import os
import re
import stat
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
errors = []


def check(cond, msg):
    if not cond:
        errors.append(msg)


# --- Dockerfile ---------------------------------------------------------------
docker = open(os.path.join(REPO, "containers", "Dockerfile")).read()
lines = [l.strip() for l in re.sub(r"\\\n", " ", docker).splitlines() if l.strip() and not l.strip().startswith("#")]
args = dict(re.findall(r"^ARG (\w+)=(\S+)", "\n".join(lines), re.M))
froms = [l for l in lines if l.startswith("FROM ")]
check(len(froms) >= 2, f"Dockerfile: expected a multi-stage build (2+ FROM), found {len(froms)}")
expand = lambda s: re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), s)
base = expand(froms[0].split()[1]) if froms else ""
check(re.fullmatch(r"nvidia/cuda:13\.0\.\d+-cudnn-devel-\S+", base) is not None,
      f"Dockerfile: the build stage's base is '{base}', expected nvidia/cuda:13.0.x-cudnn-devel-*")
runs = [l for l in lines if l.startswith("RUN ")]
setup = [i for i, l in enumerate(lines) if l.startswith("RUN ") and re.search(r"\bbash scripts/setup\.sh\b", l)]
build = [i for i, l in enumerate(lines) if l.startswith("RUN ") and re.search(r"\bbash scripts/build\.sh\b", l)]
copy_all = [i for i, l in enumerate(lines) if re.fullmatch(r"COPY \. \S+", l)]
check(bool(setup), "Dockerfile: no RUN calls 'bash scripts/setup.sh' (the image must be set up by the project's script)")
check(bool(build), "Dockerfile: no RUN calls 'bash scripts/build.sh' (the image must be built by the project's script)")
check(bool(copy_all) and setup and build and copy_all[0] < setup[0] < build[0],
      "Dockerfile: expected COPY . <dir>, then RUN bash scripts/setup.sh, then RUN bash scripts/build.sh, in that order")
for s in ("scripts/setup.sh", "scripts/build.sh"):
    check(os.path.exists(os.path.join(REPO, s)), f"{s} does not exist")
check(any("cmake --install" in l and "/opt/loom" in l for l in runs), "Dockerfile: the build is not installed into /opt/loom")
check(any(re.match(r"COPY --from=build /opt/loom /opt/loom", l) for l in lines),
      "Dockerfile: the runtime stage does not copy /opt/loom from the build stage")
check(any("openmpi-bin" in l for l in runs[len(runs) // 2:]), "Dockerfile: the runtime stage does not install OpenMPI")
check("LOOM_WITH_CUDA=ON" in docker, "Dockerfile: the build does not ask for CUDA (-DLOOM_WITH_CUDA=ON)")

# --- sbatch scripts, against stand-ins ------------------------------------------
for name in ("loom.sbatch", "nsys.sbatch"):
    path = os.path.join(REPO, "containers", "slurm", name)
    r = subprocess.run(["bash", "-n", path], capture_output=True, text=True)
    check(r.returncode == 0, f"{name}: bash -n failed: {r.stderr.strip()}")

with tempfile.TemporaryDirectory() as tmp:
    bin_dir = os.path.join(tmp, "bin")
    os.makedirs(bin_dir)
    log = os.path.join(tmp, "calls.log")

    def tool(name, body):
        p = os.path.join(bin_dir, name)
        with open(p, "w") as f:
            f.write("#!/bin/bash\n" + body)
        os.chmod(p, os.stat(p).st_mode | stat.S_IEXEC)

    # srun: log its options, then run the command as two tasks on one node (local ids 0 and 1).
    tool("srun", f"""opts=(); while [[ "$1" == -* ]]; do opts+=("$1"); shift; done
echo "srun ${{opts[*]}}" >> {log}
for id in 0 1; do SLURM_LOCALID=$id SLURM_NODEID=0 "$@"; done
""")
    tool("loom", f'echo "loom $*" >> {log}\n')
    tool("nsys", f'echo "nsys $*" >> {log}\n')
    env = dict(os.environ, PATH=bin_dir + ":" + os.environ["PATH"])

    def run(script, extra_env, *a):
        open(log, "w").close()
        r = subprocess.run(["bash", os.path.join(REPO, "containers", "slurm", script), *a], cwd=tmp,
                           env=dict(env, **extra_env), capture_output=True, text=True)
        check(r.returncode == 0, f"{script}: exited {r.returncode}: {r.stderr.strip()}")
        return open(log).read().splitlines()

    calls = run("loom.sbatch", {}, "my.toml", "--set", "train.steps=5")
    check(any(c.startswith("srun --mpi=pmix") and "--container" not in c for c in calls),
          f"loom.sbatch without LOOM_IMAGE: {calls}")
    check("loom train my.toml --set train.steps=5" in calls, f"loom.sbatch: loom not started as expected: {calls}")
    calls = run("loom.sbatch", {"LOOM_IMAGE": "/img/loom.sqsh", "LOOM_MOUNTS": "/data:/data"}, "my.toml")
    srun = [c for c in calls if c.startswith("srun")]
    check(srun and "--container-image=/img/loom.sqsh" in srun[0] and f"--container-mounts={tmp}:{tmp},/data:/data" in srun[0],
          f"loom.sbatch with LOOM_IMAGE: srun lacks the pyxis options: {srun}")
    calls = run("nsys.sbatch", {"NSYS_STEPS": "3,4"}, "my.toml", "--set", "run.device=cuda")
    prof = [c for c in calls if c.startswith("nsys ")]
    plain = [c for c in calls if c.startswith("loom ")]
    check(len(prof) == 1 and len(plain) == 1, f"nsys.sbatch: expected nsys on local rank 0 only, got {calls}")
    if prof:
        check("--capture-range=cudaProfilerApi" in prof[0], f"nsys.sbatch: no --capture-range=cudaProfilerApi: {prof[0]}")
        check("loom train my.toml --set profile.steps=[3,4] --set run.device=cuda" in prof[0],
              f"nsys.sbatch: the profiled rank does not run the window: {prof[0]}")
    if plain:
        check(plain[0] == "loom train my.toml --set profile.steps=[3,4] --set run.device=cuda",
              f"nsys.sbatch: the other ranks must run the same steps: {plain[0]}")

# --- README ---------------------------------------------------------------------
readme = open(os.path.join(REPO, "containers", "README.md")).read()
check(re.search(r"enroot import (-o \S+ )?dockerd://", readme) is not None, "containers/README.md does not show enroot import dockerd://")
check("--container-image=" in readme and "--container-mounts=" in readme,
      "containers/README.md does not show srun --container-image= --container-mounts=")

if errors:
    print("FAILED:\n  " + "\n  ".join(errors))
    sys.exit(1)
print("containers OK")
