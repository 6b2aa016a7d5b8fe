#!/usr/bin/env bash
# Bootstrap, then run the demo (python -m deep_ep.demo); arguments are passed through.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python -m deep_ep.demo "$@"
