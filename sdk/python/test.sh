#!/usr/bin/env bash
# Tests the Python SDK: a virtual environment under target/ (not committed), the package
# installed from sdk/python with its test and lint extras, ruff and mypy --strict, then pytest
# against real brokers started by the tests. FELIX_BIN picks the broker binary (default: the
# repository's debug build, which `cargo test` builds). Exits non-zero on any failure,
# including when no test ran.
set -euo pipefail

sdk_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo_dir="$(cd "$sdk_dir/../.." && pwd)"
target_dir="${CARGO_TARGET_DIR:-$repo_dir/target}"
venv="$target_dir/sdk-python-venv"
python="${PYTHON:-python3}"

export FELIX_BIN="${FELIX_BIN:-$target_dir/debug/felix}"
if [[ ! -x "$FELIX_BIN" ]]; then
    echo "sdk/python/test.sh: no broker binary at $FELIX_BIN (run cargo build -p felix, or set FELIX_BIN)" >&2
    exit 1
fi

if [[ ! -x "$venv/bin/python" ]]; then
    "$python" -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "${sdk_dir}[test,lint]"

cd "$sdk_dir"
"$venv/bin/python" -m ruff check --quiet .
"$venv/bin/python" -m ruff format --quiet --check .
"$venv/bin/python" -m mypy
status=0
"$venv/bin/python" -m pytest -p no:cacheprovider -q "$@" || status=$?
if [[ $status -eq 5 ]]; then
    echo "sdk/python/test.sh: pytest collected no tests" >&2
fi
exit "$status"
