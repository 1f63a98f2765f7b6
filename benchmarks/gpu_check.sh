#!/usr/bin/env bash
# Every GPU check of lightning_llmfast in one script, for one lent CUDA machine (nothing downloaded), in < 8 minutes.
#
#   bash benchmarks/gpu_check.sh            # logs, JUnit XML and JSON results under $OUT (else ./gpu_out)
#   GPU_CHECK_DRY=1 bash benchmarks/gpu_check.sh          # print the plan and budgets, run nothing (any machine)
#   GPU_CHECK_STAGES="nccl bench" bash benchmarks/gpu_check.sh   # some stages only
#   LLMFAST_COMMIT=abc1234 bash benchmarks/gpu_check.sh   # a copy without .git: name the commit for the report
#
# Stages, in order (each under its own `timeout`; a stage's limit is its maximum, cut so that the minimum of every
# later selected stage stays reserved within GPU_CHECK_BUDGET_S; a failing stage does not stop the later ones; the
# exit status is non-zero if any failed). Correctness first, benchmarks last, each writing its JSON when it ends:
#   env           nvidia-smi, versions, `pip install --no-deps -e .` (PYTHONPATH=. as the fallback)
#   cuda_tests    pytest -m cuda with LLMFAST_TEST_DEVICE=cuda and TRITON_INTERPRET unset: every CUDA-only path has a
#                 test there (copier and reloader on real streams and the pinned pool, Triton kernels against their
#                 references, grouped GEMM in bf16/fp16/fp32, FlashAttention/SDPA varlen, the training step under
#                 torch.cuda.set_sync_debug_mode("error")); a new @pytest.mark.cuda test joins this stage by itself
#   nccl          benchmarks/gpu_nccl_check.py: a world-size-1 NCCL group, FSDP2 sharding, a DCP save/load, expert
#                 parallelism (count exchange, dropless forward+backward)               -> nccl_check.json
#   kernel_check  Triton kernels against their references at T=65536, E=64, k=8, sync-free, timed -> kernel_check.json
#   cuda_graphs   benchmarks/gpu_cuda_graphs.py: an MoE block with MoEConfig(cuda_graphs=True) captured, replayed,
#                 compared with eager and both timed (dropless and capacity)           -> cuda_graphs.json
#   offload       benchmarks/bench_offload.py at hidden 4096 (OFFLOAD_SHAPES, OFFLOAD_MODES)  -> offload_<shape>.json
#   memplan       benchmarks/gpu_memplan.py: memory plans at 60% and 50% of what the layers save (12 layers, hidden
#                 1024) against offloading and recomputing alone: peak and tokens/s     -> memplan.json
#   overlap       benchmarks/bench_overlap.py --device cuda: the reference model's step with ep_overlap on and off, its
#                 exchanges (NCCL) slowed to link bandwidths B, step and exposed all-to-all time  -> overlap.json, .png
#   cp            benchmarks/bench_cp.py --device cuda --dtype bfloat16: context parallelism cp 1/2/4 (gloo ranks
#                 sharing the GPU, FlashAttention varlen with cu_seqlens_q != cu_seqlens_k): per-rank saved bytes (the
#                 cp=2 <= 0.6x cp=1 figure on one 4096-token document fails the stage), gathered K/V, tokens/s  -> cp.json
#   pipeline      benchmarks/gpu_pipeline.py --device cuda: the pipelined step (PipelineRunner on torch's schedules)
#                 with one rank holding both looped stages of interleaved 1F1B, interleaved zero bubble and ZBV,
#                 gradients equal to one process accumulating the microbatches (fp32, a failure fails the stage),
#                 step time and peak memory; the two-rank NCCL pipeline (pp=2, 1F1B) runs with 2 GPUs or more,
#                 else is skipped with the reason printed                                 -> pipeline.json
#   bench         python -m lightning_llmfast.bench --profile full --device cuda (bf16; micro: metadata, moe)
#                                                                                   -> bench.json, bench.png
# The last thing printed is a short table: one line per stage.
set -uo pipefail
cd "$(dirname "$0")/.."

export OUT="${OUT:-$PWD/gpu_out}"
DRY="${GPU_CHECK_DRY:-0}"
if [ "$DRY" != 1 ]; then
    mkdir -p "$OUT"
    exec > >(tee -a "$OUT/gpu_check.log") 2>&1
fi
unset TRITON_INTERPRET
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INDEX=1
export LLMFAST_TEST_DEVICE="${LLMFAST_TEST_DEVICE:-cuda}"
export BUDGET_S="${GPU_CHECK_BUDGET_S:-470}"
START_S=$(date +%s)
PY="${PYTHON:-python3}"
export PY

# ---------------------------------------------------------------------------------------------------------- stages
stage_env() {
    nvidia-smi -L || return 1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    "$PY" - <<'EOF'
import importlib, platform
print("python", platform.python_version())
for name in ("torch", "triton", "lightning", "transformers", "hypothesis", "pytest", "matplotlib"):
    try:
        print(f"{name:13s}", importlib.import_module(name).__version__)
    except Exception as err:  # report, do not fail: optional pieces may be absent
        print(f"{name:13s} missing ({type(err).__name__})")
import torch
print("cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
EOF
    # No network: no build isolation (it would fetch setuptools). PYTHONPATH=. covers a failed install.
    "$PY" -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip_install.log" 2>&1 \
        || echo "pip install -e . failed (see pip_install.log); using PYTHONPATH=$PWD"
    "$PY" -c "import lightning_llmfast; print('lightning_llmfast', lightning_llmfast.__version__, 'from', lightning_llmfast.__file__)"
}

stage_cuda_tests() {
    # -rs lists every skip with its reason: a CUDA test that skips on the GPU machine is a finding.
    "$PY" -m pytest -q -p no:cacheprovider -m cuda -rs --junitxml="$OUT/cuda_tests.xml" tests
}

stage_nccl() {
    "$PY" benchmarks/gpu_nccl_check.py --backend nccl --device "$LLMFAST_TEST_DEVICE" --json "$OUT/nccl_check.json"
}

stage_kernel_check() {
    "$PY" - <<'EOF'
"""Triton kernels against their PyTorch references at production shapes, with CUDA-event timings."""
import json, os, time, traceback
import torch
from lightning_llmfast.bench import SyncCounter
from lightning_llmfast.moe import kernels, permute, route, unpermute

# KCHECK_* let the script be dry-run on a CPU with TRITON_INTERPRET=1 and small shapes.
dev = torch.device(os.environ.get("KCHECK_DEVICE", "cuda"))
T, E, K, H = (int(os.environ.get(f"KCHECK_{n}", d)) for n, d in (("T", 65536), ("E", 64), ("K", 8), ("H", 1024)))
cuda = dev.type == "cuda"
failures, report = [], {}


def check(name, fn):
    try:
        fn()
        print(f"PASS {name}")
    except Exception:
        failures.append(name)
        print(f"FAIL {name}\n{traceback.format_exc()}")


def timed(fn, reps=10):
    fn()
    if not cuda:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


g = torch.Generator(device=dev).manual_seed(0)
logits = torch.randn(T, E, device=dev, generator=g)
x = torch.randn(T, H, device=dev, dtype=torch.bfloat16, generator=g)


def plans_equal(cf):
    ref = route(logits, K, capacity_factor=cf, validate=False, backend="torch")
    tri = route(logits, K, capacity_factor=cf, validate=False, backend="triton")
    for field in ("expert_ids", "tokens_per_expert", "offsets", "permutation", "kept", "num_dropped"):
        a, b = getattr(ref, field), getattr(tri, field)
        assert a.shape == b.shape and torch.equal(a, b), f"capacity_factor={cf}: {field} differs"
    torch.testing.assert_close(tri.weights, ref.weights)
    torch.testing.assert_close(tri.aux_loss, ref.aux_loss)
    torch.testing.assert_close(tri.z_loss, ref.z_loss)
    assert int(tri.tokens_per_expert.sum()) == int(tri.offsets[-1]) == int(tri.kept.sum())
    report[f"route_ms_torch_cf{cf}"] = timed(lambda: route(logits, K, capacity_factor=cf, validate=False, backend="torch"))
    report[f"route_ms_triton_cf{cf}"] = timed(lambda: route(logits, K, capacity_factor=cf, validate=False, backend="triton"))


def counting_sort_equal():
    keys = torch.randint(0, E, (T * K,), device=dev, dtype=torch.int32, generator=g)
    ref = kernels.stable_counting_sort(keys, E, backend="torch")
    tri = kernels.stable_counting_sort(keys, E, backend="triton")
    for a, b in zip(ref, tri):
        assert torch.equal(a, b), "stable_counting_sort differs"
    report["counting_sort_ms_torch"] = timed(lambda: kernels.stable_counting_sort(keys, E, backend="torch", validate=False))
    report["counting_sort_ms_triton"] = timed(lambda: kernels.stable_counting_sort(keys, E, backend="triton", validate=False))


def permute_roundtrip():
    # Independent identity: unpermute(permute(x)) = x * (sum of the token's kept weights), dropped pairs excluded.
    for cf in (None, 1.0):
        plan = route(logits, K, capacity_factor=cf, validate=False, backend="triton")
        y = permute(x, plan)
        n = int(plan.offsets[-1])
        rows = plan.permutation[:n].long() // K
        torch.testing.assert_close(y[:n], x[rows])
        back = unpermute(y, plan)
        expect = (x.float() * (plan.weights * plan.kept).sum(-1, keepdim=True)).to(back.dtype)
        torch.testing.assert_close(back, expect, rtol=2e-2, atol=2e-2)
    plan = route(logits, K, validate=False, backend="triton")
    report["permute_ms"] = timed(lambda: permute(x, plan))
    report["unpermute_ms"] = timed(lambda: unpermute(permute(x, plan), plan))


def sync_free():
    with SyncCounter(dev) as sc:
        plan = route(logits, K, validate=False, backend="triton")
        unpermute(permute(x, plan), plan)
    assert sc.num_syncs == 0, dict(sc.syncs)
    if not cuda:
        return
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        plan = route(logits, K, capacity_factor=1.25, validate=False, backend="triton")
        unpermute(permute(x, plan), plan)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def memory():
    if not cuda:
        return
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    plan = route(logits, K, validate=False, backend="triton")
    peak = torch.cuda.max_memory_allocated() - base
    # Reported, not asserted (the MoE tests own the O(T*k) memory claim): float scores (T, E) are inherent,
    # one int64 [T, E] mask would add 32 MiB.
    report["route_peak_extra_MiB"] = peak / 2**20
    report["route_T_by_E_float32_MiB"] = T * E * 4 / 2**20
    del plan


for name, fn in (
    ("route triton == torch (dropless)", lambda: plans_equal(None)),
    ("route triton == torch (capacity 1.0)", lambda: plans_equal(1.0)),
    ("stable counting sort triton == torch", counting_sort_equal),
    ("permute/unpermute round trip", permute_roundtrip),
    ("sync-free route+permute+unpermute", sync_free),
    ("route memory", memory),
):
    check(name, fn)
print(json.dumps(report, indent=1))
with open(os.path.join(os.environ["OUT"], "kernel_check.json"), "w") as f:
    json.dump({"failures": failures, **report}, f, indent=1)
raise SystemExit(1 if failures else 0)
EOF
}

stage_cuda_graphs() {
    "$PY" benchmarks/gpu_cuda_graphs.py --json "$OUT/cuda_graphs.json"
}

stage_offload() {
    local shape failed=0
    for shape in ${OFFLOAD_SHAPES:-large}; do
        if ! "$PY" benchmarks/bench_offload.py --device cuda --shape "$shape" --json "$OUT/offload_$shape.json" \
            --modes "${OFFLOAD_MODES:-rebuild_gemms,auto}" --summary; then
            echo "offload $shape: FAILED"
            failed=1
        fi
    done
    return "$failed"
}

stage_memplan() {
    "$PY" benchmarks/gpu_memplan.py --device cuda --repeats "${MEMPLAN_REPEATS:-6}" --json "$OUT/memplan.json" --summary
}

stage_overlap() {
    "$PY" benchmarks/bench_overlap.py --device cuda --quick --repeats "${OVERLAP_REPEATS:-3}" \
        --json "$OUT/overlap.json" --plot "$OUT/overlap.png"
}

stage_cp() {
    "$PY" benchmarks/bench_cp.py --device cuda --dtype bfloat16 --lengths "${CP_LENGTHS:-4096,16384}" \
        --repeats "${CP_REPEATS:-3}" --timeout $((STAGE_LIMIT_S > 20 ? STAGE_LIMIT_S - 10 : STAGE_LIMIT_S)) \
        --json "$OUT/cp.json"
}

stage_pipeline() {
    "$PY" benchmarks/gpu_pipeline.py --device cuda --repeats "${PIPELINE_REPEATS:-3}" \
        --timeout $((STAGE_LIMIT_S > 40 ? STAGE_LIMIT_S / 2 : 20)) --json "$OUT/pipeline.json"
}

stage_bench() {
    # A soft budget under the stage's hard limit: fewer repeats and skipped micro-benchmarks, not a lost run.
    local soft=$((STAGE_LIMIT_S > 80 ? STAGE_LIMIT_S - 40 : STAGE_LIMIT_S / 2))
    "$PY" -m lightning_llmfast.bench --profile full --device cuda --max-seconds "$soft" --micro metadata,moe \
        --json "$OUT/bench.json" --plot "$OUT/bench.png" | tee "$OUT/bench.md"
}

# ------------------------------------------------------------------------------------------------------- the runner
export -f stage_env stage_cuda_tests stage_nccl stage_kernel_check stage_cuda_graphs stage_offload stage_memplan \
    stage_overlap stage_cp stage_pipeline stage_bench
# name:max seconds:min seconds (the min of every later selected stage is reserved when a stage's limit is set)
STAGES=(env:30:10 cuda_tests:150:60 nccl:50:20 kernel_check:40:15 cuda_graphs:40:15 offload:80:30 memplan:60:25
    overlap:60:25 cp:60:30 pipeline:45:20 bench:110:60)
declare -a RESULTS
FAILED=0
PLANNED=0  # dry run: every stage is assumed to use its whole limit
[ "$DRY" = 1 ] && echo "gpu_check plan (dry run): budget ${BUDGET_S}s, LLMFAST_TEST_DEVICE=$LLMFAST_TEST_DEVICE"
for i in "${!STAGES[@]}"; do
    IFS=: read -r name max min <<<"${STAGES[$i]}"
    if [ -n "${GPU_CHECK_STAGES:-}" ] && [[ " $GPU_CHECK_STAGES " != *" $name "* ]]; then
        RESULTS+=("$name|not selected|0")
        continue
    fi
    reserve=0  # the minimum of every later stage that will run
    for later in "${STAGES[@]:$((i + 1))}"; do
        if [ -z "${GPU_CHECK_STAGES:-}" ] || [[ " $GPU_CHECK_STAGES " == *" ${later%%:*} "* ]]; then
            reserve=$((reserve + ${later##*:}))
        fi
    done
    elapsed=$(($(date +%s) - START_S))
    [ "$DRY" = 1 ] && elapsed=$PLANNED
    left=$((BUDGET_S - elapsed - reserve))
    limit=$((max < left ? max : left))
    if [ "$limit" -lt 10 ]; then
        echo "$name: SKIP (no time left)"
        RESULTS+=("$name|SKIP (no time left)|0")
        FAILED=1
        continue
    fi
    if [ "$DRY" = 1 ]; then
        echo "  $name: limit ${limit}s (max ${max}s, min ${min}s):"
        declare -f "stage_$name" | grep -E '"\$PY"' | head -2 | sed 's/^ */      /'
        PLANNED=$((PLANNED + limit))
        RESULTS+=("$name|planned|$limit")
        continue
    fi
    echo
    echo "=================================== $name (limit ${limit}s) ==================================="
    t0=$(date +%s)
    STAGE_LIMIT_S=$limit timeout -k 10 "$limit" bash -c "set -o pipefail; stage_$name" 2>&1 | tee "$OUT/$name.log"
    rc=${PIPESTATUS[0]}
    secs=$(($(date +%s) - t0))
    case $rc in
        0) status=PASS ;;
        124 | 137) status="TIMEOUT after ${limit}s" ;;
        *) status="FAIL (exit $rc)" ;;
    esac
    [ "$rc" -eq 0 ] || FAILED=1
    RESULTS+=("$name|$status|$secs")
done

echo
if [ "$DRY" = 1 ]; then
    echo "gpu_check plan: at most ${PLANNED} s of stages within a budget of ${BUDGET_S} s"
elif [ -f "$OUT/bench.json" ]; then
    "$PY" -c "import json, sys; from lightning_llmfast.bench.report import markdown_report; \
print(markdown_report(json.load(open(sys.argv[1]))))" "$OUT/bench.json" || true
    echo
    echo "gpu_check: $(($(date +%s) - START_S)) s in all, logs in $OUT"
fi
echo "| stage | status | seconds |"
echo "|---|---|---|"
for row in "${RESULTS[@]}"; do
    IFS='|' read -r name status secs <<<"$row"
    echo "| $name | $status | $secs |"
done
exit "$FAILED"
