#!/usr/bin/env bash
# On the lent GPU machine: install the carried wheels, expose the console script, then run "$@".
# Usage there: bash benchmarks/device_setup.sh <command...>
set -e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
# A wheel too big to carry travels as its unpacked tree in an xz tarball (Ray's core: see
# docs/measurements.md); unpacked into the same place.
for tarball in .whl/*.tar.xz; do [ -e "$tarball" ] && tar -xJf "$tarball" -C /tmp/site; done
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH  # bin: ninja, for load_inline
bindir=$(dirname "$(python3 -c 'import sys; print(sys.executable)')")
printf '#!/bin/sh\nexec %s -m loom_mcp.cli "$@"\n' "$(python3 -c 'import sys; print(sys.executable)')" > "$bindir/loom-mcp"
chmod +x "$bindir/loom-mcp"
export LOOM_HOME=/tmp/loom-home LOOM_ALLOWED_ROOTS=/tmp:$PWD PYTHONUNBUFFERED=1
"$@"
