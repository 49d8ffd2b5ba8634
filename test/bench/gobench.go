package main

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
)

// GoBenchResult is one line of `go test -bench` output.
type GoBenchResult struct {
	Name        string  `json:"name"`
	NsPerOp     float64 `json:"ns_per_op"`
	BytesPerOp  float64 `json:"bytes_per_op"`
	AllocsPerOp float64 `json:"allocs_per_op"`
}

var benchLine = regexp.MustCompile(`^(Benchmark\S+?)(-\d+)?\s+\d+\s+([\d.]+) ns/op\s+([\d.]+) B/op\s+([\d.]+) allocs/op`)

// runGoBench runs relay's BenchmarkDecodeAndBuild and parses its lines.
func runGoBench(ctx context.Context, root string) ([]GoBenchResult, error) {
	cmd := exec.CommandContext(ctx, "go", "test", "-run", "^$", "-bench", "^BenchmarkDecodeAndBuild$",
		"-benchmem", "-benchtime", "200000x", "-count", "1", "./relay/")
	cmd.Dir = root
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return nil, fmt.Errorf("%w: %s", err, out.String())
	}
	var res []GoBenchResult
	sc := bufio.NewScanner(&out)
	for sc.Scan() {
		m := benchLine.FindStringSubmatch(strings.TrimSpace(sc.Text()))
		if m == nil {
			continue
		}
		r := GoBenchResult{Name: strings.TrimPrefix(m[1], "BenchmarkDecodeAndBuild/")}
		r.NsPerOp, _ = strconv.ParseFloat(m[3], 64)
		r.BytesPerOp, _ = strconv.ParseFloat(m[4], 64)
		r.AllocsPerOp, _ = strconv.ParseFloat(m[5], 64)
		res = append(res, r)
	}
	if len(res) == 0 {
		return nil, fmt.Errorf("no benchmark lines in output: %s", out.String())
	}
	return res, nil
}

// runCmd runs a command in dir with extra environment, failing with its
// output.
func runCmd(dir string, env []string, name string, args ...string) error {
	cmd := exec.Command(name, args...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), env...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, out)
	}
	return nil
}
