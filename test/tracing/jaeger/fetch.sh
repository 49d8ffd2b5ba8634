#!/usr/bin/env bash
# Build Jaeger's all-in-one binary (cmd/jaeger) for the tracing tests.
#
# Usage: test/tracing/jaeger/fetch.sh
#
# The version is pinned by go.mod beside this script: a module of its own,
# so that Jaeger's large dependency tree stays out of the main module's
# go.mod and go.sum. The binary lands in
#   ${XDG_CACHE_HOME:-$HOME/.cache}/outbox-relay/jaeger-<version>/jaeger
# with a stamp naming the recipe (go.mod, go.sum and the Go version). A
# matching stamp skips the build, so running the script again is cheap; the
# first build compiles a few thousand packages and takes minutes.
#
# Keep JaegerVersion in test/harness/jaeger.go in step with go.mod (a test
# checks it).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cache_root="${XDG_CACHE_HOME:-$HOME/.cache}/outbox-relay"

die() {
	echo "jaeger fetch: $*" >&2
	exit 1
}

command -v go >/dev/null 2>&1 || die "go is not on PATH; install Go 1.26+"
command -v sha256sum >/dev/null 2>&1 || die "sha256sum is not on PATH (coreutils)"

version=$(awk '$1 == "github.com/jaegertracing/jaeger" {print $2}' "$here/go.mod")
[ -n "$version" ] || die "$here/go.mod does not require github.com/jaegertracing/jaeger"
recipe=$(cat "$here/go.mod" "$here/go.sum" | sha256sum | cut -d' ' -f1)
want="version=$version recipe=$recipe go=$(go env GOVERSION)"
dest="$cache_root/jaeger-$version"
stamp="$dest/built.stamp"

mkdir -p "$dest"
if command -v flock >/dev/null 2>&1; then
	exec 9>"$dest/build.lock"
	flock 9
fi
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$dest/jaeger" ]; then
	echo "jaeger $version: already built in $dest"
	exit 0
fi

rm -f "$stamp"
log="$dest/build.log"
tmp="$dest/jaeger.tmp.$$"
echo "jaeger $version: building cmd/jaeger from the Go module proxy (minutes the first time)..."
start=$SECONDS
if ! (cd "$here" && CGO_ENABLED=0 go build -trimpath -o "$tmp" github.com/jaegertracing/jaeger/cmd/jaeger) >"$log" 2>&1; then
	tail -n 40 "$log" >&2 || true
	rm -f "$tmp"
	die "jaeger $version: go build failed (full log: $log)"
fi
"$tmp" version >>"$log" 2>&1 || {
	rm -f "$tmp"
	die "jaeger $version: the built binary does not run (log: $log)"
}
mv "$tmp" "$dest/jaeger"
echo "$want" >"$stamp"
echo "jaeger $version: built $dest/jaeger ($(du -h "$dest/jaeger" | cut -f1)) in $((SECONDS - start))s"
