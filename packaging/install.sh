#!/usr/bin/env bash
# Installs maru on a host without dpkg (or removes it with --uninstall).
#   packaging/install.sh [--bin-dir DIR] [--uninstall]
# DIR holds marud, maructl and marutop (default: target/release of this checkout; build it
# with `cargo build --release`). Installs to /usr/local, the unit to /etc/systemd/system,
# the config to /etc/maru (kept if present), and creates the `maru` group.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
bin_dir="$here/../target/release"
uninstall=false
while [ $# -gt 0 ]; do
    case "$1" in
        --bin-dir) bin_dir="$2"; shift 2 ;;
        --uninstall) uninstall=true; shift ;;
        *) echo "usage: $0 [--bin-dir DIR] [--uninstall]" >&2; exit 2 ;;
    esac
done
[ "$(id -u)" = 0 ] || { echo "run as root" >&2; exit 1; }

unit=/etc/systemd/system/marud.service
if $uninstall; then
    if [ -d /run/systemd/system ]; then
        systemctl disable --now marud.service 2>/dev/null || true
    fi
    rm -f /usr/local/sbin/marud /usr/local/bin/maructl /usr/local/bin/marutop "$unit"
    rm -rf /usr/local/share/doc/maru
    echo "removed maru (kept /etc/maru and /var/lib/maru; delete them to forget the configuration and namespaces)"
    exit 0
fi

for b in marud maructl marutop; do
    [ -x "$bin_dir/$b" ] || { echo "$bin_dir/$b is missing: run cargo build --release" >&2; exit 1; }
done
install -D -m 755 "$bin_dir/marud" /usr/local/sbin/marud
install -D -m 755 "$bin_dir/maructl" /usr/local/bin/maructl
install -D -m 755 "$bin_dir/marutop" /usr/local/bin/marutop
sed 's#/usr/sbin/marud#/usr/local/sbin/marud#' "$here/marud.service" > "$unit"
chmod 644 "$unit"
[ -e /etc/maru/marud.toml ] || install -D -m 644 "$here/marud.toml" /etc/maru/marud.toml
install -d /usr/local/share/doc/maru
install -m 644 "$here/../README.md" "$here"/../doc/*.md /usr/local/share/doc/maru/
getent group maru >/dev/null || groupadd --system maru
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload
    echo "installed; start it with: systemctl enable --now marud"
else
    echo "installed; start it with: /usr/local/sbin/marud --config /etc/maru/marud.toml"
fi
