#!/bin/sh
# Checks the Debian package `make deb` built: its metadata and contents, an install into a
# throwaway root, the systemd unit (systemd-analyze verify) and the scripts (shellcheck). Fails loudly on the first problem.
set -eu
cd "$(dirname "$0")/.."

deb=""
for file in "${CARGO_TARGET_DIR:-target}"/debian/felix_*.deb; do [ -e "$file" ] && deb=$file; done
[ -n "$deb" ] || { echo "package-test: FAIL: no target/debian/felix_*.deb (make deb)" >&2; exit 1; }
fail() { echo "package-test: FAIL: $*" >&2; exit 1; }

info=$(dpkg-deb --info "$deb")
for field in "Package: felix" "Depends:" "Section: net"; do
    echo "$info" | grep -q "$field" || fail "dpkg-deb --info lacks '$field'"
done
echo "$info" | grep -q "conffiles" || fail "no conffiles control file"
contents=$(dpkg-deb --contents "$deb")
for path in ./usr/bin/felix ./etc/felix/felix.toml ./usr/lib/systemd/system/felix.service \
    ./usr/lib/systemd/system/felix-tune.service \
    ./usr/share/man/man1/felix.1.gz \
    ./usr/share/bash-completion/completions/felix; do
    echo "$contents" | grep -q " $path\$" || fail "the package lacks $path"
done

root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
mkdir -p "$root/var/lib/dpkg/info" "$root/var/lib/dpkg/updates"
touch "$root/var/lib/dpkg/status"
# Unpack only: the maintainer scripts (adduser) would run chrooted in a root with no shell.
dpkg --root="$root" --force-depends --force-not-root --unpack "$deb" >/dev/null
unit="$root/usr/lib/systemd/system/felix.service"
[ -f "$unit" ] || fail "felix.service is not installed"
grep -q '^ExecStart=/usr/bin/felix broker$' "$unit" || fail "felix.service does not run /usr/bin/felix"
tune_unit="$root/usr/lib/systemd/system/felix-tune.service"
grep -q '^ExecStart=-/usr/bin/felix tune --apply$' "$tune_unit" \
    || fail "felix-tune.service does not run /usr/bin/felix tune --apply"
grep -q '^After=.*felix-tune.service' "$unit" || fail "felix.service does not start after felix-tune.service"
[ -x "$root/usr/bin/felix" ] || fail "/usr/bin/felix is not installed executable"
"$root/usr/bin/felix" --version | grep -q '^felix ' || fail "the installed binary does not run"
# An unpacked conffile waits as .dpkg-new until the package is configured.
conf="$root/etc/felix/felix.toml.dpkg-new"
[ -f "$conf" ] || conf="$root/etc/felix/felix.toml"
grep -q '^data_dir = "/var/lib/felix"$' "$conf" || fail "felix.toml data_dir"
FELIX_CONFIG="$conf" "$root/usr/bin/felix" config >/dev/null \
    || fail "the shipped felix.toml does not load"

if command -v systemd-analyze >/dev/null; then
    # verify needs the binaries the units name: check them against the installed root.
    # The root gets the host's own units too (targets the units order against); man pages
    # are not looked up (--man=no: the root has no man).
    cp -rn /usr/lib/systemd/system/. "$root/usr/lib/systemd/system/"
    # ExecReload runs /bin/kill, from procps (a dependency of the package): the host's stands in.
    [ -x /bin/kill ] || fail "/bin/kill (procps) is missing on this host"
    mkdir -p "$root/bin" && cp -n /bin/kill "$root/bin/kill"
    # shellcheck disable=SC2016 # $MAINPID is the unit's, not the shell's
    grep -q '^ExecReload=/bin/kill -HUP \$MAINPID$' "$unit" || fail "felix.service has no SIGHUP reload"
    systemd-analyze verify --man=no --root="$root" /usr/lib/systemd/system/felix.service \
        /usr/lib/systemd/system/felix-tune.service || fail "systemd-analyze verify"
else
    echo "package-test: skipped systemd-analyze verify: systemd-analyze is not installed"
fi

if command -v shellcheck >/dev/null; then
    shellcheck packaging/debian/postinst packaging/test.sh || fail "shellcheck of packaging/"
    # The script `felix tune --script` prints, as the installed binary renders it per profile.
    for profile in azure baremetal test; do
        script="$root/tune-$profile.sh"
        FELIX_CONFIG="$conf" "$root/usr/bin/felix" tune --script --profile "$profile" >"$script" \
            || fail "felix tune --script --profile $profile"
        shellcheck --shell=sh "$script" || fail "shellcheck of felix tune --script --profile $profile"
    done
else
    echo "package-test: skipped shellcheck: shellcheck is not installed"
fi
echo "package-test: PASS ($deb)"
