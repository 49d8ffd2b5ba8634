// Command doccheck fails when a Markdown page names a file, directory,
// package, type, function or method the module does not have; see package
// doccheck for what it reads. Usage, from the module root:
//
//	go run ./internal/doccheck/cmd/doccheck $(git ls-files 'docs/*.md') README.md
package main

import (
	"fmt"
	"os"

	"github.com/outbox-relay/outbox-relay/internal/doccheck"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: doccheck PAGE.md...  (run from the module root)")
		os.Exit(2)
	}
	ix, err := doccheck.LoadIndex(".")
	if err != nil {
		fmt.Fprintln(os.Stderr, "doccheck:", err)
		os.Exit(2)
	}
	failed := false
	for _, page := range os.Args[1:] {
		problems, err := doccheck.CheckPage(ix, page)
		if err != nil {
			fmt.Fprintln(os.Stderr, "doccheck:", err)
			os.Exit(2)
		}
		for _, p := range problems {
			fmt.Fprintln(os.Stderr, p)
			failed = true
		}
	}
	if failed {
		os.Exit(1)
	}
}
