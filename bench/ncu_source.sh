#!/usr/bin/env bash
# Nsight Compute's per-instruction warp-stall samples (SASS) of the Hopper kernel on one shape, for two settings of a
# hopper.py measurement switch given as profile_tile.py flags: where each partition's warps wait.
# Usage (device root, after installing the wheels): OUT=dir bash bench/ncu_source.sh NAME "ARGS A" "ARGS B"
#   e.g. OUT=o bash bench/ncu_source.sh pf "--kv-dtype fp8_e4m3 --l2-prefetch 0" "--kv-dtype fp8_e4m3 --l2-prefetch 1"
set -uo pipefail
NCU=${NCU:-/usr/local/cuda/bin/ncu}
i=0
for args in "$2" "$3"; do
  timeout 240 $NCU -k regex:_mla_hopper_kernel -s 3 -c 1 --section SourceCounters --section WarpStateStats \
    --page source --csv --print-source sass python3 bench/profile_tile.py --heads ${HEADS:-64} --batch ${BATCH:-64} \
    --kv-len ${KV_LEN:-4096} --runs 4 $args > "$OUT/ncu-source-$1-$i.csv" 2> "$OUT/ncu-source-$1-$i.err"
  echo "$i ($args): rc=$? $(wc -l < "$OUT/ncu-source-$1-$i.csv") lines"; tail -2 "$OUT/ncu-source-$1-$i.err"
  i=$((i + 1))
done
