#!/usr/bin/env bash
# Build the documentation site into site/ (mkdocs.yml; the `docs` extra, installed with `dev` by scripts/env.sh).
# Offline and strict: any warning (a broken link or anchor, a page outside the nav, an unresolved API
# reference) fails the build. `bash scripts/docs.sh --serve` serves it with live reload instead.
# Other arguments go to `mkdocs build` (e.g. `--site-dir /tmp/site`).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck disable=SC1091
source scripts/env.sh
export NO_MKDOCS_2_WARNING=1  # mkdocs-material's end-of-life notice at every build; not a build warning
if [ "${1:-}" = "--serve" ]; then
  shift
  exec python -m mkdocs serve --strict "$@"
fi
python -m mkdocs build --strict "$@"
