#!/usr/bin/env bash
# Run one CI stage and record its time: `tools/ci_stage.sh NAME COMMAND [ARGS...]`.
# With CI_REPORTS set (`.ci/run` sets it), appends "NAME<TAB>seconds" to $CI_REPORTS/stages.tsv
# when the command ends, whatever its exit status, which is this script's exit status too.
# `tools/ci_report.py` prints the table at the end of the run.
set -uo pipefail
name=$1
shift
start=$(date +%s%N)
"$@"
status=$?
if [ -n "${CI_REPORTS:-}" ]; then
	ms=$((($(date +%s%N) - start) / 1000000))
	printf '%s\t%d.%03d\n' "$name" $((ms / 1000)) $((ms % 1000)) >>"$CI_REPORTS/stages.tsv"
fi
exit $status
