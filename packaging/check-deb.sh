#!/usr/bin/env bash
# Builds the .deb, checks its contents, then installs, runs, verifies and purges it inside a
# throwaway Debian root of its own (own /usr, /etc, /var; built once with debootstrap and kept
# under /var/cache/maru-ci), and checks that the purge leaves that root as it found it.
#
# The host is never touched: nothing is installed on it, no unit, user, group or state of its
# changes, whatever was there before (a marud started from the README keeps /var/lib/maru).
# The script checks that too: it compares the host's files before and after.
#
# Run as root; CI runs it from .ci/run. CARGO_TARGET_DIR is honoured.
set -euo pipefail
cd "$(dirname "$0")/.."
target="${CARGO_TARGET_DIR:-target}"
cache="${MARU_CI_CACHE:-/var/cache/maru-ci}"
suite=bookworm

if [ "$(id -u)" != 0 ]; then
    echo "run as root: the package is checked in a chroot" >&2
    exit 1
fi
need=()
command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
command -v unshare >/dev/null 2>&1 || need+=(util-linux)
if [ ${#need[@]} -gt 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
command -v cargo-deb >/dev/null 2>&1 || cargo install cargo-deb --locked --quiet

cargo build --release --workspace --bins
deb=$(cargo deb -p maru-daemon --no-build --quiet 2>/dev/null | tail -n 1)
[ -f "$deb" ] || deb=$(ls -t "$target"/debian/maru_*.deb | head -n 1)
echo "built $deb"

listing=$(dpkg-deb -c "$deb")
for f in ./usr/sbin/marud ./usr/bin/maructl ./usr/bin/marutop ./lib/systemd/system/marud.service \
         ./etc/maru/marud.toml ./usr/share/doc/maru/README.md ./usr/share/doc/maru/SEMANTICS.md; do
    grep -q " $f\$" <<<"$listing" || { echo "missing from the package: $f" >&2; exit 1; }
done
echo "package lists binaries, unit, config and docs"

# The pristine root: a minimal Debian with systemd (for systemd-analyze), made once.
pristine="$cache/debroot-$suite"
if [ ! -f "$pristine/.complete" ]; then
    rm -rf "$pristine"
    mkdir -p "$cache"
    mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
    echo "making a throwaway Debian root in $pristine (once)"
    debootstrap --variant=minbase --include=systemd "$suite" "$pristine" \
        "${mirror:-http://deb.debian.org/debian}" >"$cache/debootstrap.log" 2>&1 \
        || { tail -n 20 "$cache/debootstrap.log" >&2; exit 1; }
    touch "$pristine/.complete"
fi

# What the host has before; compared at the end, whatever happens in between.
snapshot() {
    find /usr/sbin /usr/bin /lib/systemd/system /etc /var/lib -xdev \
        -not -path "/var/lib/dpkg/*" -not -path "/var/lib/apt/*" -not -path "/var/lib/systemd/*" \
        2>/dev/null | sort
    getent group maru || true
    dpkg -s maru 2>/dev/null | head -n 2 || true
}
work=$(mktemp -d)
cleanup() { rm -rf "$work"; }
trap cleanup EXIT
snapshot >"$work/host-before"

# The check runs in a mount namespace of its own: the overlay (the pristine root below, a
# scratch directory above) and /proc vanish with it on every path, even a kill.
mkdir -p "$work/upper" "$work/ovl" "$work/root"
cp "$deb" "$work/maru.deb"
unshare --mount --propagation private -- bash -euo pipefail -c '
    work=$1; pristine=$2
    root=$work/root
    mount -t overlay overlay -o "lowerdir=$pristine,upperdir=$work/upper,workdir=$work/ovl" "$root"
    mount -t proc proc "$root/proc"
    mount -t tmpfs tmpfs "$root/tmp"
    cp "$work/maru.deb" "$root/tmp/"
    in_root() { chroot "$root" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin "$@"; }
    listing() {
        in_root find /usr /lib/systemd/system /etc /var/lib -xdev \
            -not -path "/var/lib/dpkg/*" -not -path "/var/lib/apt/*" 2>/dev/null | sort
        in_root getent group maru || true
    }
    listing >"$work/root-before"
    in_root dpkg -i /tmp/maru.deb >/dev/null
    for f in /usr/sbin/marud /usr/bin/maructl /usr/bin/marutop /lib/systemd/system/marud.service /etc/maru/marud.toml; do
        [ -e "$root$f" ] || { echo "not installed: $f" >&2; exit 1; }
    done
    in_root getent group maru >/dev/null || { echo "the maru group was not created" >&2; exit 1; }
    in_root /usr/sbin/marud --version
    in_root /usr/bin/maructl --version
    in_root /usr/bin/marutop --version
    in_root systemd-analyze verify /lib/systemd/system/marud.service
    echo "installed in a throwaway root; its binaries run; systemd-analyze verify accepts the unit"
    # The state a running marud would have kept, then the purge.
    mkdir -p "$root/var/lib/maru" && echo state >"$root/var/lib/maru/state"
    in_root dpkg --purge maru >/dev/null
    listing >"$work/root-after"
    if ! diff -u "$work/root-before" "$work/root-after"; then
        echo "installing and removing the package left the differences above" >&2
        exit 1
    fi
    echo "purged; nothing left behind in the root"
' check-deb "$work" "$pristine"

snapshot >"$work/host-after"
if ! diff -u "$work/host-before" "$work/host-after"; then
    echo "checking the package changed the host (above)" >&2
    exit 1
fi
echo "the host is as it was"
