#!/usr/bin/env bash
# Make sure the browser tests (tests/browser) can drive a Chromium: find one, or install Debian's or
# Ubuntu's `chromium` package with apt-get. Playwright for Python comes with set-up (the dev extra);
# Playwright's own browser download (`playwright install`) is never used: the tests drive this Chromium.
#   scripts/browser_setup.sh          # make test-browser: exit 1, saying why, when no Chromium can be had
#   scripts/browser_setup.sh --try    # make test: say why and exit 0, so the browser tests skip and the rest runs
# CHROMIUM=/path/to/chrome picks the browser yourself (any Chromium-based build, e.g. Google Chrome).
set -uo pipefail
mode=${1:-}

give_up() {
    if [ "$mode" = "--try" ]; then
        echo "browser tests will be SKIPPED: $1" >&2
        exit 0
    fi
    echo "browser setup failed: $1" >&2
    exit 1
}

works() {  # a browser binary that starts and prints its version
    [ -n "$1" ] && "$1" --version >/dev/null 2>&1
}

found() {
    if [ -n "${CHROMIUM:-}" ]; then
        works "$CHROMIUM" && echo "$CHROMIUM"
        return
    fi
    for name in chromium chromium-browser google-chrome; do
        path=$(command -v "$name") && works "$path" && { echo "$path"; return; }
    done
}

if [ -n "${CHROMIUM:-}" ] && ! works "$CHROMIUM"; then
    give_up "CHROMIUM=$CHROMIUM does not start ('$CHROMIUM --version' fails)"
fi

browser=$(found)
if [ -z "$browser" ]; then
    command -v apt-get >/dev/null || give_up "no Chromium found and no apt-get to install one: install Chromium or Google Chrome and set CHROMIUM=/path/to/it"
    if [ "$(id -u)" = 0 ]; then
        sudo=()
    elif sudo -n true 2>/dev/null; then
        sudo=(sudo -n)
    else
        give_up "no Chromium found, and installing it (apt-get install chromium) needs root or password-less sudo"
    fi
    echo "browser setup: installing Debian's chromium with apt-get (about a minute)"
    export DEBIAN_FRONTEND=noninteractive
    if ! "${sudo[@]}" apt-get install -y -q chromium >/tmp/dtlib-apt.log 2>&1; then
        # A fresh machine may not have read the package lists yet.
        "${sudo[@]}" apt-get update -q >>/tmp/dtlib-apt.log 2>&1
        "${sudo[@]}" apt-get install -y -q chromium >>/tmp/dtlib-apt.log 2>&1 \
            || give_up "apt-get install chromium failed (the last lines of /tmp/dtlib-apt.log: $(tail -n 3 /tmp/dtlib-apt.log | tr '\n' ' '))"
    fi
    browser=$(found)
    [ -n "$browser" ] || give_up "apt-get installed chromium, but no working chromium is on PATH"
fi
echo "browser tests will use $browser ($("$browser" --version 2>/dev/null | head -n 1))"
