#!/usr/bin/env bash
# Nsight Compute on the Hopper kernel's FP8 dense wide form with the query loaded before the partitions (qk) and by
# the MMA warps (qc): the stall reasons, pipes and shared-memory conflicts behind round 33's 1.16-1.22x (call 122).
# Usage (device root, after installing the wheels): OUT=dir bash bench/ncu_query.sh NAME [BATCH KV_LEN]
set -uo pipefail
NCU=${NCU:-/usr/local/cuda/bin/ncu}
B=${2:-64}; N=${3:-4096}
for q in 0 1; do
  timeout 200 $NCU -k regex:_mla_hopper_kernel -s 3 -c 1 --section SpeedOfLight --section WarpStateStats \
    --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
    --metrics smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_membar_per_issue_active.ratio,smsp__average_warps_issue_stalled_sleeping_per_issue_active.ratio,smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,gpu__time_duration.sum \
    --csv --page details python3 bench/profile_tile.py --heads 64 --batch $B --kv-len $N --kv-dtype fp8_e4m3 \
    --runs 4 --query-in-consumer $q > "$OUT/ncu-$1-q$q.csv" 2> "$OUT/ncu-$1-q$q.err"
  echo "q$q rc=$? $(grep -c . "$OUT/ncu-$1-q$q.csv") lines"; tail -2 "$OUT/ncu-$1-q$q.err"
done
