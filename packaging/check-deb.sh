#!/usr/bin/env bash
# Builds the .deb, checks its contents and the unit, installs it, removes (purges) it, and
# checks that nothing is left behind. Run as root; CI runs it from .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v cargo-deb >/dev/null 2>&1 || cargo install cargo-deb --locked --quiet
cargo build --release --workspace --bins
deb=$(cargo deb -p maru-daemon --no-build --quiet 2>/dev/null | tail -n 1)
[ -f "$deb" ] || deb=$(ls -t target/debian/maru_*.deb | head -n 1)
echo "built $deb"

listing=$(dpkg-deb -c "$deb")
for f in ./usr/sbin/marud ./usr/bin/maructl ./usr/bin/marutop ./lib/systemd/system/marud.service \
         ./etc/maru/marud.toml ./usr/share/doc/maru/README.md ./usr/share/doc/maru/SEMANTICS.md; do
    grep -q " $f\$" <<<"$listing" || { echo "missing from the package: $f" >&2; exit 1; }
done
echo "package lists binaries, unit, config and docs"

if dpkg -s maru >/dev/null 2>&1; then
    echo "maru is already installed here; not touching it" >&2
    exit 1
fi
had_group=false
getent group maru >/dev/null && had_group=true
before=$(mktemp)
find /usr/sbin /usr/bin /lib/systemd/system /etc /usr/share/doc /var/lib -xdev -not -path "/var/lib/dpkg/*" -not -path "/var/lib/apt/*" 2>/dev/null | sort > "$before"
cleanup() { dpkg --purge maru >/dev/null 2>&1 || true; rm -f "$before" "${after:-}"; }
trap cleanup EXIT

dpkg -i "$deb" >/dev/null
for f in /usr/sbin/marud /usr/bin/maructl /usr/bin/marutop /lib/systemd/system/marud.service /etc/maru/marud.toml; do
    [ -e "$f" ] || { echo "not installed: $f" >&2; exit 1; }
done
getent group maru >/dev/null || { echo "the maru group was not created" >&2; exit 1; }
/usr/sbin/marud --version
/usr/bin/maructl --version
/usr/bin/marutop --version
systemd-analyze verify /lib/systemd/system/marud.service
echo "installed; systemd-analyze verify accepts the unit"

dpkg --purge maru >/dev/null
after=$(mktemp)
find /usr/sbin /usr/bin /lib/systemd/system /etc /usr/share/doc /var/lib -xdev -not -path "/var/lib/dpkg/*" -not -path "/var/lib/apt/*" 2>/dev/null | sort > "$after"
if ! diff -u "$before" "$after"; then
    echo "installing and removing the package left the differences above" >&2
    exit 1
fi
if ! $had_group && getent group maru >/dev/null; then
    echo "the maru group was left behind" >&2
    exit 1
fi
echo "removed; nothing left behind"
