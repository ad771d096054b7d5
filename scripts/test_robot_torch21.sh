#!/usr/bin/env bash
# Run the robot-side tests under the robot's runtime: ROS Noetic's Python 3.8 (Ubuntu 20.04,
# JetPack 5) and NVIDIA's JetPack 5 wheels, torch 2.0/2.1 with torchvision 0.16, while the
# server runs the Python and torch of requirements.txt.
#
#   bash scripts/test_robot_torch21.sh [pytest arguments]
#
# Builds (once; a stamp of the interpreter and the package list makes a second run only
# check) a second venv, .venv-robot-torch21/ (git-ignored; ROBOT_OFFLOAD_TORCH21_VENV
# overrides), with PyPI's torch 2.1.2 and torchvision 0.16.2, then runs the tests marked
# `robot_side` (pytest.ini) in it: the unit tests of the robot-side modules, and the
# cross-version test in which this venv's client talks to a server process running the
# main venv's Python and torch. Needs scripts/setup.sh to have run (catkin workspace, main
# venv).
#
# The interpreter: ROBOT_OFFLOAD_ROBOT_PYTHON, else a Python 3.8 found on PATH or under
# pyenv, else Debian's /usr/bin/python3 (3.11; the robot-side code's 3.8 syntax is then
# checked by test_python38.py alone, which does not see library calls newer than 3.8).
# With a Python other than Debian's, the venv reads ROS's pure-Python modules (rospy,
# roslaunch, the generated messages' genpy) from Debian's dist-packages through a .pth
# file placed after its own site-packages, and installs the compiled modules the robot
# side imports (zstandard, OpenCV, PyYAML, psutil, SciPy) for that Python itself; with
# Debian's, it uses the system site packages as the main venv does.
#
# PyPI's torch 2.1.2 is its CUDA build: it loads the CUDA libraries it links against
# (cuDNN, cuBLAS, cuFFT, cuRAND, cuSPARSE, NCCL, CUPTI, NVTX, the runtime) even on a
# machine without a GPU, so those packages are installed too -- not NVRTC, cuSOLVER and
# triton, which it loads only when used. Everything is installed with --no-deps from the
# exact list below, so pip resolves nothing and the venv is the same on every machine.
set -uo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${ROBOT_OFFLOAD_TORCH21_VENV:-$repo/.venv-robot-torch21}"
log() { echo "[robot-torch21] $*"; }

debian_python=/usr/bin/python3
robot_python="${ROBOT_OFFLOAD_ROBOT_PYTHON:-}"
if [ -z "$robot_python" ]; then
  for candidate in "$(command -v python3.8 2>/dev/null)" \
                   "$(pyenv root 2>/dev/null)"/versions/3.8*/bin/python3.8 \
                   "$HOME"/.pyenv/versions/3.8*/bin/python3.8; do
    # pyenv's shim answers even when no 3.8 is installed: the interpreter must run
    if [ -n "$candidate" ] && [ -x "$candidate" ] && "$candidate" -c "" 2>/dev/null; then
      robot_python="$candidate"; break
    fi
  done
fi
robot_python="${robot_python:-$debian_python}"
py_version="$("$robot_python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" \
  || { echo "[robot-torch21] $robot_python does not run" >&2; exit 1; }
[ "$py_version" = "3.8" ] || log "no Python 3.8 on this machine: the robot side runs on $py_version"

packages=(
  torch==2.1.2 torchvision==0.16.2
  nvidia-cuda-runtime-cu12==12.1.105 nvidia-cuda-cupti-cu12==12.1.105
  nvidia-cudnn-cu12==8.9.2.26 nvidia-cublas-cu12==12.1.3.1 nvidia-cufft-cu12==11.0.2.54
  nvidia-curand-cu12==10.3.2.106 nvidia-cusparse-cu12==12.1.0.106
  nvidia-nvjitlink-cu12==12.1.105 nvidia-nccl-cu12==2.18.1 nvidia-nvtx-cu12==12.1.105
  # torch's and torchvision's own dependencies, as of torch 2.1.2's release
  numpy==1.24.2 filelock==3.13.1 typing-extensions==4.9.0 sympy==1.12 mpmath==1.3.0
  jinja2==3.1.2 markupsafe==2.1.3 fsspec==2023.12.2 pillow==10.1.0
  requests==2.31.0 urllib3==2.1.0 idna==3.6 certifi==2023.11.17 charset-normalizer==3.3.2
  # networkx 3.2 needs Python 3.9
  "$([ "$py_version" = 3.8 ] && echo networkx==3.1 || echo networkx==3.2.1)"
  # the test tools
  pytest==8.3.4 pluggy==1.5.0 iniconfig==2.0.0 packaging==23.2 pytest-timeout==2.3.1
  hypothesis==6.92.1 attrs==23.1.0 sortedcontainers==2.4.0
)
if [ "$robot_python" != "$debian_python" ]; then
  # the compiled modules Debian provides to its own Python only
  packages+=(zstandard==0.22.0 opencv-python-headless==4.8.1.78 PyYAML==6.0.1 psutil==5.9.6
             scipy==1.10.1)
  [ "$py_version" = 3.8 ] && packages+=(exceptiongroup==1.2.0 tomli==2.0.1)
fi

stamp="$venv/.setup.sha256"
want="$( (echo "$robot_python $py_version"; printf '%s\n' "${packages[@]}") | sha256sum | cut -d' ' -f1)"
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  log "creating venv $venv (Python $py_version, torch 2.1.2, about 2.4 GB to download)"
  t0=$SECONDS
  rm -rf "$venv"
  if [ "$robot_python" = "$debian_python" ]; then
    # System site packages: Debian's ROS Python modules (rospy, the generated messages'
    # genpy), zstandard and OpenCV, as in the main venv.
    "$robot_python" -m venv --system-site-packages "$venv"
  else
    # Debian's dist-packages after the venv's own: ROS's pure-Python modules only (its
    # compiled ones are built for Debian's Python and are not importable here).
    # (written after pip has run: pip would take Debian's modules as installed)
    "$robot_python" -m venv "$venv"
  fi
  pip_log="$venv/pip.log"
  pkgs=()
  for p in "${packages[@]}"; do pkgs+=("$p"); done
  "$venv/bin/python" -m pip install -q --no-deps --disable-pip-version-check \
      "${pkgs[@]}" >"$pip_log" 2>&1 \
    || { tail -30 "$pip_log" >&2; echo "[robot-torch21] pip failed; log: $pip_log" >&2; exit 1; }
  if [ "$robot_python" != "$debian_python" ]; then
    site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    echo /usr/lib/python3/dist-packages > "$site/zz_debian_ros.pth"
  fi
  "$venv/bin/python" -c "import torch, torchvision, rospy; assert torch.__version__.startswith('2.1.')" \
    || { echo "[robot-torch21] torch 2.1 does not import in $venv" >&2; exit 1; }
  echo "$want" > "$stamp"
  log "venv ready in $((SECONDS - t0)) s, $(du -sh "$venv" | cut -f1)"
fi

set +u; source "$repo/scripts/env.sh"; set -u
# The torch 2.1 venv first; the catkin devel space (robot_offload, its messages) and ROS
# stay on the path from env.sh. The main venv's python runs the server process of the
# cross-version test (ROBOT_OFFLOAD_SERVER_PYTHON).
export ROBOT_OFFLOAD_SERVER_PYTHON="${VIRTUAL_ENV:-$repo/.venv}/bin/python"
export PATH="$venv/bin:$PATH" VIRTUAL_ENV="$venv"
cd "$repo"
"$venv/bin/python" -c "import sys, torch; print('[robot-torch21] robot side on Python %d.%d.%d,' % sys.version_info[:3], 'torch', torch.__version__)"
results="$repo/.catkin_ws/test_results"
mkdir -p "$results"
exec "$venv/bin/python" -m pytest test -q -ra -m robot_side --junitxml="$results/pytest-robot-torch21.xml" "$@"
