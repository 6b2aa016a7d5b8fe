#!/usr/bin/env bash
# Keeps an output folder within a limit on its number of files (8 by default), for runners that
# return a bounded number of files: when the folder holds more files (at any depth), everything but
# the JSON results goes into DIR/logs.tar.gz; if the JSON files alone still leave no room for the
# archive, they go in too. Empty folders left behind are removed. Prints what it did.
#
#   bash scripts/pack_out.sh DIR [LIMIT]
set -uo pipefail
dir=${1:?usage: pack_out.sh DIR [LIMIT]}
limit=${2:-8}
cd "$dir" || exit 1
total=$(find . -type f | wc -l)
if [[ $total -le $limit ]]; then
  exit 0
fi
mapfile -t json < <(find . -type f -name '*.json' | sort)
if [[ $(( ${#json[@]} + 1 )) -le $limit ]]; then
  mapfile -t packed < <(find . -type f ! -name '*.json' ! -path ./logs.tar.gz | sort)
else
  mapfile -t packed < <(find . -type f ! -path ./logs.tar.gz | sort)
fi
tar czf logs.tar.gz "${packed[@]}" || exit 1
rm -f "${packed[@]}"
find . -mindepth 1 -type d -empty -delete
echo "pack_out: ${#packed[@]} of $total files packed into $dir/logs.tar.gz"
