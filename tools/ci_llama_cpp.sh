#!/usr/bin/env bash
# The llama.cpp build of CI (.ci/run), in two halves, so that no test waits on the build:
#   tools/ci_llama_cpp.sh build    `make llama-cpp-wheel` (python3's own pip, no .venv needed),
#                                  its output in $CI_REPORTS/llama-cpp.log and its exit status
#                                  in $CI_REPORTS/llama-cpp.status; run in the background from
#                                  the start, beside the set-up and the unit tests.
#   tools/ci_llama_cpp.sh install  waits for that status, then `make llama-cpp` installs the
#                                  wheel into .venv; `make test` runs it after the unit tests
#                                  (BEFORE_INTEGRATION), so that nothing is installed into .venv
#                                  while tests import from it. A failed build prints its log and
#                                  fails.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${CI_REPORTS:?CI_REPORTS is not set (.ci/run sets it)}"
log=$CI_REPORTS/llama-cpp.log
done_file=$CI_REPORTS/llama-cpp.status
case ${1:-} in
build)
	# The status is written however the build ends (set -e exits with the failed command's).
	trap 'code=$?; echo "$code" >"$done_file.tmp"; mv "$done_file.tmp" "$done_file"' EXIT
	tools/ci_stage.sh "llama-cpp build (overlapped)" make llama-cpp-wheel >"$log" 2>&1
	;;
install)
	waited=0
	while [ ! -f "$done_file" ]; do
		if [ "$waited" -ge "${LLAMA_CPP_WAIT_S:-1800}" ]; then
			cat "$log" 2>/dev/null || true
			echo "the llama.cpp build wrote no status in ${waited} s (killed?): see $log"
			exit 1
		fi
		sleep 1
		waited=$((waited + 1))
	done
	if [ "$(cat "$done_file")" != 0 ]; then
		cat "$log"
		echo "the llama.cpp build failed (exit $(cat "$done_file")): see above"
		exit 1
	fi
	tools/ci_stage.sh "llama-cpp install" make llama-cpp
	;;
*)
	echo "usage: tools/ci_llama_cpp.sh build|install" >&2
	exit 2
	;;
esac
