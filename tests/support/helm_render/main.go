// helm_render renders a Helm 3 chart's templates the way `helm template` does, for tests on a
// machine without helm: Go's own text/template, plus the few Sprig/Helm functions the Switchyard
// chart uses, implemented here with the standard library only (no modules to download).
//
//	helm_render -chart charts/switchyard -input input.json
//
// input.json holds the top-level objects, already merged by the caller (who parses the YAML):
//
//	{"Values": {...}, "Chart": {"Name": ..., "Version": ..., "AppVersion": ...},
//	 "Release": {"Name": ..., "Namespace": ..., "Service": "Helm", ...}, "Capabilities": {...}}
//
// It prints a JSON object mapping each rendered template ("switchyard/templates/x.yaml") to its
// output. Partials ("_*.tpl") are loaded but not rendered, NOTES.txt is skipped, as in Helm.
// .Files holds the chart's other files (Get, GetBytes, Glob, AsConfig, as Helm's).
// The functions keep Sprig's semantics for the arguments the chart passes; toYaml writes block
// YAML with sorted keys and double-quoted strings (equal in meaning to Helm's output).
package main

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"math"
	"os"
	"path"
	"path/filepath"
	"reflect"
	"sort"
	"strconv"
	"strings"
	"text/template"
)

func main() {
	chart := flag.String("chart", "", "chart directory")
	input := flag.String("input", "", "JSON file with Values, Chart, Release, Capabilities")
	flag.Parse()
	if *chart == "" || *input == "" {
		fmt.Fprintln(os.Stderr, "usage: helm_render -chart DIR -input FILE")
		os.Exit(2)
	}
	out, err := render(*chart, *input)
	if err != nil {
		fmt.Fprintln(os.Stderr, "helm_render:", err)
		os.Exit(1)
	}
	os.Stdout.Write(out)
}

func render(chartDir, inputPath string) ([]byte, error) {
	raw, err := os.ReadFile(inputPath)
	if err != nil {
		return nil, err
	}
	var top map[string]interface{}
	dec := json.NewDecoder(bytes.NewReader(raw))
	if err := dec.Decode(&top); err != nil {
		return nil, fmt.Errorf("input: %w", err)
	}
	chartName := filepath.Base(filepath.Clean(chartDir))
	if c, ok := top["Chart"].(map[string]interface{}); ok {
		if n, ok := c["Name"].(string); ok && n != "" {
			chartName = n
		}
	}
	tdir := filepath.Join(chartDir, "templates")
	var names []string
	err = filepath.Walk(tdir, func(p string, info os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		if !info.IsDir() {
			names = append(names, p)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	sort.Strings(names)

	root := template.New("root")
	root.Option("missingkey=zero")
	funcs := funcMap(root)
	root.Funcs(funcs)
	var rendered []string
	for _, p := range names {
		rel, _ := filepath.Rel(chartDir, p)
		name := chartName + "/" + filepath.ToSlash(rel)
		text, err := os.ReadFile(p)
		if err != nil {
			return nil, err
		}
		if _, err := root.New(name).Funcs(funcs).Parse(string(text)); err != nil {
			return nil, fmt.Errorf("parse %s: %w", name, err)
		}
		base := filepath.Base(p)
		if !strings.HasPrefix(base, "_") && base != "NOTES.txt" {
			rendered = append(rendered, name)
		}
	}
	files, err := loadFiles(chartDir)
	if err != nil {
		return nil, err
	}
	result := map[string]string{}
	for _, name := range rendered {
		data := map[string]interface{}{}
		for k, v := range top {
			data[k] = v
		}
		data["Files"] = files
		data["Template"] = map[string]interface{}{"Name": name, "BasePath": chartName + "/templates"}
		var buf bytes.Buffer
		if err := root.ExecuteTemplate(&buf, name, data); err != nil {
			return nil, fmt.Errorf("render %s: %w", name, err)
		}
		result[name] = strings.ReplaceAll(buf.String(), "<no value>", "")
	}
	return json.MarshalIndent(result, "", "  ")
}

// -- .Files ------------------------------------------------------------------------------------

// Files is the chart's .Files: every file except what Helm keeps apart (templates/, charts/,
// Chart.yaml, Chart.lock, values.yaml, values.schema.json) and what .helmignore names, keyed by
// its slash-separated path inside the chart.
type Files map[string][]byte

func (f Files) Get(name string) string      { return string(f[name]) }
func (f Files) GetBytes(name string) []byte { return f[name] }

// Glob keeps the files whose path matches pattern ("*" does not cross "/", as in Helm).
func (f Files) Glob(pattern string) Files {
	out := Files{}
	for k, v := range f {
		if ok, _ := path.Match(pattern, k); ok {
			out[k] = v
		}
	}
	return out
}

// AsConfig is the files as ConfigMap data: base name -> content, as YAML.
func (f Files) AsConfig() string {
	if f == nil {
		return ""
	}
	m := map[string]interface{}{}
	for k, v := range f {
		m[path.Base(k)] = string(v)
	}
	return toYaml(m)
}

func loadFiles(chartDir string) (Files, error) {
	var ignore []string
	if raw, err := os.ReadFile(filepath.Join(chartDir, ".helmignore")); err == nil {
		for _, line := range strings.Split(string(raw), "\n") {
			line = strings.TrimSpace(line)
			if line != "" && !strings.HasPrefix(line, "#") {
				ignore = append(ignore, line)
			}
		}
	}
	ignored := func(rel string, dir bool) bool {
		for _, pat := range ignore {
			if strings.HasSuffix(pat, "/") {
				if !dir {
					continue
				}
				pat = strings.TrimSuffix(pat, "/")
			}
			if ok, _ := path.Match(pat, path.Base(rel)); ok {
				return true
			}
			if ok, _ := path.Match(pat, rel); ok {
				return true
			}
		}
		return false
	}
	apart := map[string]bool{"templates": true, "charts": true, "Chart.yaml": true, "Chart.lock": true,
		"values.yaml": true, "values.schema.json": true, ".helmignore": true}
	files := Files{}
	err := filepath.Walk(chartDir, func(p string, info os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(chartDir, p)
		rel = filepath.ToSlash(rel)
		if rel == "." {
			return nil
		}
		if (!strings.Contains(rel, "/") && apart[rel]) || ignored(rel, info.IsDir()) {
			if info.IsDir() {
				return filepath.SkipDir
			}
			return nil
		}
		if info.IsDir() {
			return nil
		}
		raw, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		files[rel] = raw
		return nil
	})
	return files, err
}

func funcMap(root *template.Template) template.FuncMap {
	depth := 0
	return template.FuncMap{
		"include": func(name string, data interface{}) (string, error) {
			depth++
			defer func() { depth-- }()
			if depth > 100 {
				return "", errors.New("include: recursion too deep")
			}
			var buf bytes.Buffer
			if err := root.ExecuteTemplate(&buf, name, data); err != nil {
				return "", err
			}
			return strings.ReplaceAll(buf.String(), "<no value>", ""), nil
		},
		"toYaml":     toYaml,
		"toJson":     toJSON,
		"quote":      quote,
		"squote":     squote,
		"default":    dfault,
		"empty":      empty,
		"required":   required,
		"fail":       func(msg string) (string, error) { return "", errors.New(msg) },
		"indent":     indent,
		"nindent":    func(n int, s string) string { return "\n" + indent(n, s) },
		"trunc":      trunc,
		"trimSuffix": func(suffix, s string) string { return strings.TrimSuffix(s, suffix) },
		"trimPrefix": func(prefix, s string) string { return strings.TrimPrefix(s, prefix) },
		"trim":       strings.TrimSpace,
		"replace":    func(old, new, s string) string { return strings.ReplaceAll(s, old, new) },
		"contains":   func(substr, s string) bool { return strings.Contains(s, substr) },
		"lower":      strings.ToLower,
		"upper":      strings.ToUpper,
		"toString":   strval,
		"int":        toInt64,
		"add":        add,
		"sub":        func(a, b interface{}) int64 { return toInt64(a) - toInt64(b) },
		"max":        maxInt,
		"sha256sum": func(s string) string {
			h := sha256.Sum256([]byte(s))
			return hex.EncodeToString(h[:])
		},
		"dict":   dict,
		"list":   func(v ...interface{}) []interface{} { return v },
		"hasKey": func(d map[string]interface{}, k string) bool { _, ok := d[k]; return ok },
		"ternary": func(a, b interface{}, cond bool) interface{} {
			if cond {
				return a
			}
			return b
		},
	}
}

// -- Sprig semantics ----------------------------------------------------------------------------

func strval(v interface{}) string {
	switch s := v.(type) {
	case string:
		return s
	case []byte:
		return string(s)
	case error:
		return s.Error()
	case fmt.Stringer:
		return s.String()
	case float64:
		return formatFloat(s)
	default:
		return fmt.Sprintf("%v", v)
	}
}

func quote(args ...interface{}) string {
	var out []string
	for _, a := range args {
		if a != nil {
			out = append(out, fmt.Sprintf("%q", strval(a)))
		}
	}
	return strings.Join(out, " ")
}

func squote(args ...interface{}) string {
	var out []string
	for _, a := range args {
		if a != nil {
			out = append(out, "'"+strval(a)+"'")
		}
	}
	return strings.Join(out, " ")
}

func empty(v interface{}) bool {
	if v == nil {
		return true
	}
	rv := reflect.ValueOf(v)
	switch rv.Kind() {
	case reflect.Array, reflect.Map, reflect.Slice, reflect.String:
		return rv.Len() == 0
	case reflect.Bool:
		return !rv.Bool()
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		return rv.Int() == 0
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return rv.Uint() == 0
	case reflect.Float32, reflect.Float64:
		return rv.Float() == 0
	case reflect.Ptr, reflect.Interface:
		return rv.IsNil()
	}
	return false
}

// default DEFAULT GIVEN: GIVEN unless it is empty (Sprig's "default" is exactly this).
func dfault(d interface{}, given ...interface{}) interface{} {
	if len(given) == 0 || empty(given[0]) {
		return d
	}
	return given[0]
}

func required(msg string, v interface{}) (interface{}, error) {
	if v == nil {
		return nil, errors.New(msg)
	}
	if s, ok := v.(string); ok && s == "" {
		return nil, errors.New(msg)
	}
	return v, nil
}

func indent(n int, s string) string {
	pad := strings.Repeat(" ", n)
	return pad + strings.ReplaceAll(s, "\n", "\n"+pad)
}

func trunc(n int, s string) string {
	if n >= 0 && len(s) > n {
		return s[:n]
	}
	if n < 0 && len(s) > -n {
		return s[len(s)+n:]
	}
	return s
}

func toInt64(v interface{}) int64 {
	switch n := v.(type) {
	case int:
		return int64(n)
	case int64:
		return n
	case int32:
		return int64(n)
	case float64:
		return int64(n)
	case float32:
		return int64(n)
	case json.Number:
		i, err := n.Int64()
		if err != nil {
			f, _ := n.Float64()
			return int64(f)
		}
		return i
	case string:
		i, err := strconv.ParseInt(strings.TrimSpace(n), 10, 64)
		if err != nil {
			f, _ := strconv.ParseFloat(strings.TrimSpace(n), 64)
			return int64(f)
		}
		return i
	case bool:
		if n {
			return 1
		}
	}
	return 0
}

func add(vals ...interface{}) int64 {
	var s int64
	for _, v := range vals {
		s += toInt64(v)
	}
	return s
}

func maxInt(a interface{}, rest ...interface{}) int64 {
	m := toInt64(a)
	for _, v := range rest {
		if x := toInt64(v); x > m {
			m = x
		}
	}
	return m
}

func dict(kv ...interface{}) map[string]interface{} {
	d := map[string]interface{}{}
	for i := 0; i+1 < len(kv); i += 2 {
		d[strval(kv[i])] = kv[i+1]
	}
	return d
}

func toJSON(v interface{}) string {
	b, err := json.Marshal(v)
	if err != nil {
		return ""
	}
	return string(b)
}

// -- toYaml ---------------------------------------------------------------------------------------

func toYaml(v interface{}) string {
	var b strings.Builder
	writeYaml(&b, normalize(v), 0)
	return strings.TrimSuffix(b.String(), "\n")
}

// normalize turns any map/slice into map[string]interface{} / []interface{}.
func normalize(v interface{}) interface{} {
	if v == nil {
		return nil
	}
	rv := reflect.ValueOf(v)
	switch rv.Kind() {
	case reflect.Map:
		m := map[string]interface{}{}
		for _, k := range rv.MapKeys() {
			m[strval(k.Interface())] = normalize(rv.MapIndex(k).Interface())
		}
		return m
	case reflect.Slice, reflect.Array:
		if _, ok := v.([]byte); ok {
			return string(v.([]byte))
		}
		s := make([]interface{}, rv.Len())
		for i := range s {
			s[i] = normalize(rv.Index(i).Interface())
		}
		return s
	}
	return v
}

func formatFloat(f float64) string {
	if f == math.Trunc(f) && math.Abs(f) < 1e15 {
		return strconv.FormatInt(int64(f), 10)
	}
	return strconv.FormatFloat(f, 'g', -1, 64)
}

func scalar(v interface{}) string {
	switch x := v.(type) {
	case nil:
		return "null"
	case bool:
		return strconv.FormatBool(x)
	case float64:
		return formatFloat(x)
	case float32:
		return formatFloat(float64(x))
	case int, int64, int32:
		return fmt.Sprintf("%d", x)
	case json.Number:
		return x.String()
	case string:
		b, _ := json.Marshal(x) // a JSON string is a valid YAML double-quoted scalar
		return string(b)
	default:
		b, _ := json.Marshal(strval(x))
		return string(b)
	}
}

func keyString(k string) string {
	plain := k != "" && !strings.ContainsAny(k, ":#{}[],&*!|>'\"%@`\n\t ") && !strings.HasPrefix(k, "-") &&
		!strings.HasPrefix(k, "?")
	switch strings.ToLower(k) {
	case "true", "false", "yes", "no", "on", "off", "null", "~", "y", "n":
		plain = false
	}
	if _, err := strconv.ParseFloat(k, 64); err == nil {
		plain = false
	}
	if plain {
		return k
	}
	b, _ := json.Marshal(k)
	return string(b)
}

func writeYaml(b *strings.Builder, v interface{}, ind int) {
	pad := strings.Repeat(" ", ind)
	switch x := v.(type) {
	case map[string]interface{}:
		if len(x) == 0 {
			b.WriteString(pad + "{}\n")
			return
		}
		keys := make([]string, 0, len(x))
		for k := range x {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			writeEntry(b, pad+keyString(k)+":", x[k], ind)
		}
	case []interface{}:
		if len(x) == 0 {
			b.WriteString(pad + "[]\n")
			return
		}
		for _, item := range x {
			writeItem(b, item, ind)
		}
	default:
		b.WriteString(pad + scalar(x) + "\n")
	}
}

func writeEntry(b *strings.Builder, prefix string, v interface{}, ind int) {
	switch x := v.(type) {
	case map[string]interface{}:
		if len(x) == 0 {
			b.WriteString(prefix + " {}\n")
			return
		}
		b.WriteString(prefix + "\n")
		writeYaml(b, x, ind+2)
	case []interface{}:
		if len(x) == 0 {
			b.WriteString(prefix + " []\n")
			return
		}
		b.WriteString(prefix + "\n")
		writeYaml(b, x, ind) // lists under a key at the same indentation, as Helm writes them
	default:
		b.WriteString(prefix + " " + scalar(x) + "\n")
	}
}

func writeItem(b *strings.Builder, v interface{}, ind int) {
	pad := strings.Repeat(" ", ind)
	switch x := v.(type) {
	case map[string]interface{}:
		if len(x) == 0 {
			b.WriteString(pad + "- {}\n")
			return
		}
		var inner strings.Builder
		writeYaml(&inner, x, ind+2)
		s := inner.String()
		// the first line's indentation becomes "- "
		b.WriteString(pad + "- " + strings.TrimPrefix(s, pad+"  "))
	case []interface{}:
		if len(x) == 0 {
			b.WriteString(pad + "- []\n")
			return
		}
		var inner strings.Builder
		writeYaml(&inner, x, ind+2)
		b.WriteString(pad + "- " + strings.TrimPrefix(inner.String(), pad+"  "))
	default:
		b.WriteString(pad + "- " + scalar(x) + "\n")
	}
}
