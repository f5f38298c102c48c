#!/usr/bin/env bash
# Install the headless browser the web page's tests drive: Debian's chromium (the distribution's
# package; Playwright's own browser downloads are not used). Idempotent; prints the browser's
# path on success. Exits 1 with the reason on stderr where it cannot be installed (not root and
# no chromium, no apt-get, no package index reachable): tests/web skips with that reason.
set -euo pipefail
for exe in /usr/bin/chromium /usr/bin/chromium-browser; do
    if [ -x "$exe" ]; then echo "$exe"; exit 0; fi
done
if ! command -v apt-get >/dev/null; then
    echo "no chromium at /usr/bin/chromium and no apt-get to install it" >&2; exit 1
fi
if [ "$(id -u)" != 0 ]; then
    echo "no chromium at /usr/bin/chromium; installing it needs root (apt-get install chromium)" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
log="$(mktemp)"
if ! { apt-get update && apt-get install -y --no-install-recommends chromium fonts-dejavu-core; } \
        >"$log" 2>&1; then
    echo "apt-get install chromium failed: $(tail -n 3 "$log" | tr '\n' ' ')" >&2
    rm -f "$log"; exit 1
fi
rm -f "$log"
[ -x /usr/bin/chromium ] || { echo "apt-get installed no /usr/bin/chromium" >&2; exit 1; }
echo /usr/bin/chromium
