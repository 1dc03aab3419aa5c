#!/usr/bin/env bash
# Boots systemd in a throwaway container and runs README.md's "Run it as a service" steps in it as
# written, then checks what the unit promises: `systemctl reload` keeps the same process and
# takes the new [policy]/[guards], a reload of a broken file changes nothing, a killed daemon is
# restarted, `systemctl stop` drains cleanly. Prints one JSON object; exits non-zero on failure.
#
# Needs root, systemd-nspawn (Debian package systemd-container), overlayfs, and the package
# index pip uses. The container is an overlay of / on tmpfs inside a private mount namespace:
# nothing it writes reaches the host. It shares the host's network (pip; loopback ports 5555,
# 5556 and 9464 of the example configuration must be free).
#   sudo systemd/check-in-container.sh [checkout]      (default: this script's checkout)
set -euo pipefail
SRC="$(cd "${1:-$(dirname "$0")/..}" && pwd)"
[ "$(id -u)" = 0 ] || { echo "run as root" >&2; exit 2; }
command -v systemd-nspawn >/dev/null || { echo "systemd-nspawn missing (apt-get install systemd-container)" >&2; exit 2; }

if [ "${_INSIDE_NS:-}" != 1 ]; then
  exec env _INSIDE_NS=1 unshare --mount --propagation private "$0" "$SRC"
fi

WORK="$(mktemp -d /tmp/dynaresized-container.XXXXXX)"
mount -t tmpfs -o size=4g tmpfs "$WORK"
mkdir -p "$WORK/upper" "$WORK/work" "$WORK/root"
mount -t overlay overlay -o "lowerdir=/,upperdir=$WORK/upper,workdir=$WORK/work" "$WORK/root"
R="$WORK/root"
rm -rf "$R/etc/dynaresized" "$R/opt/dynaresized" "$R/var/lib/dynaresized" "$R/var/lib/private/dynaresized" \
       "$R/etc/systemd/system/dynaresized.service" "$R/root/src"
mkdir -p "$R/root/src"
git -C "$SRC" ls-files -z --cached --others --exclude-standard | tar -C "$SRC" --null -T - -c | tar -C "$R/root/src" -x

systemd-nspawn -D "$R" --boot --register=no --keep-unit -M dynaresized-check --console=passive \
  --resolv-conf=off --timezone=off --link-journal=no > "$WORK/nspawn.log" 2>&1 &
NSPAWN=$!
trap 'kill -TERM $NSPAWN 2>/dev/null; wait $NSPAWN 2>/dev/null; umount -R "$WORK"; rmdir "$WORK"' EXIT
for _ in $(seq 60); do
  INIT="$(pgrep -P $NSPAWN -x systemd || true)"
  [ -n "$INIT" ] && break
  sleep 0.5
done
[ -n "$INIT" ] || { cat "$WORK/nspawn.log" >&2; exit 1; }
ct() { nsenter -t "$INIT" -a -- env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
       HOME=/root TERM=dumb bash -c "$1"; }
for _ in $(seq 60); do
  state="$(ct 'systemctl is-system-running' 2>/dev/null || true)"
  case "$state" in running|degraded) break;; esac
  sleep 0.5
done

fail() { echo "{\"ok\": false, \"step\": \"$1\", \"systemd\": \"$(ct 'systemctl --version | head -1')\"}"
         ct 'systemctl status dynaresized --no-pager -l; journalctl -u dynaresized --no-pager | tail -30' >&2 || true
         exit 1; }

# README's block, line by line, comments stripped; the command synopsis is not a command,
# and `events --follow` runs until stopped.
awk '/^## Run it as a service/{f=1} f&&/^```sh/{g=1;next} g&&/^```/{exit} g' "$R/root/src/README.md" > "$WORK/steps"
steps=0
while IFS= read -r line; do
  cmd="$(printf '%s' "${line%%#*}" | sed 's/[[:space:]]*$//')"
  case "$cmd" in ""|*"pause | resume"*) continue;; esac
  steps=$((steps + 1))
  echo "== $cmd" >&2
  if [[ "$cmd" == *"--follow"* ]]; then
    ct "cd /root/src && timeout 3 $cmd > /dev/null" || [ $? = 124 ] || fail "$cmd"
  else
    ct "cd /root/src && $cmd" >&2 < /dev/null || fail "$cmd"
  fi
done < "$WORK/steps"

pid() { ct 'systemctl show -p MainPID --value dynaresized'; }
policy() { ct "dynaresized status | sed -n 's/^policy *//p'"; }
before="$(pid)"
ct 'sed -i "s/^name = .*/name = \"planner\"/; s/^cooldown_steps = .*/cooldown_steps = 5/" /etc/dynaresized/config.toml'
ct 'systemctl reload dynaresized' || fail "systemctl reload"
sleep 1
[ "$(pid)" = "$before" ] && [ "$(policy)" = planner ] || fail "reload keeps the process and takes the policy"
ct 'sed -i "s/^name = .*/name = \"hysterisis\"/" /etc/dynaresized/config.toml && systemctl reload dynaresized' \
  || fail "reload of a broken file"
sleep 1
[ "$(pid)" = "$before" ] && [ "$(policy)" = planner ] && ct 'systemctl is-active -q dynaresized' \
  || fail "a broken file changes nothing"
ct 'journalctl -u dynaresized --no-pager | grep -q "reload refused"' || fail "reload refused is logged"
ct 'sed -i "s/^name = .*/name = \"hysteresis\"/" /etc/dynaresized/config.toml'
ct 'systemctl kill -s KILL dynaresized'
for _ in $(seq 40); do
  now="$(pid)"; { [ "$now" != 0 ] && [ "$now" != "$before" ] && ct 'systemctl is-active -q dynaresized'; } && break
  sleep 0.5
done
[ "$now" != "$before" ] && [ "$(policy)" = hysteresis ] || fail "a killed daemon is restarted"
ct 'systemctl stop dynaresized' || fail "systemctl stop"
result="$(ct 'systemctl show -p Result --value dynaresized')"
[ "$result" = success ] || fail "stop drains cleanly (Result=$result)"
exposure="$(ct 'systemd-analyze security dynaresized --no-pager' | sed -n 's/.*exposure level for dynaresized.service: \([0-9.]*\).*/\1/p')"
echo "{\"ok\": true, \"readme_steps\": $steps, \"reload_same_pid\": true, \"broken_reload_kept\": true," \
     "\"restarted_after_kill\": true, \"stop_result\": \"$result\", \"exposure\": ${exposure:-null}," \
     "\"systemd\": \"$(ct 'systemctl --version | head -1')\"}"
