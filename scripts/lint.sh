#!/usr/bin/env bash
# The lint stage: ruff (rules in pyproject.toml) over the repository, mypy over the package.
# Fails on any finding. Runs in the project's virtual environment (the dev extra pins both tools).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck disable=SC1091
source scripts/env.sh
python -m ruff --version
python -m ruff check .
python -m ruff format --check .
python -m mypy
