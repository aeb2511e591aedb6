#!/usr/bin/env bash
# Install packages into a virtual environment: `tools/venv_install.sh VENV PIP-ARGS...`.
#
# With uv (https://docs.astral.sh/uv/, installed into VENV from PyPI on first use) when it can be
# had, else with the venv's pip; both take pip's requirement arguments (-e ".[dev]", -r FILE,
# --index-url URL). uv resolves the same versions as pip (the same 150 packages in `make setup`)
# and installs them in 20 s instead of pip's 175 s with a warm cache (2-core AMD EPYC VM): it
# fetches and unpacks in parallel and does not byte-compile.
#
# What pip would read from its environment and uv does not is passed on: the wheel folders of
# $PIP_FIND_LINKS (where a machine keeps its local torch build), and the torch already in VENV,
# pinned, so that a later install never replaces the build `make setup` chose.
# TITANLAB_PIP=1 uses pip only.
set -euo pipefail
venv=$1
shift
py=$venv/bin/python
uv=$venv/bin/uv
if [ "${TITANLAB_PIP:-0}" != 1 ] && [ ! -x "$uv" ]; then
	"$py" -m pip install -q uv >/dev/null 2>&1 || echo "venv_install: uv could not be installed; using pip"
fi
if [ "${TITANLAB_PIP:-0}" = 1 ] || [ ! -x "$uv" ]; then
	exec "$py" -m pip install -q "$@"
fi
extra=()
for links in ${PIP_FIND_LINKS:-}; do
	extra+=(--find-links "$links")
done
pins=$(mktemp)
trap 'rm -f "$pins"' EXIT
if torch=$("$py" -c "import torch; print(torch.__version__)" 2>/dev/null); then
	echo "torch==$torch" >"$pins"
fi
"$uv" pip install -q --python "$py" "${extra[@]}" --constraint "$pins" "$@"
