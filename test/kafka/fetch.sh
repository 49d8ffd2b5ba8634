#!/usr/bin/env bash
# Fetch Apache Kafka broker jars from Maven Central for the end-to-end tests.
#
# Usage: test/kafka/fetch.sh [version...]
#
# Each version lands in
#   ${XDG_CACHE_HOME:-$HOME/.cache}/outbox-relay/kafka-<version>/libs/
# with a stamp file beside it. A version whose stamp matches this recipe is
# skipped, so running the script again is cheap. Maven keeps its own
# repository (~/.m2) as usual.
#
# Keep DEFAULT_VERSIONS in step with ApacheKafka4Version and
# ApacheKafka3Version in test/harness/apachekafka.go (a test checks it).
set -euo pipefail

DEFAULT_VERSIONS="4.4.0 3.9.2"

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
pom="$here/pom.xml"
cache_root="${XDG_CACHE_HOME:-$HOME/.cache}/outbox-relay"

die() {
	echo "fetch.sh: $*" >&2
	exit 1
}

command -v mvn >/dev/null 2>&1 || die "mvn (Apache Maven) is not on PATH; install it (e.g. apt-get install maven)"
[ -f "$pom" ] || die "recipe $pom is missing"

if command -v sha256sum >/dev/null 2>&1; then
	recipe_sum=$(sha256sum "$pom" | cut -d' ' -f1)
else
	recipe_sum=$(cksum "$pom" | cut -d' ' -f1)
fi

# profile_for prints the pom.xml profile that adds the logging binding the
# given Kafka generation expects: Log4j 2 for 4.x, reload4j for 3.x.
profile_for() {
	case "$1" in
	3.*) echo kafka3 ;;
	4.*) echo kafka4 ;;
	*) die "unsupported Kafka version $1 (want 3.x or 4.x)" ;;
	esac
}

fetch_one() {
	local version=$1
	local profile
	profile=$(profile_for "$version")
	local dest="$cache_root/kafka-$version"
	local libs="$dest/libs"
	local stamp="$dest/fetched.stamp"
	local want="version=$version recipe=$recipe_sum"

	mkdir -p "$dest"
	# Serialise concurrent runs for the same version (e.g. parallel make jobs).
	if command -v flock >/dev/null 2>&1; then
		exec 9>"$dest/fetch.lock"
		flock 9
	fi

	if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -d "$libs" ]; then
		echo "kafka $version: already fetched in $libs"
		return 0
	fi

	local tmp="$dest/libs.tmp.$$"
	local log="$dest/fetch.log"
	rm -rf "$tmp"
	rm -f "$stamp"
	echo "kafka $version: fetching org.apache.kafka:kafka_2.13:$version with Maven..."
	local start=$SECONDS
	if ! mvn -B -ntp -f "$pom" -P "$profile" -Dkafka.version="$version" \
		dependency:copy-dependencies -DoutputDirectory="$tmp" >"$log" 2>&1; then
		tail -n 40 "$log" >&2 || true
		rm -rf "$tmp"
		die "kafka $version: maven could not fetch the jars (full log: $log)"
	fi
	[ -f "$tmp/kafka_2.13-$version.jar" ] ||
		die "kafka $version: kafka_2.13-$version.jar missing after fetch (log: $log)"

	# A quick check that the classpath runs, when Java is here to run it.
	if command -v java >/dev/null 2>&1; then
		if ! java -Xmx64m -XX:TieredStopAtLevel=1 -cp "$tmp/*" kafka.tools.StorageTool random-uuid >>"$log" 2>&1; then
			tail -n 20 "$log" >&2 || true
			rm -rf "$tmp"
			die "kafka $version: the fetched jars do not run kafka.tools.StorageTool (log: $log)"
		fi
	else
		echo "kafka $version: warning: java not on PATH, classpath not checked" >&2
	fi

	rm -rf "$libs"
	mv "$tmp" "$libs"
	echo "$want" >"$stamp"
	exec 9>&- 2>/dev/null || true
	echo "kafka $version: fetched $(ls "$libs" | wc -l) jars ($(du -sh "$libs" | cut -f1)) into $libs in $((SECONDS - start))s"
}

versions=("$@")
if [ ${#versions[@]} -eq 0 ]; then
	read -r -a versions <<<"$DEFAULT_VERSIONS"
fi
for v in "${versions[@]}"; do
	fetch_one "$v"
done
