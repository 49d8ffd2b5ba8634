package docgen

import (
	"flag"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Describe reads every kind of collector the relay uses, a vector with no
// child yet and a family split over constant labels included.
func TestDescribeReadsNameHelpLabelsAndType(t *testing.T) {
	ms, err := Describe(func(r prometheus.Registerer) {
		r.MustRegister(
			prometheus.NewCounterVec(prometheus.CounterOpts{Name: "a_total", Help: `quoted "help", with \ a backslash`}, []string{"topic", "partition"}),
			prometheus.NewGauge(prometheus.GaugeOpts{Name: "b"}),
			prometheus.NewHistogram(prometheus.HistogramOpts{Name: "c_seconds", Help: "h"}),
			prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "d_total", Help: "x", ConstLabels: prometheus.Labels{"reason": "one"}}, func() float64 { return 0 }),
			prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "d_total", Help: "x", ConstLabels: prometheus.Labels{"reason": "two"}}, func() float64 { return 0 }),
			prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "go_skipped"}, []string{"x"}),
		)
	}, "go_")
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]Metric{}
	for _, m := range ms {
		got[m.Name] = m
	}
	if len(got) != 4 {
		t.Fatalf("want a_total, b, c_seconds and d_total, got %+v", ms)
	}
	a := got["a_total"]
	if a.Type != "counter" || a.Help != `quoted "help", with \ a backslash` || strings.Join(a.Labels, ",") != "topic,partition" {
		t.Errorf("a_total: %+v", a)
	}
	if got["b"].Type != "gauge" || got["c_seconds"].Type != "histogram" || got["d_total"].Type != "counter" {
		t.Errorf("types: %+v", ms)
	}
	if d := got["d_total"]; len(d.ConstLabels) != 2 {
		t.Errorf("d_total should keep both constant label values: %+v", d)
	}
	page := string(MetricsMarkdown("intro", []MetricGroup{{Title: "T", Intro: "i", Metrics: ms}}, ""))
	for _, want := range []string{"`a_total` | counter | `topic` `partition` |", "`d_total` | counter | `reason` |", `quoted "help", with \ a backslash`} {
		if !strings.Contains(page, want) {
			t.Errorf("the page lacks %q:\n%s", want, page)
		}
	}
}

// A flag two commands declare alike is one row; declared differently, a
// row each.
func TestFlagsMergeAcrossCommands(t *testing.T) {
	mk := func(jsonUsage string) *flag.FlagSet {
		fs := flag.NewFlagSet("x", flag.ContinueOnError)
		fs.String("pg-dsn", "", "the DSN | with a pipe")
		fs.Bool("json", false, jsonUsage)
		fs.Duration("wait", time.Second, "how long")
		return fs
	}
	cli := CLI{
		Program: "p", EnvName: func(f string) string { return "P_" + strings.ToUpper(strings.ReplaceAll(f, "-", "_")) },
		Commands: []Command{{Name: "a", Flags: mk("print JSON")}, {Name: "b", Flags: mk("print the report as JSON")}},
	}
	page := string(cli.FlagsMarkdown("commands.md", ""))
	for _, want := range []string{
		"`--pg-dsn` | `P_PG_DSN` | string |  | all | the DSN \\| with a pipe |",
		"| bool | `false` | a | print JSON |",
		"| bool | `false` | b | print the report as JSON |",
		"`--wait` | `P_WAIT` | duration | `1s` | all |",
	} {
		if !strings.Contains(page, want) {
			t.Errorf("the page lacks %q:\n%s", want, page)
		}
	}
	man := string(cli.ManPage(nil, ""))
	if !strings.Contains(man, `.B \-\-pg\-dsn \fIstring\fR`) || !strings.Contains(man, `.B \-\-json`+"\n") {
		t.Errorf("man page:\n%s", man)
	}
}

// With OwnPage set, the flags only that command takes move to their own
// page, the shared ones stay, and the commands page links each flag to the
// page that lists it.
func TestOwnPageTakesTheFlagsOfItsCommandAlone(t *testing.T) {
	a := flag.NewFlagSet("a", flag.ContinueOnError)
	a.String("pg-dsn", "", "the DSN")
	a.Int("only-a", 1, "a's own")
	b := flag.NewFlagSet("b", flag.ContinueOnError)
	b.String("pg-dsn", "", "the DSN")
	cli := CLI{Program: "p", OwnPage: "a", EnvName: func(f string) string { return "P_" + strings.ToUpper(strings.ReplaceAll(f, "-", "_")) },
		Commands: []Command{{Name: "a", Flags: a}, {Name: "b", Flags: b}}}
	shared, own := string(cli.FlagsMarkdown("commands.md", "a-flags.md")), string(cli.OwnFlagsMarkdown("commands.md", "flags.md"))
	if !strings.Contains(shared, "`--pg-dsn`") || strings.Contains(shared, "`--only-a`") || !strings.Contains(shared, "(a-flags.md)") {
		t.Errorf("shared page:\n%s", shared)
	}
	if !strings.Contains(own, "`--only-a`") || strings.Contains(own, "`--pg-dsn`") {
		t.Errorf("a's page:\n%s", own)
	}
	commands := string(cli.Markdown("flags.md", "a-flags.md"))
	if !strings.Contains(commands, "(a-flags.md#flag-only-a)") || !strings.Contains(commands, "(flags.md#flag-pg-dsn)") {
		t.Errorf("commands page links:\n%s", commands)
	}
}
