#!/usr/bin/env bash
# Debian's chromium and its driver, for the chat page's browser test (tests/serving/test_chat_page.py).
# Idempotent: nothing to do when both are on PATH; installs them with apt-get when run as root;
# otherwise says how (the test then fails with the same hint: it never skips).
set -euo pipefail
if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q chromium chromium-driver >/dev/null \
    || { apt-get update -q >/dev/null && apt-get install -y -q chromium chromium-driver >/dev/null; }
else
  echo "setup_browser.sh: chromium/chromedriver missing and not root: run 'apt-get install chromium chromium-driver'" \
       "as root, or tests/serving/test_chat_page.py fails" >&2
fi
