#!/usr/bin/env bash
# Run the engine-path checkpoint tests and a real launch through deepy.py against stock DeepSpeed
# releases, one virtualenv per release.
#
#   tools/compat/check_deepspeed_releases.sh [--one-rank] [--launch-only] [VERSION ...]
#
# Each release gets $DSENV_ROOT/dsenv-<VERSION> (created once, reused afterwards) holding torch
# $TORCH_VERSION, that DeepSpeed release, megatron-core $MEGATRON_CORE_VERSION and the test
# dependencies; DeepSpeed's compiled ops go to <venv>/ext, not to the shared torch-extensions cache.
# Then tests/unit/test_ckpt_engine.py, tests/unit/test_ckpt_engine_gpt.py and (unless --one-rank)
# tests/distributed/test_ckpt_engine_distributed.py (2 CPU ranks) run in it, then three runs of
# `python deepy.py train.py configs/tiny.yml ...` as a user starts them (2 CPU ranks, or 1 with
# --one-rank): a short run that saves, a resume of it, and a fine-tune from it; each must exit 0 and
# leave the expected `latest` (--launch-only: only these). One verdict line per release is printed. Logs: <venv>/check-*.log.
# Exit status: 0 when every release passed.
#
# Without VERSION it checks the releases the README claims (the oldest, newest and one per minor
# line in between); a green run means the claim still holds. Known failures with torch 2.13 on CPU:
# 0.14.x/0.15.x (their own torch.load calls predate weights_only=False, so DeepSpeed cannot load
# its own checkpoints) and 0.18.7-0.18.9 (the ZeRO-1/2 step fails on 2 CPU ranks: the flat 16-bit
# buffer is built under autograd and gloo's all-gather refuses to write into it).
#
# Not part of the pytest suite: the first run of a release installs packages and compiles an op
# (a few minutes); then a release takes about 2 minutes for the launch and 4 for the tests on 2 busy
# cores (2026-11-30, torch 2.13.0), several times that when the machine is crowded.
#
# Environment: DSENV_ROOT (default /tmp), BASE_PYTHON (default python3), TORCH_VERSION (default
# 2.13.0), MEGATRON_CORE_VERSION (default 0.16.1).
set -u -o pipefail

DEFAULT_VERSIONS=(0.16.0 0.16.9 0.17.6 0.18.6 0.19.8)
DSENV_ROOT=${DSENV_ROOT:-/tmp}
BASE_PYTHON=${BASE_PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
MEGATRON_CORE_VERSION=${MEGATRON_CORE_VERSION:-0.16.1}
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)

test_files=(tests/unit/test_ckpt_engine.py tests/unit/test_ckpt_engine_gpt.py tests/distributed/test_ckpt_engine_distributed.py)
launch_ranks=2
launch_only=0
versions=()
for arg in "$@"; do
    case "$arg" in
        --one-rank) test_files=(tests/unit/test_ckpt_engine.py tests/unit/test_ckpt_engine_gpt.py); launch_ranks=1 ;;
        --launch-only) launch_only=1 ;;
        -h|--help) sed -n '2,28p' "${BASH_SOURCE[0]}"; exit 0 ;;
        -*) echo "unknown option $arg (see --help)" >&2; exit 2 ;;
        *) versions+=("$arg") ;;
    esac
done
[ ${#versions[@]} -eq 0 ] && versions=("${DEFAULT_VERSIONS[@]}")

# Creates the venv of one release unless a complete one exists; returns non-zero when pip fails.
ensure_venv() {
    local venv=$1 version=$2
    [ -f "$venv/.installed" ] && return 0
    rm -rf "$venv"
    "$BASE_PYTHON" -m venv "$venv" &&
        "$venv/bin/pip" install -q "torch==$TORCH_VERSION" &&
        "$venv/bin/pip" install -q "deepspeed==$version" "megatron-core==$MEGATRON_CORE_VERSION" \
            pyyaml tokenizers safetensors numpy tqdm pytest &&
        touch "$venv/.installed"
}

# "N passed, M failed ..." from a pytest log, or "no summary" when pytest died before one.
summary_of() {
    local line
    line=$(grep -E '^(=+ )?([0-9]+ [a-z]+(, )?)+.* in [0-9.]+s|no tests ran' "$1" | tail -n 1 | sed -E 's/^=+ //; s/ =+$//')
    echo "${line:-no summary}"
}

# One deepy.py run in the release's venv; fails unless it exits 0 and `latest` in $3 names tag $4.
deepy_run() {
    local venv=$1 config=$2 save=$3 tag=$4 log=$5
    (cd "$REPO_ROOT" && TORCH_EXTENSIONS_DIR="$venv/ext" PYTHONPATH="$REPO_ROOT" \
        "$venv/bin/python" deepy.py train.py configs/tiny.yml "$config") >>"$log" 2>&1 &&
        [ "$(cat "$save/latest" 2>/dev/null)" = "$tag" ]
}

# Start (4 steps, saved), resume (to step 6, same directory), fine-tune (2 steps from step 4's weights).
launch_check() {
    local venv=$1 log=$2 work=$1/launch-check
    rm -rf "$work" && mkdir -p "$work"
    # lr_decay_iters: the resume keeps the schedule the first run saved
    local common="log_interval: 1, eval_interval: 100, eval_iters: 1, train_micro_batch_size_per_gpu: 2, lr_decay_iters: 6, num_gpus: $launch_ranks"
    echo "{$common, train_iters: 4, save: $work/run, load: $work/run}" >"$work/start.yml"
    echo "{$common, train_iters: 6, save: $work/run, load: $work/run}" >"$work/resume.yml"
    echo "{$common, train_iters: 2, load: $work/run, iteration: 4, finetune: true, save: $work/finetuned}" >"$work/finetune.yml"
    : >"$log"
    deepy_run "$venv" "$work/start.yml" "$work/run" global_step4 "$log" || { echo "start failed"; return 1; }
    deepy_run "$venv" "$work/resume.yml" "$work/run" global_step6 "$log" || { echo "resume failed"; return 1; }
    grep -qE "iteration +5/6" "$log" || { echo "resume did not continue at iteration 5"; return 1; }
    deepy_run "$venv" "$work/finetune.yml" "$work/finetuned" global_step2 "$log" || { echo "fine-tune failed"; return 1; }
    echo "start, resume, fine-tune passed"
}

verdicts=()
all_passed=1
for version in "${versions[@]}"; do
    venv="$DSENV_ROOT/dsenv-$version"
    started=$SECONDS
    if ! ensure_venv "$venv" "$version" >"$DSENV_ROOT/dsenv-$version-install.log" 2>&1; then
        verdicts+=("$version: INSTALL FAILED (see $DSENV_ROOT/dsenv-$version-install.log)")
        all_passed=0
        continue
    fi
    if ! import_error=$(cd "$REPO_ROOT" && "$venv/bin/python" -c "import deepspeed" 2>&1 >/dev/null); then
        verdicts+=("$version: DOES NOT IMPORT with torch $TORCH_VERSION: $(echo "$import_error" | tail -n 1)")
        all_passed=0
        continue
    fi
    results=()
    release_passed=1
    [ $launch_only -eq 1 ] && test_files=()
    for test_file in "${test_files[@]}"; do
        log="$venv/check-$(basename "$test_file" .py).log"
        # One-rank files get LOCAL_SIZE as DeepSpeed's launcher would set it: releases before 0.16
        # otherwise count CPU devices with numactl and fail where it is not installed.
        local_size=(LOCAL_SIZE=1)
        [[ $test_file == *distributed* ]] && local_size=()
        (cd "$REPO_ROOT" && env "${local_size[@]}" TORCH_EXTENSIONS_DIR="$venv/ext" "$venv/bin/python" -m pytest "$test_file" \
            -q -p no:cacheprovider --show-capture=no --tb=short -rfE) >"$log" 2>&1
        status=$?
        [ $status -ne 0 ] && release_passed=0
        results+=("$(basename "$test_file" .py): $(summary_of "$log")")
    done
    launch_log="$venv/check-launch.log"
    if ! launch_result=$(launch_check "$venv" "$launch_log"); then
        release_passed=0
    fi
    results+=("deepy.py launch with $launch_ranks rank(s): $launch_result")
    verdict="PASS"
    if [ $release_passed -eq 0 ]; then
        verdict="FAIL"
        all_passed=0
    fi
    joined=$(printf '%s; ' "${results[@]}")
    verdicts+=("$version: $verdict (${joined%; }) [$((SECONDS - started))s, logs $venv/check-*.log]")
    echo "${verdicts[-1]}" >&2
done

echo "DeepSpeed releases against the engine-path tests and a deepy.py launch (torch $TORCH_VERSION):"
printf '  %s\n' "${verdicts[@]}"
[ $all_passed -eq 1 ]
