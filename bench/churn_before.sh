#!/usr/bin/env bash
# The "before" column of the churn table (README, docs/reliability.md): bench/churn.py — this
# checkout's harness and truth — against the stack of commit BEFORE (default 5983012, the last one
# before issue 33's migration and drain), checked out in a temporary git worktree. The rolling
# restart is left out: kairos up restarted no agent then. churn.py exits 1 when a stream failed or
# was cut, which is what this run shows; any other failure stops it.
#
#   python -m tools.docgen record churn-before -- bash bench/churn_before.sh
set -euo pipefail
cd "$(dirname "$0")/.."
before=${1:-5983012}
python=${PYTHON:-.venv/bin/python}
tmp=$(mktemp -d)
trap 'git worktree remove --force "$tmp/kairos" >/dev/null 2>&1 || true; rm -rf "$tmp"' EXIT
git worktree add --detach -q "$tmp/kairos" "$before"
rc=0
"$python" bench/churn.py --repo "$tmp/kairos" \
  --cases decode-sigterm,decode-sigkill,prefill-sigkill,prefill-sigterm,decode-sigstop || rc=$?
[ "$rc" -le 1 ] || exit "$rc"
