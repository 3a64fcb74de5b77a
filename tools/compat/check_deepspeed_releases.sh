#!/usr/bin/env bash
# Run the engine-path checkpoint tests against stock DeepSpeed releases, one virtualenv per release.
#
#   tools/compat/check_deepspeed_releases.sh [--one-rank] [VERSION ...]
#
# Each release gets $DSENV_ROOT/dsenv-<VERSION> (created once, reused afterwards) holding torch
# $TORCH_VERSION, that DeepSpeed release, megatron-core $MEGATRON_CORE_VERSION and the test
# dependencies; DeepSpeed's compiled ops go to <venv>/ext, not to the shared torch-extensions cache.
# Then tests/test_ckpt_engine.py, tests/test_ckpt_engine_gpt.py and (unless --one-rank)
# tests/test_ckpt_engine_distributed.py (2 CPU ranks) run in it, and one verdict line per release is
# printed. Logs: <venv>/check-<test file>.log. Exit status: 0 when every release passed.
#
# Without VERSION it checks the releases the README claims (the oldest, newest and one per minor
# line in between); a green run means the claim still holds. Known failures with torch 2.13 on CPU:
# 0.14.x/0.15.x (their own torch.load calls predate weights_only=False, so DeepSpeed cannot load
# its own checkpoints) and 0.18.7-0.18.9 (the ZeRO-1/2 step fails on 2 CPU ranks: the flat 16-bit
# buffer is built under autograd and gloo's all-gather refuses to write into it).
#
# Not part of the pytest suite: the first run of a release installs packages and compiles an op
# (a few minutes), and each release then takes 2-5 minutes on 2 busy cores.
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

test_files=(tests/test_ckpt_engine.py tests/test_ckpt_engine_gpt.py tests/test_ckpt_engine_distributed.py)
versions=()
for arg in "$@"; do
    case "$arg" in
        --one-rank) test_files=(tests/test_ckpt_engine.py tests/test_ckpt_engine_gpt.py) ;;
        -h|--help) sed -n '2,23p' "${BASH_SOURCE[0]}"; exit 0 ;;
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
    verdict="PASS"
    if [ $release_passed -eq 0 ]; then
        verdict="FAIL"
        all_passed=0
    fi
    joined=$(printf '%s; ' "${results[@]}")
    verdicts+=("$version: $verdict (${joined%; }) [$((SECONDS - started))s, logs $venv/check-*.log]")
    echo "${verdicts[-1]}" >&2
done

echo "DeepSpeed releases against the engine-path tests (torch $TORCH_VERSION):"
printf '  %s\n' "${verdicts[@]}"
[ $all_passed -eq 1 ]
