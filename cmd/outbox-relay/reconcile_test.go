package main

import (
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/reconcile"
)

func TestParseWindow(t *testing.T) {
	now := time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)
	for _, tc := range []struct {
		since, until string
		want         [2]time.Time
		err          string
	}{
		{since: "2h", until: "1m", want: [2]time.Time{now.Add(-2 * time.Hour), now.Add(-time.Minute)}},
		{since: "2026-11-30T09:30:00Z", until: "0s", want: [2]time.Time{now.Add(-150 * time.Minute), now}},
		{since: "2026-11-30T11:00:00+01:00", until: "2026-11-30T11:30:00Z", want: [2]time.Time{now.Add(-2 * time.Hour), now.Add(-30 * time.Minute)}},
		{since: "", until: "1m", err: "--since is required"},
		{since: "1m", until: "2h", err: "is not before"},
		{since: "-1h", until: "0s", err: "must not be negative"},
		{since: "yesterday", until: "0s", err: "want a duration ago"},
	} {
		since, until, err := parseWindow(tc.since, tc.until, now)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("parseWindow(%q, %q) error %v, want one containing %q", tc.since, tc.until, err, tc.err)
			}
			continue
		}
		if err != nil || !since.Equal(tc.want[0]) || !until.Equal(tc.want[1]) {
			t.Errorf("parseWindow(%q, %q) = %s, %s, %v; want %s, %s", tc.since, tc.until, since, until, err, tc.want[0], tc.want[1])
		}
	}
}

func TestRenderBar(t *testing.T) {
	got := renderBar(reconcile.Progress{Phase: "kafka", Done: 450, Total: 1000, Elapsed: 12 * time.Second}, 10)
	if want := "kafka     [====>     ]  45%  450/1000  12s"; got != want {
		t.Errorf("renderBar = %q, want %q", got, want)
	}
	if got := renderBar(reconcile.Progress{Phase: "rows", Done: 2000, Total: 1000}, 4); !strings.Contains(got, "[====] 100%") {
		t.Errorf("renderBar past the total = %q, want a full bar", got)
	}
}

// reconcile keeps the exit-code contract: 2 for bad flags before touching
// anything, 1 when PostgreSQL cannot be reached; its help lists its own
// flags and run's lists the periodic check's.
func TestReconcileExitCodesAndFlags(t *testing.T) {
	dsn := deadDSN(t)
	for _, args := range [][]string{
		{"reconcile", "--pg-dsn", dsn, "--kafka-brokers", "127.0.0.1:1"},
		{"reconcile", "--pg-dsn", dsn, "--kafka-brokers", "127.0.0.1:1", "--since", "1h", "--until", "2h"},
		{"reconcile", "--pg-dsn", dsn, "--since", "1h"},
		{"reconcile", "--pg-dsn", dsn, "--kafka-brokers", "127.0.0.1:1", "--since", "1h", "--compression", "brotli"},
		{"reconcile", "--pg-dsn", dsn, "--kafka-brokers", "127.0.0.1:1", "--since", "1h", "extra-argument"},
		{"reconcile", "--no-such-flag"},
		{"run", "--pg-dsn", dsn, "--kafka-brokers", "127.0.0.1:1", "--reconcile-every", "-1m"},
	} {
		if code, _, stderr := runCaptured(args...); code != exitUsage || strings.Contains(stderr, "hunter2") {
			t.Errorf("%v: exit %d, want %d\n%s", args, code, exitUsage, stderr)
		}
	}
	code, _, stderr := runCaptured("reconcile", "--pg-dsn", dsn, "--kafka-brokers", "127.0.0.1:1", "--since", "1h")
	if code != exitFailure || strings.Contains(stderr, "hunter2") {
		t.Errorf("reconcile with PostgreSQL unreachable: exit %d, want %d\n%s", code, exitFailure, stderr)
	}
	for _, tc := range []struct {
		args []string
		want []string
	}{
		{[]string{"reconcile", "-h"}, []string{"-since", "-until", "-republish", "-json", "-topic", "-on-permanent-error", "-kafka-tls", "-quarantine-table"}},
		{[]string{"run", "-h"}, []string{"-reconcile-every", "-reconcile-window", "-reconcile-settle", "-topic", "-on-permanent-error"}},
	} {
		code, _, help := runCaptured(tc.args...)
		if code != exitOK {
			t.Errorf("%v: exit %d", tc.args, code)
		}
		for _, f := range tc.want {
			if !strings.Contains(help, "  "+f+" ") && !strings.Contains(help, "  "+f+"\n") {
				t.Errorf("%v does not list %s", tc.args, f)
			}
		}
	}
}

// Off a terminal, progress goes to the log as structured lines.
func TestProgressIsLoggedOffATerminal(t *testing.T) {
	var logged strings.Builder
	bar := newProgressBar(&logged)
	if bar.terminal {
		t.Fatal("a strings.Builder counts as a terminal")
	}
	log := zerolog.New(&logged)
	bar.update(log)(reconcile.Progress{Phase: "kafka", Done: 10, Total: 40, Elapsed: 3 * time.Second})
	if out := logged.String(); !strings.Contains(out, `"message":"reconcile progress"`) || !strings.Contains(out, `"phase":"kafka"`) ||
		!strings.Contains(out, `"done":10`) || !strings.Contains(out, `"total":40`) || strings.Contains(out, "\r") {
		t.Fatalf("progress off a terminal logged %q", out)
	}
}
