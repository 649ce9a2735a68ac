#!/usr/bin/env bash
# System packages the test suite uses beyond pip, installed with apt-get when missing:
#   bubblewrap (`bwrap`): the Python sandbox's kernel-enforced backend
#                         (megatron_earl/docs/agents.md, "The Python sandbox").
# Idempotent, and never fails the command it is part of: with everything present it does nothing;
# when not root, without apt-get, or when apt is unreachable it says so on stderr and exits 0 --
# the tests that need a missing package then skip with that reason, the others run.
# Run: bash scripts/install_system_deps.sh   (the README's test command and .ci/run do)
set -u
missing=()
command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "install_system_deps: missing ${missing[*]}, not installed (needs root and apt-get);" \
        "the tests that need it will skip" >&2
    exit 0
fi
if ! { timeout 300 apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive timeout 300 apt-get install -y -qq \
        --no-install-recommends "${missing[@]}"; } >&2; then
    echo "install_system_deps: apt-get could not install ${missing[*]} (apt unreachable?);" \
        "the tests that need it will skip" >&2
fi
exit 0
