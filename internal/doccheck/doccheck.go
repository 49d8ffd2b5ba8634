// Package doccheck keeps the project's Markdown pages true to the code: it
// fails a page that names a file, directory, package, type, function or
// method that does not exist, or places a declaration in a file it is not
// in. `make lint` runs it (cmd/doccheck) over every page under docs/ and
// README.md.
//
// Only inline code spans are read; fenced code blocks (diagrams, shell
// sessions, configuration) are not. A span is checked when it is one of:
//
//   - A path: relative, made of letters, digits and "_.@-" separated by
//     "/", holding a "/" or ending in ".go", optionally followed by
//     ":LINE" or ":LINE-LINE" (`relay/loop.go`, `cmd/outbox-relay/`,
//     `relay/loop.go:58`). It must exist relative to the module root (or
//     to the page's directory); a trailing "/" says it is a directory; a
//     line must be within the file. A bare file name (`main.go`) must be a
//     Go file somewhere in the module. Not paths, so not checked: spans
//     starting with "/", "~" or "-" (endpoints, absolute paths, flags),
//     URLs, anything with a space (commands, SQL), import paths of other
//     modules (first element holds a dot), and, when absent, standard
//     library packages (`database/sql`) and paths the root .gitignore
//     lists (`bench/runs/`, made by runs).
//   - A qualified Go name, with or without a call: `pkg.Name`,
//     `pkg.Type.Method`, `Type.Method`, `Type.Field`, `(*Type).Method`,
//     `(pkg.Type).Method`, `pkg.Func(args)`; a leading "*", "&" or "[]" is
//     dropped. pkg is a package name of this module, Type a type this
//     module declares (interfaces' methods and structs' fields count).
//     After a package name only an exported name is Go, so `relay.state`
//     (a JSON key) is not checked. A longer chain is followed through
//     fields to its end (`pkg.Type.field.Member`, `Type.field.member`,
//     promoted members included), until a method or a field of a type
//     this module does not declare; unqualified, only once its first
//     member is the type's (`table.field.event.id` is a Debezium
//     setting). A qualifier that is neither (`pgx.Tx`, `cleanup.policy`, a config key)
//     leaves the span unchecked, except in the `(*Type).Method` form, which
//     is Go by its shape and must resolve.
//   - An unqualified call, `Name()` or `Name(args)`: a function or method
//     of that name must exist. Names with "_" (SQL, `pg_current_wal_lsn()`)
//     and the few non-Go function names in NonGoCalls (PromQL) are not Go.
//
// A bare identifier in mixed case (`progressKeeper`, `TopicPendingError`)
// must be declared somewhere in the module: nothing else the pages quote
// is written so. Any other bare identifier (`streamer`, `clock`) is
// checked only where the page places it, in one of these forms (the names may be a list joined by ","
// and "and"; emphasis markers between spans are ignored):
//
//	`name` in `dir/file.go`
//	`name` (`dir/file.go` ...)
//	`dir/file.go`: `name`, `other`
//	`dir/file.go: name`            (one span)
//
// Placed, a name must be declared in that file (a Go file) or package (a
// directory). The placement forms apply to any checked name too.
//
// In a table whose header's first cell is "package", "file" or
// "directory", each row's first-cell spans are paths, a bare one
// (`replication`) included.
package doccheck

import (
	"bufio"
	"bytes"
	"fmt"
	"go/build"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
)

// NonGoCalls are function names the pages use in PromQL, which look like
// an unqualified Go call.
var NonGoCalls = map[string]bool{"by": true, "deriv": true, "rate": true, "increase": true}

// Problem is one false statement of a page.
type Problem struct {
	Page string // as given to CheckPage
	Line int
	Msg  string
}

func (p Problem) String() string {
	return fmt.Sprintf("%s:%d: %s: rename it in the page or restore the code", p.Page, p.Line, p.Msg)
}

// span is one inline code span of a page.
type span struct {
	text       string
	line       int
	start, end int // byte offsets of the backticks in the block's text
}

// block is a paragraph, list item run or table: lines with no blank line
// between them, outside fenced code.
type block struct {
	text  string
	lines []int // page line of each line of text
}

var (
	pathRe = regexp.MustCompile(`^(\./)?[A-Za-z0-9_.@-]+(/[A-Za-z0-9_.@-]+)*/?(:(\d+)(-(\d+))?)?$`)
	methRe = regexp.MustCompile(`^\(\*?([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?)\)\.([A-Za-z_]\w*)(\(.*\))?$`)
	// mixedCase is an identifier with a capital after a small letter
	// (`progressKeeper`, `TopicPendingError`).
	mixedCase = regexp.MustCompile(`^[a-z][a-z0-9]*[A-Z][A-Za-z0-9]*$`)
	nameRe    = regexp.MustCompile(`^([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(\(.*\))?$`)
	placedRe  = regexp.MustCompile(`^(\S+):\s+(.+)$`)
	// Between spans: a list's separator, and the placement forms.
	sepRe   = regexp.MustCompile(`^(\s*,\s*|\s+and\s+|\s*,\s+and\s+)$`)
	inRe    = regexp.MustCompile(`^\s+in\s+$`)
	parenRe = regexp.MustCompile(`^\s*\(\s*$`)
	colonRe = regexp.MustCompile(`^:\s+$`)
)

// CheckPage checks the page at path (relative to ix.Root or absolute) and
// returns its false statements in page order.
func CheckPage(ix *Index, page string) ([]Problem, error) {
	full := page
	if !filepath.IsAbs(full) {
		full = filepath.Join(ix.Root, page)
	}
	src, err := os.ReadFile(full)
	if err != nil {
		return nil, err
	}
	c := &checker{ix: ix, page: page, pageDir: filepath.Dir(full)}
	for _, b := range blocks(src) {
		c.block(b)
	}
	sort.SliceStable(c.problems, func(i, j int) bool { return c.problems[i].Line < c.problems[j].Line })
	return c.problems, nil
}

type checker struct {
	ix       *Index
	page     string
	pageDir  string
	problems []Problem
}

func (c *checker) report(line int, format string, args ...any) {
	c.problems = append(c.problems, Problem{Page: c.page, Line: line, Msg: fmt.Sprintf(format, args...)})
}

// blocks splits a page into blocks, leaving out fenced code.
func blocks(src []byte) []block {
	var out []block
	var cur block
	flush := func() {
		if cur.text != "" {
			out = append(out, cur)
		}
		cur = block{}
	}
	fence := ""
	sc := bufio.NewScanner(bytes.NewReader(src))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		trimmed := strings.TrimSpace(line)
		if fence != "" {
			if strings.HasPrefix(trimmed, fence) {
				fence = ""
			}
			continue
		}
		if strings.HasPrefix(trimmed, "```") || strings.HasPrefix(trimmed, "~~~") {
			flush()
			fence = trimmed[:3]
			continue
		}
		if trimmed == "" {
			flush()
			continue
		}
		if cur.text != "" {
			cur.text += "\n"
		}
		cur.text += line
		cur.lines = append(cur.lines, n)
	}
	flush()
	return out
}

// spans finds a block's inline code spans: a run of backticks up to the
// next run of the same length.
func (b block) spans() []span {
	var out []span
	t := b.text
	for i := 0; i < len(t); {
		if t[i] != '`' {
			i++
			continue
		}
		n := 0
		for i+n < len(t) && t[i+n] == '`' {
			n++
		}
		open := i
		j := i + n
		closeAt := -1
		for j < len(t) {
			if t[j] != '`' {
				j++
				continue
			}
			m := 0
			for j+m < len(t) && t[j+m] == '`' {
				m++
			}
			if m == n {
				closeAt = j
				break
			}
			j += m
		}
		if closeAt < 0 {
			i = open + n
			continue
		}
		text := strings.TrimSpace(strings.ReplaceAll(t[open+n:closeAt], "\n", " "))
		out = append(out, span{text: text, line: b.lineAt(open), start: open, end: closeAt + n})
		i = closeAt + n
	}
	return out
}

func (b block) lineAt(off int) int {
	return b.lines[strings.Count(b.text[:off], "\n")]
}

func (c *checker) block(b block) {
	spans := b.spans()
	for _, s := range spans {
		c.span(s)
	}
	c.placements(b, spans)
	c.table(b)
}

// span checks one span by its shape alone.
func (c *checker) span(s span) {
	if m := placedRe.FindStringSubmatch(s.text); m != nil && c.isPath(m[1]) && strings.Contains(m[1], "/") {
		if c.checkPath(s.line, m[1], false) {
			for _, n := range strings.Split(m[2], ",") {
				c.checkPlaced(s.line, strings.TrimSpace(n), m[1])
			}
		}
		return
	}
	if c.isPath(s.text) {
		c.checkPath(s.line, s.text, false)
		return
	}
	if r, ok := c.resolveName(s.text); ok && r.checked && len(r.decls) == 0 {
		c.report(s.line, "`%s` names %s", s.text, r.missing)
	}
}

// isPath says whether a span is a path under the rules in the package doc.
func (c *checker) isPath(t string) bool {
	if strings.HasPrefix(t, "-") || !pathRe.MatchString(t) {
		return false
	}
	p := strings.TrimPrefix(pathOnly(t), "./")
	if !strings.Contains(p, "/") && (!strings.HasSuffix(p, ".go") || p == ".go") {
		return false // ".go" alone is the extension, not a file
	}
	first := strings.SplitN(p, "/", 2)[0]
	if strings.Contains(first, ".") && strings.Contains(p, "/") && !exists(filepath.Join(c.ix.Root, first)) {
		return false // another module's import path, or a host name
	}
	return true
}

// pathOnly drops a ":LINE" suffix.
func pathOnly(t string) string {
	if i := strings.IndexByte(t, ':'); i >= 0 {
		return t[:i]
	}
	return t
}

func exists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}

// checkPath reports a path span that names nothing; bareDir says a name
// with no "/" is a directory (a package table's first column). It returns
// whether the path exists.
func (c *checker) checkPath(line int, t string, bareDir bool) bool {
	m := pathRe.FindStringSubmatch(t)
	p := strings.TrimPrefix(pathOnly(t), "./")
	wantDir := strings.HasSuffix(p, "/")
	p = strings.TrimSuffix(p, "/")
	var full string
	switch {
	case !strings.Contains(p, "/") && strings.HasSuffix(p, ".go") && !bareDir:
		found := c.ix.goFiles[p]
		if len(found) == 0 {
			c.report(line, "`%s` names a Go file that no package has", t)
			return false
		}
		full = filepath.Join(c.ix.Root, found[0])
	case exists(filepath.Join(c.ix.Root, p)):
		full = filepath.Join(c.ix.Root, p)
	case exists(filepath.Join(c.pageDir, p)):
		full = filepath.Join(c.pageDir, p)
	default:
		if c.ignoredPath(p) || stdlib(p) {
			return true
		}
		c.report(line, "`%s` names a path that does not exist", t)
		return false
	}
	fi, err := os.Stat(full)
	if err != nil {
		c.report(line, "`%s`: %v", t, err)
		return false
	}
	if wantDir && !fi.IsDir() {
		c.report(line, "`%s` names a directory, but it is a file", t)
		return false
	}
	if m[4] == "" {
		return true
	}
	if fi.IsDir() {
		c.report(line, "`%s` gives a line of a directory", t)
		return false
	}
	n, err := lineCount(full)
	if err != nil {
		c.report(line, "`%s`: %v", t, err)
		return false
	}
	for _, g := range []string{m[4], m[6]} {
		if g == "" {
			continue
		}
		if l, _ := strconv.Atoi(g); l < 1 || l > n {
			c.report(line, "`%s` names line %d, but %s has %d lines", t, l, p, n)
			return false
		}
	}
	return true
}

func (c *checker) ignoredPath(p string) bool {
	for _, ig := range c.ix.ignored {
		if p == ig || strings.HasPrefix(p, ig+"/") {
			return true
		}
	}
	return false
}

// stdlib says whether p is a standard library package (`database/sql`).
func stdlib(p string) bool {
	if strings.Contains(p, ".") {
		return false
	}
	pkg, err := build.Default.Import(p, "", build.FindOnly)
	return err == nil && pkg.Goroot
}

func lineCount(path string) (int, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	n := bytes.Count(b, []byte("\n"))
	if len(b) > 0 && b[len(b)-1] != '\n' {
		n++
	}
	return n, nil
}

// resolution is what a span names when read as a Go name.
type resolution struct {
	checked bool   // the shape says it must resolve
	decls   []decl // what it resolves to
	missing string // what is missing, for the message
}

// resolveName reads t as a Go name; false when it is not one.
func (c *checker) resolveName(t string) (resolution, bool) {
	t = strings.TrimLeft(t, "*&")
	t = strings.TrimPrefix(t, "[]")
	if m := methRe.FindStringSubmatch(t); m != nil {
		parts := append(strings.Split(m[1], "."), m[2])
		r := c.resolveParts(parts)
		if !r.checked {
			if len(parts) == 2 {
				return resolution{checked: true, missing: fmt.Sprintf("a type %s that this module does not declare", parts[0])}, true
			}
			return r, true // (ext.Type).Method
		}
		return r, true
	}
	m := nameRe.FindStringSubmatch(t)
	if m == nil {
		return resolution{}, false
	}
	parts := strings.Split(m[1], ".")
	call := m[2] != ""
	if len(parts) == 1 {
		name := parts[0]
		if !call && mixedCase.MatchString(name) {
			// A bare name in mixed case is Go by its shape (nothing
			// else the pages quote, flags, SQL, settings or metrics,
			// is written so): some declaration must carry it.
			return resolution{checked: true, decls: c.ix.byName[name],
				missing: fmt.Sprintf("%s, which this module does not declare", name)}, true
		}
		if !call || strings.Contains(name, "_") || NonGoCalls[name] {
			return resolution{}, true
		}
		var ds []decl
		for _, d := range c.ix.byName[name] {
			if d.Kind == "func" || d.Kind == "method" {
				ds = append(ds, d)
			}
		}
		return resolution{checked: true, decls: ds, missing: fmt.Sprintf("a function or method %s that this module does not declare", name)}, true
	}
	return c.resolveParts(parts), true
}

// resolveParts resolves pkg.Name, pkg.Type.Member and Type.Member, and
// the longer chains through fields, pkg.Type.field.Member and
// Type.field.member.
func (c *checker) resolveParts(parts []string) resolution {
	if dirs, ok := c.ix.pkgs[parts[0]]; ok && len(parts) > 3 && exported(parts[1]) {
		if types := c.ix.lookup(parts[1], "", dirs); len(types) > 0 && types[0].Kind == "type" {
			return c.resolveChain(parts[0]+"."+parts[1], parts[1], dirs, parts[2:])
		}
	}
	if dirs, ok := c.ix.types[parts[0]]; ok && len(parts) > 2 {
		// Unqualified, the first name may be something else's
		// (`table.field.event.id` is a Debezium setting, and
		// `Consumer.Group.Rebalance.Timeout` sarama's): the chain is Go
		// once its first member is the type's.
		if len(c.members(parts[0], dirs, parts[1], map[string]bool{})) == 0 {
			return resolution{}
		}
		return c.resolveChain(parts[0], parts[0], dirs, parts[1:])
	}
	var r resolution
	if dirs, ok := c.ix.pkgs[parts[0]]; ok && len(parts) <= 3 && exported(parts[1]) {
		r.checked = true
		switch len(parts) {
		case 2:
			r.decls = c.ix.lookup(parts[1], "", dirs)
			r.missing = fmt.Sprintf("%s, which package %s does not declare", parts[1], parts[0])
		case 3:
			if len(c.ix.lookup(parts[1], "", dirs)) == 0 {
				r.missing = fmt.Sprintf("%s, which package %s does not declare", parts[1], parts[0])
				break
			}
			r.decls = c.members(parts[1], dirs, parts[2], map[string]bool{})
			r.missing = fmt.Sprintf("%s.%s: %s has no method or field %s", parts[0], parts[1], parts[1], parts[2])
		}
		if len(r.decls) > 0 {
			return r
		}
	}
	if dirs, ok := c.ix.types[parts[0]]; ok && len(parts) == 2 {
		ds := c.members(parts[0], dirs, parts[1], map[string]bool{})
		if len(ds) > 0 || !r.checked {
			return resolution{checked: true, decls: ds, missing: fmt.Sprintf("%s.%s: %s has no method or field %s", parts[0], parts[1], parts[0], parts[1])}
		}
	}
	return r
}

// resolveChain follows members from typ (declared in dirs, named path in
// the page): each but the
// last must be a field, whose type the next is looked up in, a promoted
// member included. A field of a type this module does not declare, or a
// method, ends what can be checked: the rest resolves.
func (c *checker) resolveChain(path, typ string, dirs []string, members []string) resolution {
	for i, name := range members {
		ds := c.members(typ, dirs, name, map[string]bool{})
		if len(ds) == 0 {
			return resolution{checked: true, missing: fmt.Sprintf("%s.%s: %s has no method or field %s", path, name, typ, name)}
		}
		next := ds[0]
		for _, d := range ds {
			if d.Kind == "field" && c.ix.types[d.Type] != nil {
				next = d
				break
			}
		}
		if i == len(members)-1 || next.Kind != "field" || c.ix.types[next.Type] == nil {
			return resolution{checked: true, decls: ds}
		}
		path += "." + name
		typ, dirs = next.Type, c.ix.types[next.Type]
	}
	return resolution{}
}

// members are typ's members named name, declared on it or promoted from
// a field it embeds (seen guards against embedding cycles).
func (c *checker) members(typ string, dirs []string, name string, seen map[string]bool) []decl {
	if seen[typ] {
		return nil
	}
	seen[typ] = true
	if ds := c.ix.lookup(name, typ, dirs); len(ds) > 0 {
		return ds
	}
	for _, embedded := range c.ix.byRecv[typ] {
		if !contains(dirs, embedded.Dir) || embedded.Kind != "field" || embedded.Name != embedded.Type || c.ix.types[embedded.Type] == nil {
			continue
		}
		if ds := c.members(embedded.Type, c.ix.types[embedded.Type], name, seen); len(ds) > 0 {
			return ds
		}
	}
	return nil
}

// exported says whether a Go name is exported: only those can follow a
// package name in Go, so `relay.state` is a JSON key, not a name.
func exported(name string) bool {
	return name != "" && name[0] >= 'A' && name[0] <= 'Z'
}

// placements checks the names a block places in a file or package.
func (c *checker) placements(b block, spans []span) {
	gap := func(i int) string { // the text between spans i and i+1
		return strings.NewReplacer("*", "", "_", "").Replace(b.text[spans[i].end:spans[i+1].start])
	}
	isLoc := func(s span) bool { return c.isPath(s.text) }
	for i := 0; i+1 < len(spans); i++ {
		g := gap(i)
		switch {
		case isLoc(spans[i+1]) && (inRe.MatchString(g) || parenRe.MatchString(g)):
			// `a`, `b` and `c` in `file` / (`file`
			for j := i; j >= 0; j-- {
				if isLoc(spans[j]) {
					break
				}
				c.checkPlaced(spans[j].line, spans[j].text, spans[i+1].text)
				if j == 0 || !sepRe.MatchString(gap(j-1)) {
					break
				}
			}
		case isLoc(spans[i]) && colonRe.MatchString(g):
			// `file`: `a`, `b` and `c`
			for j := i + 1; j < len(spans); j++ {
				if isLoc(spans[j]) {
					break
				}
				c.checkPlaced(spans[j].line, spans[j].text, spans[i].text)
				if j+1 == len(spans) || !sepRe.MatchString(gap(j)) {
					break
				}
			}
		}
	}
}

// checkPlaced reports a name the page places in loc (a Go file or a
// package directory) that is not declared there. Spans that are not Go
// names (`FOR UPDATE SKIP LOCKED`) are left alone.
func (c *checker) checkPlaced(line int, name, loc string) {
	loc = strings.TrimSuffix(strings.TrimPrefix(pathOnly(loc), "./"), "/")
	var ds []decl
	if m := nameRe.FindStringSubmatch(strings.TrimLeft(name, "*&")); m != nil && !strings.Contains(m[1], ".") {
		if strings.Contains(m[1], "_") && m[2] != "" {
			return
		}
		for _, d := range c.ix.byName[m[1]] {
			if d.Kind != "field" { // a field is placed by its type: `Type.field`
				ds = append(ds, d)
			}
		}
		if len(ds) == 0 {
			if m[2] == "" { // a call was reported as a span already
				c.report(line, "`%s` is placed in %s but this module declares no %s", name, loc, m[1])
			}
			return
		}
	} else {
		r, ok := c.resolveName(name)
		if !ok || !r.checked || len(r.decls) == 0 {
			return // not a Go name, or reported already
		}
		ds = r.decls
	}
	var where []string
	for _, d := range ds {
		if d.File == loc || d.Dir == loc {
			return
		}
		if !contains(where, d.File) {
			where = append(where, d.File)
		}
	}
	sort.Strings(where)
	c.report(line, "`%s` is not declared in %s (it is in %s)", name, loc, strings.Join(where, ", "))
}

// table checks the first column of a package or file table.
func (c *checker) table(b block) {
	lines := strings.Split(b.text, "\n")
	inTable := false
	for i, l := range lines {
		l = strings.TrimSpace(l)
		if !strings.HasPrefix(l, "|") {
			inTable = false
			continue
		}
		cells := strings.Split(strings.Trim(l, "|"), "|")
		first := strings.ToLower(strings.Trim(strings.TrimSpace(cells[0]), "`*"))
		if !inTable {
			inTable = first == "package" || first == "file" || first == "directory"
			continue
		}
		if strings.Trim(first, "-: ") == "" {
			continue // the delimiter row
		}
		sub := block{text: cells[0], lines: []int{b.lines[i]}}
		for _, s := range sub.spans() {
			if !strings.Contains(s.text, "/") && pathRe.MatchString(s.text) {
				c.checkPath(s.line, s.text, true)
			}
		}
	}
}
