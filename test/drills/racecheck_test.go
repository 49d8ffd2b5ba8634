package drills

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// TestRaceSkipsRunInMakeTest pins that `make test` runs every test that
// skips under -race: sarama's data race on its transactional error path
// (IBM/sarama #2913, #2915) makes the fencing and poison tests skip in the
// -race pass, and the Makefile runs them again without -race. A new test
// that skips under -race and is missing from the Makefile's patterns would
// otherwise never run in `make test`.
func TestRaceSkipsRunInMakeTest(t *testing.T) {
	makefile, err := os.ReadFile(filepath.Join("..", "..", "Makefile"))
	if err != nil {
		t.Fatal(err)
	}
	vars := map[string]string{}
	for _, line := range strings.Split(string(makefile), "\n") {
		if name, value, ok := strings.Cut(line, " := "); ok {
			vars[name] = strings.ReplaceAll(value, "$$", "$")
		}
	}
	found := 0
	for dir, variable := range map[string]string{filepath.Join("..", "..", "publisher"): "NORACE_PUBLISHER", ".": "NORACE_DRILLS"} {
		pattern, ok := vars[variable]
		if !ok {
			t.Fatalf("the Makefile has no %s: the tests that skip under -race in %s never run", variable, dir)
		}
		// go test matches the part before the first slash against the
		// top-level test names.
		top := regexp.MustCompile(strings.SplitN(pattern, "/", 2)[0])
		for _, name := range raceSkippingTests(t, dir) {
			found++
			if !top.MatchString(name) {
				t.Errorf("%s skips under -race but the Makefile's %s (%s) does not run it without -race", name, variable, pattern)
			}
		}
	}
	if found == 0 {
		t.Fatal("found no test that skips under -race: this check looks for the wrong names")
	}
}

// raceSkippingTests lists the top-level tests in dir whose bodies look at
// raceEnabled, directly or through skipSaramaTxnErrorRace.
func raceSkippingTests(t *testing.T, dir string) []string {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(dir, "*_test.go"))
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	fset := token.NewFileSet()
	for _, file := range files {
		f, err := parser.ParseFile(fset, file, nil, parser.SkipObjectResolution)
		if err != nil {
			t.Fatal(err)
		}
		for _, decl := range f.Decls {
			fn, ok := decl.(*ast.FuncDecl)
			if !ok || fn.Body == nil || !strings.HasPrefix(fn.Name.Name, "Test") {
				continue
			}
			skips := false
			ast.Inspect(fn.Body, func(n ast.Node) bool {
				if id, ok := n.(*ast.Ident); ok && (id.Name == "raceEnabled" || id.Name == "skipSaramaTxnErrorRace") {
					skips = true
				}
				return !skips
			})
			if skips {
				names = append(names, fn.Name.Name)
			}
		}
	}
	return names
}
