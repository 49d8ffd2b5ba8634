package doccheck

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
)

// decl is one declaration: a package-level type, func, const or var, a
// method (Recv set), an interface's method or a struct's field (Recv set
// to the type).
type decl struct {
	Name string
	Recv string // the type a method or field belongs to; "" at package level
	Kind string // "type", "func", "method", "field", "const", "var"
	// Type is a field's type name (T of T, *T, pkg.T; "" for a map, a
	// slice or a func), so a page's `Type.field.member` can be followed.
	Type string
	Dir  string // slash-separated, relative to the module root
	File string // slash-separated, relative to the module root
}

// Index is what the module declares and which files it holds.
type Index struct {
	Root string
	// pkgs maps a package name to the directories declaring a package of
	// that name (main packages are left out: they cannot be imported).
	pkgs map[string][]string
	// byName maps a name to its declarations, at package level and as a
	// method or field.
	byName map[string][]decl
	// byRecv maps a type name to its methods and fields.
	byRecv map[string][]decl
	// types maps a type name to the directories declaring it.
	types map[string][]string
	// goFiles maps a file's base name to its paths, for a bare `main.go`.
	goFiles map[string][]string
	// ignored are the root .gitignore's directory and file patterns,
	// relative to the root: paths made by builds and runs, absent from a
	// fresh checkout.
	ignored []string
}

// LoadIndex parses every Go file under root (tests included, testdata and
// hidden directories not) and notes the root .gitignore's patterns.
func LoadIndex(root string) (*Index, error) {
	ix := &Index{Root: root, pkgs: map[string][]string{}, byName: map[string][]decl{}, byRecv: map[string][]decl{},
		types: map[string][]string{}, goFiles: map[string][]string{}}
	fset := token.NewFileSet()
	seenPkg := map[string]bool{}
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		name := d.Name()
		if d.IsDir() {
			if path != root && (strings.HasPrefix(name, ".") || name == "testdata" || name == "vendor") {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(name, ".go") {
			return nil
		}
		rel := filepath.ToSlash(mustRel(root, path))
		dir := filepath.ToSlash(filepath.Dir(rel))
		ix.goFiles[name] = append(ix.goFiles[name], rel)
		f, err := parser.ParseFile(fset, path, nil, parser.SkipObjectResolution)
		if err != nil {
			return err
		}
		pkg := f.Name.Name
		if pkg != "main" && !strings.HasSuffix(pkg, "_test") && !seenPkg[dir] {
			seenPkg[dir] = true
			ix.pkgs[pkg] = append(ix.pkgs[pkg], dir)
		}
		ix.addFile(f, dir, rel)
		return nil
	})
	if err != nil {
		return nil, err
	}
	if b, err := os.ReadFile(filepath.Join(root, ".gitignore")); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			line = strings.TrimSpace(line)
			if line == "" || strings.HasPrefix(line, "#") || strings.ContainsAny(line, "*?[!") {
				continue
			}
			ix.ignored = append(ix.ignored, strings.Trim(line, "/"))
		}
	}
	return ix, nil
}

func mustRel(root, path string) string {
	rel, err := filepath.Rel(root, path)
	if err != nil {
		return path
	}
	return rel
}

func (ix *Index) add(d decl) {
	ix.byName[d.Name] = append(ix.byName[d.Name], d)
	if d.Recv != "" {
		ix.byRecv[d.Recv] = append(ix.byRecv[d.Recv], d)
	}
	if d.Kind == "type" {
		ix.types[d.Name] = append(ix.types[d.Name], d.Dir)
	}
}

func (ix *Index) addFile(f *ast.File, dir, file string) {
	for _, gd := range f.Decls {
		switch gd := gd.(type) {
		case *ast.FuncDecl:
			if gd.Recv == nil || len(gd.Recv.List) == 0 {
				ix.add(decl{Name: gd.Name.Name, Kind: "func", Dir: dir, File: file})
				continue
			}
			ix.add(decl{Name: gd.Name.Name, Recv: recvName(gd.Recv.List[0].Type), Kind: "method", Dir: dir, File: file})
		case *ast.GenDecl:
			for _, spec := range gd.Specs {
				switch spec := spec.(type) {
				case *ast.TypeSpec:
					ix.add(decl{Name: spec.Name.Name, Kind: "type", Dir: dir, File: file})
					ix.addMembers(spec.Name.Name, spec.Type, dir, file)
				case *ast.ValueSpec:
					kind := "var"
					if gd.Tok == token.CONST {
						kind = "const"
					}
					for _, n := range spec.Names {
						ix.add(decl{Name: n.Name, Kind: kind, Dir: dir, File: file})
					}
				}
			}
		}
	}
}

// addMembers notes a struct's fields and an interface's methods as
// belonging to the type.
func (ix *Index) addMembers(typ string, t ast.Expr, dir, file string) {
	var fields *ast.FieldList
	kind := "field"
	switch t := t.(type) {
	case *ast.StructType:
		fields = t.Fields
	case *ast.InterfaceType:
		fields, kind = t.Methods, "method"
	default:
		return
	}
	for _, f := range fields.List {
		names := f.Names
		if len(names) == 0 { // embedded: reachable by its type's name
			if n := recvName(f.Type); n != "" {
				names = []*ast.Ident{{Name: n}}
			}
		}
		var fieldType string
		if kind == "field" {
			fieldType = recvName(f.Type)
		}
		for _, n := range names {
			ix.add(decl{Name: n.Name, Recv: typ, Kind: kind, Dir: dir, File: file, Type: fieldType})
		}
	}
}

// recvName is the type name of a receiver or embedded field: T, *T, T[P],
// pkg.T.
func recvName(e ast.Expr) string {
	switch e := e.(type) {
	case *ast.Ident:
		return e.Name
	case *ast.StarExpr:
		return recvName(e.X)
	case *ast.IndexExpr:
		return recvName(e.X)
	case *ast.IndexListExpr:
		return recvName(e.X)
	case *ast.SelectorExpr:
		return e.Sel.Name
	}
	return ""
}

// lookup returns the declarations named name whose receiver is recv ("" at
// package level, "*" for any) and whose directory is in dirs (nil: any).
func (ix *Index) lookup(name, recv string, dirs []string) []decl {
	var out []decl
	for _, d := range ix.byName[name] {
		if recv != "*" && d.Recv != recv {
			continue
		}
		if dirs != nil && !contains(dirs, d.Dir) {
			continue
		}
		out = append(out, d)
	}
	return out
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}
