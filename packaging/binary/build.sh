#!/bin/sh
# Builds the one-file executable `dist/mpsagent` with PyInstaller: Python, the agent and its dependencies in one
# file, for nodes that have no Python of their own. Run from anywhere; needs a Python where the agent and
# PyInstaller are installed (`pip install -e '.[test]'` provides both).
#
#   packaging/binary/build.sh                     # -> dist/mpsagent
#   DIST_DIR=/tmp/out packaging/binary/build.sh   # -> /tmp/out/mpsagent
#
# Environment: PYTHON (default .venv/bin/python, else python3), DIST_DIR (default dist), WORK_DIR (PyInstaller's
# intermediate files; default build/pyinstaller). Relative paths are taken from the repository root. The build
# links against the glibc of the machine it runs on: build on the oldest distribution you deploy to (see
# docs/install.md for the floor of a Debian 12 build).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
cd "$root"
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
dist=${DIST_DIR:-dist}
work=${WORK_DIR:-build/pyinstaller}
if ! "$PYTHON" -c 'import PyInstaller, mpsagent' 2>/dev/null; then
  echo "build.sh: $PYTHON lacks PyInstaller or mpsagent; run: $PYTHON -m pip install -e '.[test]'" >&2
  exit 2
fi
# --copy-metadata: `mpsagent --version` reads the installed package's version.
# --collect-submodules: modules imported by name at run time (anyio's event-loop backend, the generated protos).
# --exclude-module: optional imports of the runtime dependencies that the agent never uses (protobuf and pydantic
# for betterproto2, rich for structlog, attrs for msgspec, ...) and the build tools, which are installed beside it
# in a development environment; tests/packaging/test_packaging.py checks that only the runtime dependencies are bundled.
"$PYTHON" -m PyInstaller \
  --noconfirm \
  --log-level WARN \
  --distpath "$dist" \
  --workpath "$work" \
  "$here/mpsagent.spec"
echo "built $dist/mpsagent"
