#!/usr/bin/env bash
# Install a virtual X display for the GUI tests when it is missing and we are allowed to.
# Without it the GUI tests skip with a reason; nothing else depends on it.
if command -v Xvfb >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  echo "[tempera] installing xvfb and xdotool for the GUI tests"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq xvfb xdotool) \
    >/dev/null 2>&1 || echo "[tempera] could not install xvfb; GUI tests will be skipped"
else
  echo "[tempera] Xvfb not found (install xvfb to run the GUI tests); GUI tests will be skipped"
fi
exit 0
