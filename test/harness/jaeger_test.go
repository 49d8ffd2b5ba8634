package harness

import (
	"os"
	"regexp"
	"testing"
)

// The Jaeger version the harness looks for and the one the tool module
// pins (which fetch.sh builds) must be the same, or the harness would look
// for a binary nobody built.
func TestJaegerVersionMatchesToolModule(t *testing.T) {
	b, err := os.ReadFile("../tracing/jaeger/go.mod")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^\s*github\.com/jaegertracing/jaeger (v\S+)`).FindSubmatch(b)
	if m == nil {
		t.Fatal("test/tracing/jaeger/go.mod does not require github.com/jaegertracing/jaeger")
	}
	if string(m[1]) != JaegerVersion {
		t.Errorf("test/tracing/jaeger/go.mod pins %s, JaegerVersion is %s: keep them in step", m[1], JaegerVersion)
	}
}
