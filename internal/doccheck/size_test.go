package doccheck

import (
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// The README stays a page a newcomer reads in five minutes, and no docs
// page outgrows what a reader scrolls through: a page that would must be
// split by topic (the generated flag reference is split by command for
// this reason).
const (
	readmeLimit = 15_000
	pageLimit   = 25_000
)

func TestNoPageOutgrowsItsLimit(t *testing.T) {
	root := filepath.Join("..", "..")
	check := func(path string, limit int) {
		info, err := os.Stat(path)
		if err != nil {
			t.Fatal(err)
		}
		if info.Size() > int64(limit) {
			rel, _ := filepath.Rel(root, path)
			t.Errorf("%s is %d bytes, over its limit of %d: split it by topic and link the parts", rel, info.Size(), limit)
		}
	}
	check(filepath.Join(root, "README.md"), readmeLimit)
	pages := 0
	err := filepath.WalkDir(filepath.Join(root, "docs"), func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() && strings.HasSuffix(path, ".md") {
			pages++
			check(path, pageLimit)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if pages < 10 {
		t.Fatalf("found %d pages under docs/: the walk missed the site", pages)
	}
}
