#!/usr/bin/env bash
# Nsight Compute on one shape of the Hopper kernel under two named sets of measurement switches (bench/hopper_dev.py's
# SWITCHES, given to bench/profile_tile.py), one launch each, one CSV each:
#   REPORT=details (default): speed of light, warp states, scheduler, compute, memory tables, the stall reasons per issued
#     instruction and the shared-memory bank conflicts (device call 130 read the query placement this way);
#   REPORT=source: per-instruction warp-stall samples of the SASS (device call 135 read the L2 prefetch this way).
# A set may name a measurement mode of hopper.py after a '+' (profile_tile.py --debug): 'dflt+mma_only' (its files
# are named with a '-' there: ncu-source-NAME-dflt-mma_only.csv).
# Usage (device root, after installing the wheels):
#   OUT=dir [REPORT=source] [HEADS=64 BATCH=64 KV_LEN=4096 KV_DTYPE=fp8_e4m3] bash bench/ncu_ab.sh NAME SWITCHES_A SWITCHES_B
#   e.g. OUT=o REPORT=source bash bench/ncu_ab.sh pf pf0 pf1
# Summary by partition: python3 bench/ncu_partitions.py OUT/ncu-source-NAME-*.csv
set -uo pipefail
NCU=${NCU:-/usr/local/cuda/bin/ncu}
REPORT=${REPORT:-details}
STALLS=barrier,long_scoreboard,short_scoreboard,mio_throttle,wait,math_pipe_throttle,lg_throttle,membar,sleeping,dispatch_stall
METRICS=$(echo $STALLS | tr , '\n' | sed 's/.*/smsp__average_warps_issue_stalled_&_per_issue_active.ratio/' | paste -sd,)
METRICS=$METRICS,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum
METRICS=$METRICS,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,gpu__time_duration.sum
if [ "$REPORT" = source ]; then
  WHAT=(--section SourceCounters --section WarpStateStats --page source --print-source sass)
else
  WHAT=(--section SpeedOfLight --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis
        --section MemoryWorkloadAnalysis_Tables --metrics "$METRICS" --page details)
fi
for sw in "$2" "$3"; do
  mode=()
  [[ "$sw" == *+* ]] && mode=(--debug "${sw#*+}")
  timeout 240 $NCU -k regex:_mla_hopper_kernel -s 3 -c 1 "${WHAT[@]}" --csv python3 bench/profile_tile.py \
    --heads ${HEADS:-64} --batch ${BATCH:-64} --kv-len ${KV_LEN:-4096} --kv-dtype ${KV_DTYPE:-fp8_e4m3} --runs 4 \
    --switches "${sw%%+*}" "${mode[@]}" > "$OUT/ncu-$REPORT-$1-${sw/+/-}.csv" 2> "$OUT/ncu-$REPORT-$1-${sw/+/-}.err"
  echo "$sw: rc=$? $(wc -l < "$OUT/ncu-$REPORT-$1-${sw/+/-}.csv") lines"; tail -2 "$OUT/ncu-$REPORT-$1-${sw/+/-}.err"
done
