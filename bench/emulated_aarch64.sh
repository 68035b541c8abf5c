#!/usr/bin/env bash
# prefixkv end to end on an emulated 64-bit ARM (aarch64) machine, from a Debian x86-64 host, as root:
# a Debian bookworm arm64 root (debootstrap) run through qemu-user (binfmt_misc), a Python 3.11 venv
# with PyPI's aarch64 CPU torch and transformers, prefixkv installed from this checkout, then
# bench/emulated_aarch64_check.py three ways (the kernels as chosen, every native kernel forced,
# none) and `prefixkv generate` on the same tiny random Llama.
#
#     sudo bash bench/emulated_aarch64.sh
#
# Idempotent: the root, the venv and the checkpoint are kept in $ARM_ROOT (default
# /var/tmp/prefixkv-arm64/root) and reused; prefixkv is re-copied from this checkout on every run
# (tracked and untracked files, not ignored ones). Takes ~15 min for the root, ~10 for the venv, then
# a few minutes a run. Timings under qemu mean nothing about an ARM CPU's speed: this checks that
# prefixkv builds, falls back and generates correctly there, no more.
#
# Environment: ARM_ROOT (the root's folder), ARM_TORCH (the torch to install; default the Makefile's
# TORCH_ARM, what `make install` puts on an ARM machine: the newest torch whose aarch64 wheel on PyPI
# is CPU-only), ARM_MIRROR (the Debian mirror).
set -euo pipefail
say() { printf '\n== [%s] %s\n' "$(date -u +%H:%M:%S)" "$*"; }

REPO=$(cd "$(dirname "$0")/.." && pwd)
ROOT=${ARM_ROOT:-/var/tmp/prefixkv-arm64/root}
TORCH=${ARM_TORCH:-$(sed -n 's/^TORCH_ARM := //p' "$REPO/Makefile")}
[ -n "$TORCH" ] || { echo "no TORCH_ARM in $REPO/Makefile" >&2; exit 1; }
MIRROR=${ARM_MIRROR:-http://deb.debian.org/debian}
[ "$(id -u)" = 0 ] || { echo "run as root (debootstrap, binfmt_misc, chroot)" >&2; exit 1; }

say "host tools: qemu-user-static, debootstrap"
if ! command -v qemu-aarch64-static >/dev/null || ! command -v debootstrap >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq qemu-user-static debootstrap
fi

say "binfmt_misc: aarch64 binaries run through qemu-aarch64-static (so the chroot's subprocesses do too)"
if [ ! -e /proc/sys/fs/binfmt_misc/register ]; then
    mount binfmt_misc -t binfmt_misc /proc/sys/fs/binfmt_misc
fi
if [ ! -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]; then
    # Debian's entry: flag F opens the interpreter now, so it works inside the chroot too
    cat /usr/lib/binfmt.d/qemu-aarch64.conf >/proc/sys/fs/binfmt_misc/register
fi
grep -E '^(enabled|interpreter|flags)' /proc/sys/fs/binfmt_misc/qemu-aarch64

if [ ! -e "$ROOT/.prefixkv-root-done" ]; then
    say "debootstrap: Debian bookworm arm64 into $ROOT (once; ~15 min under qemu)"
    mkdir -p "$ROOT"
    debootstrap --arch=arm64 --variant=minbase \
        --include=python3,python3-venv,python3-pip,python3-dev,g++,ca-certificates \
        bookworm "$ROOT" "$MIRROR"
    touch "$ROOT/.prefixkv-root-done"
else
    say "debootstrap: reusing $ROOT"
fi

say "mounts: /proc, /sys, /dev into the root (undone on exit)"
MOUNTED=()
cleanup() {
    local i
    for ((i = ${#MOUNTED[@]} - 1; i >= 0; i--)); do umount -l "${MOUNTED[i]}" || true; done
}
trap cleanup EXIT
for fs in proc sys dev; do
    if ! mountpoint -q "$ROOT/$fs"; then
        if [ "$fs" = proc ]; then mount -t proc proc "$ROOT/proc"; else mount --rbind "/$fs" "$ROOT/$fs"; fi
        MOUNTED+=("$ROOT/$fs")
    fi
done
cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
# pip reads the system's bundle (PIP_CERT below, not its own certifi's): with any certificate
# authorities this host added locally (a TLS-inspecting proxy's, say), the root reaches PyPI as it does
in_root() {
    chroot "$ROOT" /usr/bin/env -i HOME=/root PATH=/opt/venv/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 \
        PIP_CERT=/etc/ssl/certs/ca-certificates.crt PIP_DISABLE_PIP_VERSION_CHECK=1 "$@"
}
if compgen -G '/usr/local/share/ca-certificates/*.crt' >/dev/null; then
    mkdir -p "$ROOT/usr/local/share/ca-certificates"
    cp /usr/local/share/ca-certificates/*.crt "$ROOT/usr/local/share/ca-certificates/"
    in_root update-ca-certificates >/dev/null
fi
in_root uname -m
in_root python3 --version

say "prefixkv: this checkout ($REPO) copied to $ROOT/opt/prefixkv"
rm -rf "$ROOT/opt/prefixkv"
mkdir -p "$ROOT/opt/prefixkv"
(cd "$REPO" && git ls-files -co --exclude-standard -z | tar --null -cf - -T -) | tar -xf - -C "$ROOT/opt/prefixkv"
(cd "$REPO" && git log -1 --format='%h %s' && git status --short | head -20)

if [ ! -e "$ROOT/opt/venv/.prefixkv-deps-done" ]; then
    say "venv: torch==$TORCH (CPU, aarch64), prefixkv and its dependencies (once; pip runs under qemu)"
    in_root python3 -m venv /opt/venv
    in_root pip install -q --upgrade pip
    in_root pip install -q --only-binary=torch "torch==$TORCH"
    in_root pip install -q /opt/prefixkv
    touch "$ROOT/opt/venv/.prefixkv-deps-done"
fi
say "venv: prefixkv from the fresh copy (no dependency changes)"
in_root pip install -q --no-deps --force-reinstall /opt/prefixkv
in_root python -c 'import platform, torch, transformers; print(platform.machine(), "torch", torch.__version__, "transformers", transformers.__version__, "ATen", torch.backends.cpu.get_cpu_capability(), "OpenMP", torch.backends.openmp.is_available())'

# a cold start each run: the kernels are built (or not) and checked from nothing
rm -rf "$ROOT/root/.cache/prefixkv"
CHECK=(python /opt/prefixkv/bench/emulated_aarch64_check.py --folder /var/tmp/tiny-llama)
status=0
run_check() {
    local name=$1
    shift
    say "check ($name): prefixkv LLM vs transformers generate, greedy float32"
    local start=$SECONDS
    in_root "$@" "${CHECK[@]}" 2>&1 | tee "/tmp/prefixkv-arm64-$name.log" || status=1
    echo "(${name}: $((SECONDS - start)) s wall, under qemu)"
    if grep -n 'Traceback' "/tmp/prefixkv-arm64-$name.log"; then
        echo "!! a traceback in the $name run" >&2
        status=1
    fi
    echo "-- what prefixkv logged about native code (prefixkv.model.kernels / row_split):"
    grep -E 'prefixkv\.model\.(kernels|row_split)' "/tmp/prefixkv-arm64-$name.log" || echo "(nothing)"
}
run_check default
run_check native PREFIXKV_KERNEL_CHOICE=native
run_check off PREFIXKV_CPU_KERNELS=0
# the fall-backs, for real on aarch64: no compiler on PATH (a minimal image), and one that fails
run_check no-compiler PATH=/opt/venv/bin
printf '%s\n' '#!/bin/sh' '# a stand-in for a compiler that cannot build the kernels here' \
    '[ "$1" = --version ] && { echo "failing-c++ (a stand-in)"; exit 0; }' \
    'echo "failing-c++: error: a stand-in'"'"'s failure" >&2' 'exit 1' >"$ROOT/opt/failing-c++"
chmod +x "$ROOT/opt/failing-c++"
run_check failing-compiler CXX=/opt/failing-c++
# Under qemu-user /proc/cpuinfo is the host's, so g++ -march=native finds no Arm CPU and builds for
# plain armv8-a (NEON). What -march=native picks on an AWS Graviton 3 (Neoverse V1: SVE, bfloat16),
# built through a wrapper (its --version differs, so the build cache keys it apart) and run on
# qemu's "max" CPU, which has SVE: every native kernel forced.
printf '%s\n' '#!/bin/bash' '# g++ for an Arm Neoverse V1 (AWS Graviton 3) in place of -march=native' \
    'if [ "$1" = --version ]; then g++ --version | sed "1s/\$/ [-mcpu=neoverse-v1]/"; exit; fi' \
    'args=(); for a in "$@"; do [ "$a" = -march=native ] || args+=("$a"); done' \
    'exec g++ "${args[@]}" -mcpu=neoverse-v1' >"$ROOT/opt/g++-neoverse-v1"
chmod +x "$ROOT/opt/g++-neoverse-v1"
run_check neoverse-v1 CXX=/opt/g++-neoverse-v1 PREFIXKV_KERNEL_CHOICE=native

say "prefixkv generate (the CLI), greedy, on the same checkpoint; each token prints as a word (w0 ... w299)"
start=$SECONDS
in_root prefixkv generate --model /var/tmp/tiny-llama --tokenizer /var/tmp/tiny-llama/words --dtype float32 \
    --max-model-len 256 --kv-cache-memory-bytes 8M --temperature 0 --max-tokens 16 "w256 w10 w11 w12" \
    2>/tmp/prefixkv-arm64-cli.log | tee /tmp/prefixkv-arm64-cli.out || status=1
cat /tmp/prefixkv-arm64-cli.log
echo "(cli: $((SECONDS - start)) s wall, under qemu)"
if grep -n 'Traceback' /tmp/prefixkv-arm64-cli.log; then status=1; fi
if cmp -s /tmp/prefixkv-arm64-cli.out "$ROOT/var/tmp/tiny-llama/expected-cli.txt"; then
    echo "CLI: the same 16 tokens as transformers' generate"
else
    echo "!! CLI: not transformers' tokens: $(cat "$ROOT/var/tmp/tiny-llama/expected-cli.txt")" >&2
    status=1
fi

say "done: $([ $status = 0 ] && echo OK || echo FAILED) (logs: /tmp/prefixkv-arm64-*.log)"
exit $status
