// Package deploy_test checks the Grafana dashboard and the Prometheus alerting
// rules in this directory: the rules pass `promtool check rules` and their
// unit tests (`promtool test rules`), the dashboard is a well-formed Grafana
// dashboard whose queries parse, and every metric the two name is one the
// scheduler exports (internal/metrics), one of the Go, process and promhttp
// collectors', or `up`.
//
// promtool comes with the Debian package prometheus (.ci/run installs it).
package deploy_test

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"gopkg.in/yaml.v3"

	"github.com/deferq/scheduler/internal/metrics"
)

// Paths relative to this package's directory (go test's working directory).
const (
	alertsFile     = "prometheus/alerts.yaml"
	alertTestsFile = "prometheus/alerts_test.yaml"
	dashboardFile  = "grafana/scheduler-dashboard.json"
	readmeFile     = "README.md"
	repoRoot       = ".."
)

// promtool returns the path of promtool, or fails the test saying how to get it.
func promtool(t *testing.T) string {
	t.Helper()
	path, err := exec.LookPath("promtool")
	if err != nil {
		t.Fatalf("promtool is not on PATH: install the Debian package prometheus "+
			"(apt-get install prometheus; .ci/run does it) to check the alerting rules "+
			"and dashboard queries in deploy/: %v", err)
	}
	return path
}

func runPromtool(t *testing.T, args ...string) {
	t.Helper()
	out, err := exec.Command(promtool(t), args...).CombinedOutput()
	if err != nil {
		t.Fatalf("promtool %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	t.Logf("promtool %s:\n%s", strings.Join(args, " "), out)
}

func TestAlertRulesPromtoolCheck(t *testing.T) {
	runPromtool(t, "check", "rules", alertsFile)
}

// TestAlertRulesPromtoolUnitTests runs alerts_test.yaml: synthetic series
// under which given alerts must fire, or must not.
func TestAlertRulesPromtoolUnitTests(t *testing.T) {
	runPromtool(t, "test", "rules", alertTestsFile)
}

// --- Rules --------------------------------------------------------------------

type ruleFile struct {
	Groups []struct {
		Name  string `yaml:"name"`
		Rules []rule `yaml:"rules"`
	} `yaml:"groups"`
}

type rule struct {
	Alert       string            `yaml:"alert"`
	Record      string            `yaml:"record"`
	Expr        string            `yaml:"expr"`
	For         string            `yaml:"for"`
	Labels      map[string]string `yaml:"labels"`
	Annotations map[string]string `yaml:"annotations"`
}

func readRules(t *testing.T) ruleFile {
	t.Helper()
	var f ruleFile
	readYAML(t, alertsFile, &f)
	if len(f.Groups) == 0 {
		t.Fatalf("%s: no rule groups", alertsFile)
	}
	return f
}

func readYAML(t *testing.T, path string, v any) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(b, v); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
}

// TestAlertRulesShape checks what promtool does not: every alert waits (for:),
// has a severity, and says what happened, why it matters and where to start,
// and the README sections and runbook files it points at exist.
func TestAlertRulesShape(t *testing.T) {
	anchors := readmeAnchors(t)
	runbookDir := filepath.Join(repoRoot, "sql", "runbook")
	_, err := os.Stat(runbookDir)
	haveRunbook := err == nil
	if !haveRunbook {
		t.Logf("%s does not exist yet: the sql/runbook/*.sql files the alerts name are not checked", runbookDir)
	}
	seen := map[string]bool{}
	for _, g := range readRules(t).Groups {
		for _, r := range g.Rules {
			if r.Alert == "" {
				continue
			}
			where := fmt.Sprintf("%s: alert %s", alertsFile, r.Alert)
			if seen[r.Alert] {
				t.Errorf("%s: defined twice", where)
			}
			seen[r.Alert] = true
			if r.For == "" {
				t.Errorf("%s: no for:", where)
			}
			switch r.Labels["severity"] {
			case "critical", "warning", "info":
			default:
				t.Errorf("%s: labels.severity is %q, want critical, warning or info", where, r.Labels["severity"])
			}
			for _, a := range []string{"summary", "description", "runbook"} {
				if strings.TrimSpace(r.Annotations[a]) == "" {
					t.Errorf("%s: no annotations.%s", where, a)
				}
			}
			runbook := r.Annotations["runbook"]
			for _, m := range readmeRef.FindAllStringSubmatch(runbook, -1) {
				if !anchors[m[1]] {
					t.Errorf("%s: runbook points at %s, but %s has no such section", where, m[0], readmeFile)
				}
			}
			if !strings.Contains(runbook, "deploy/README.md#") {
				t.Errorf("%s: runbook %q names no section of deploy/README.md", where, runbook)
			}
			if haveRunbook {
				for _, f := range sqlRef.FindAllString(runbook, -1) {
					if _, err := os.Stat(filepath.Join(repoRoot, f)); err != nil {
						t.Errorf("%s: runbook names %s: %v", where, f, err)
					}
				}
			}
		}
	}
}

var (
	readmeRef = regexp.MustCompile(`deploy/README\.md#([A-Za-z0-9_-]+)`)
	sqlRef    = regexp.MustCompile(`sql/runbook/[A-Za-z0-9_.-]+\.sql`)
)

// readmeAnchors returns the GitHub anchors of README.md's headings.
func readmeAnchors(t *testing.T) map[string]bool {
	t.Helper()
	b, err := os.ReadFile(readmeFile)
	if err != nil {
		t.Fatal(err)
	}
	anchors := map[string]bool{}
	fenced := false
	for line := range strings.SplitSeq(string(b), "\n") {
		if strings.HasPrefix(line, "```") {
			fenced = !fenced
		}
		title, ok := strings.CutPrefix(strings.TrimLeft(line, "#"), " ")
		if fenced || !strings.HasPrefix(line, "#") || !ok {
			continue
		}
		var a strings.Builder
		for _, r := range strings.ToLower(title) {
			switch {
			case r == ' ':
				a.WriteRune('-')
			case r == '-' || r == '_' || r >= 'a' && r <= 'z' || r >= '0' && r <= '9':
				a.WriteRune(r)
			}
		}
		anchors[a.String()] = true
	}
	return anchors
}

// --- Dashboard ----------------------------------------------------------------

type dashboard struct {
	UID           string `json:"uid"`
	Title         string `json:"title"`
	SchemaVersion int    `json:"schemaVersion"`
	Inputs        []struct {
		Name string `json:"name"`
		Type string `json:"type"`
	} `json:"__inputs"`
	Panels     []panel `json:"panels"`
	Templating struct {
		List []variable `json:"list"`
	} `json:"templating"`
}

type panel struct {
	ID         *int           `json:"id"`
	Type       string         `json:"type"`
	Title      string         `json:"title"`
	Datasource *datasourceRef `json:"datasource"`
	GridPos    struct {
		H, W, X, Y int
	} `json:"gridPos"`
	Targets []struct {
		RefID      string         `json:"refId"`
		Expr       string         `json:"expr"`
		Datasource *datasourceRef `json:"datasource"`
	} `json:"targets"`
	Panels []panel `json:"panels"` // a collapsed row's
}

type datasourceRef struct {
	Type string `json:"type"`
	UID  string `json:"uid"`
}

type variable struct {
	Name       string          `json:"name"`
	Type       string          `json:"type"`
	Query      json.RawMessage `json:"query"`
	Definition string          `json:"definition"`
	Datasource *datasourceRef  `json:"datasource"`
}

// query returns a query variable's query: a string, or {"query": "..."} as
// Grafana 10 and later write it.
func (v variable) query() (string, error) {
	var s string
	if err := json.Unmarshal(v.Query, &s); err == nil {
		return s, nil
	}
	var o struct {
		Query string `json:"query"`
	}
	if err := json.Unmarshal(v.Query, &o); err != nil {
		return "", fmt.Errorf("variable %s: query is neither a string nor {\"query\": ...}: %s", v.Name, v.Query)
	}
	return o.Query, nil
}

func readDashboard(t *testing.T) dashboard {
	t.Helper()
	b, err := os.ReadFile(dashboardFile)
	if err != nil {
		t.Fatal(err)
	}
	if !json.Valid(b) {
		t.Fatalf("%s is not valid JSON", dashboardFile)
	}
	var d dashboard
	if err := json.Unmarshal(b, &d); err != nil {
		t.Fatalf("%s: %v", dashboardFile, err)
	}
	return d
}

// allPanels returns the dashboard's panels, those of collapsed rows included.
func allPanels(ps []panel) []panel {
	var out []panel
	for _, p := range ps {
		out = append(out, p)
		out = append(out, allPanels(p.Panels)...)
	}
	return out
}

func (p panel) name() string {
	id := "?"
	if p.ID != nil {
		id = fmt.Sprint(*p.ID)
	}
	return fmt.Sprintf("%s: panel %s %q", dashboardFile, id, p.Title)
}

// TestDashboardWellFormed: valid JSON, unique panel ids, a Prometheus
// datasource on every panel and query that is the dashboard's datasource
// variable (or import input), the target variable, and a layout without
// overlaps.
func TestDashboardWellFormed(t *testing.T) {
	d := readDashboard(t)
	if d.UID == "" || d.Title == "" {
		t.Errorf("%s: uid and title must be set", dashboardFile)
	}
	if d.SchemaVersion < 36 {
		t.Errorf("%s: schemaVersion %d; want 36 or later (datasource references as objects)", dashboardFile, d.SchemaVersion)
	}

	// The datasource references a panel may use: ${name} of a datasource
	// variable, or of an import input.
	dsRefs := map[string]bool{}
	for _, v := range d.Templating.List {
		if v.Type == "datasource" {
			dsRefs["${"+v.Name+"}"], dsRefs["$"+v.Name] = true, true
		}
	}
	for _, in := range d.Inputs {
		if in.Type == "datasource" {
			dsRefs["${"+in.Name+"}"] = true
		}
	}
	if len(dsRefs) == 0 {
		t.Fatalf("%s: no datasource template variable and no datasource input", dashboardFile)
	}
	checkDS := func(where string, ds *datasourceRef) {
		switch {
		case ds == nil:
			t.Errorf("%s: no datasource", where)
		case ds.Type != "prometheus":
			t.Errorf("%s: datasource type %q, want prometheus", where, ds.Type)
		case !dsRefs[ds.UID]:
			t.Errorf("%s: datasource uid %q is not the dashboard's datasource variable or input", where, ds.UID)
		}
	}

	ids := map[int]string{}
	queries := 0
	for _, p := range allPanels(d.Panels) {
		switch {
		case p.ID == nil || *p.ID <= 0:
			t.Errorf("%s: no positive id", p.name())
		case ids[*p.ID] != "":
			t.Errorf("%s: id %d is also panel %q's", p.name(), *p.ID, ids[*p.ID])
		default:
			ids[*p.ID] = p.Title
		}
		if p.Title == "" {
			t.Errorf("%s: no title", p.name())
		}
		if p.Type == "row" {
			continue
		}
		checkDS(p.name(), p.Datasource)
		if len(p.Targets) == 0 {
			t.Errorf("%s: no queries", p.name())
		}
		refs := map[string]bool{}
		for _, q := range p.Targets {
			where := fmt.Sprintf("%s query %s", p.name(), q.RefID)
			if q.RefID == "" || refs[q.RefID] {
				t.Errorf("%s: refId empty or repeated", where)
			}
			refs[q.RefID] = true
			if strings.TrimSpace(q.Expr) == "" {
				t.Errorf("%s: empty expr", where)
			}
			if q.Datasource != nil {
				checkDS(where, q.Datasource)
			}
			queries++
		}
	}
	t.Logf("%d panels, %d queries", len(ids), queries)

	var target *variable
	for i, v := range d.Templating.List {
		if v.Type == "query" {
			checkDS(fmt.Sprintf("%s: variable %s", dashboardFile, v.Name), v.Datasource)
		}
		if v.Name == "target" {
			target = &d.Templating.List[i]
		}
	}
	if target == nil {
		t.Errorf("%s: no template variable target", dashboardFile)
	} else if q, err := target.query(); err != nil || q != "label_values(scheduler_messages, target)" {
		t.Errorf("%s: variable target: query %q (%v), want label_values(scheduler_messages, target)", dashboardFile, q, err)
	}

	// Top-level panels tile a 24-column grid without overlapping.
	top := d.Panels
	for i, a := range top {
		g := a.GridPos
		if g.W <= 0 || g.H <= 0 || g.X < 0 || g.Y < 0 || g.X+g.W > 24 {
			t.Errorf("%s: gridPos %+v outside the 24-column grid", a.name(), g)
		}
		for _, b := range top[:i] {
			h := b.GridPos
			if g.X < h.X+h.W && h.X < g.X+g.W && g.Y < h.Y+h.H && h.Y < g.Y+g.H {
				t.Errorf("%s overlaps %s", a.name(), b.name())
			}
		}
	}
}

// grafanaInterval matches Grafana's interval variables, which PromQL cannot
// parse where a duration goes.
var grafanaInterval = regexp.MustCompile(`\$\{?__(rate_interval|interval|range)(_ms|_s)?\}?`)

// TestDashboardQueriesParse hands every dashboard query to promtool as a
// recording rule, so a typo in PromQL fails here rather than on a screen.
// Template variables in label matchers ("$job") are valid regular
// expressions; interval variables become 5m.
func TestDashboardQueriesParse(t *testing.T) {
	d := readDashboard(t)
	type recording struct {
		Record string `yaml:"record"`
		Expr   string `yaml:"expr"`
	}
	var rules []recording
	for _, q := range dashboardQueries(t, d) {
		rules = append(rules, recording{
			Record: fmt.Sprintf("dashboard:query_%d", len(rules)),
			Expr:   grafanaInterval.ReplaceAllString(q.expr, "5m"),
		})
	}
	b, err := yaml.Marshal(map[string]any{
		"groups": []any{map[string]any{"name": "dashboard", "rules": rules}},
	})
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "dashboard-queries.yaml")
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
	runPromtool(t, "check", "rules", path)
}

// --- Metric names -------------------------------------------------------------

// query is one PromQL expression and where it comes from.
type query struct {
	where string
	expr  string
}

// dashboardQueries returns the PromQL of every panel query and of every query
// variable (the expression inside label_values(...) or query_result(...)).
func dashboardQueries(t *testing.T, d dashboard) []query {
	t.Helper()
	var qs []query
	for _, p := range allPanels(d.Panels) {
		for _, q := range p.Targets {
			qs = append(qs, query{fmt.Sprintf("%s query %s", p.name(), q.RefID), q.Expr})
		}
	}
	for _, v := range d.Templating.List {
		if v.Type != "query" {
			continue
		}
		s, err := v.query()
		if err != nil {
			t.Errorf("%s: %v", dashboardFile, err)
			continue
		}
		expr, err := variableExpr(s)
		if err != nil {
			t.Errorf("%s: variable %s: %v", dashboardFile, v.Name, err)
			continue
		}
		if expr != "" {
			qs = append(qs, query{fmt.Sprintf("%s: variable %s", dashboardFile, v.Name), expr})
		}
	}
	return qs
}

// variableExpr returns the PromQL inside a Grafana Prometheus variable query:
// label_values(expr, label) or query_result(expr); "" for label_values(label)
// and label_names(), which name no metric. metrics(regex) cannot be checked.
func variableExpr(q string) (string, error) {
	q = strings.TrimSpace(q)
	inner := func(fn string) (string, bool) {
		rest, ok := strings.CutPrefix(q, fn+"(")
		if !ok || !strings.HasSuffix(rest, ")") {
			return "", false
		}
		return strings.TrimSuffix(rest, ")"), true
	}
	if args, ok := inner("label_values"); ok {
		i := strings.LastIndex(args, ",")
		if i < 0 {
			return "", nil // label_values(label): every metric
		}
		return args[:i], nil
	}
	if expr, ok := inner("query_result"); ok {
		return expr, nil
	}
	if _, ok := inner("label_names"); ok {
		return "", nil
	}
	if _, ok := inner("metrics"); ok {
		return "", fmt.Errorf("metrics(...) names metrics by pattern; the test cannot check them")
	}
	return q, nil // a plain PromQL query
}

// ruleQueries returns the expressions of the rules, and the input series and
// PromQL of their unit tests (a test over a metric that does not exist would
// prove nothing).
func ruleQueries(t *testing.T) []query {
	t.Helper()
	var qs []query
	for _, g := range readRules(t).Groups {
		for _, r := range g.Rules {
			qs = append(qs, query{fmt.Sprintf("%s: %s%s", alertsFile, r.Alert, r.Record), r.Expr})
		}
	}
	var tests struct {
		Tests []struct {
			InputSeries []struct {
				Series string `yaml:"series"`
			} `yaml:"input_series"`
			PromQLExprTest []struct {
				Expr string `yaml:"expr"`
			} `yaml:"promql_expr_test"`
		} `yaml:"tests"`
	}
	readYAML(t, alertTestsFile, &tests)
	for i, tc := range tests.Tests {
		for _, s := range tc.InputSeries {
			qs = append(qs, query{fmt.Sprintf("%s: test %d input series", alertTestsFile, i+1), s.Series})
		}
		for _, e := range tc.PromQLExprTest {
			qs = append(qs, query{fmt.Sprintf("%s: test %d promql_expr_test", alertTestsFile, i+1), e.Expr})
		}
	}
	return qs
}

// TestMetricNamesExist: every metric the dashboard and the rules name is
// exported by the scheduler, or is one of the few others allowed.
func TestMetricNamesExist(t *testing.T) {
	known := knownMetrics()
	qs := append(dashboardQueries(t, readDashboard(t)), ruleQueries(t)...)
	used := map[string]bool{}
	for _, q := range qs {
		names, err := metricNames(q.expr)
		if err != nil {
			t.Errorf("%s: %v in %q", q.where, err, q.expr)
			continue
		}
		if len(names) == 0 {
			t.Errorf("%s: names no metric: %q", q.where, q.expr)
		}
		for _, n := range names {
			used[n] = true
			if !known.allowed(n) {
				t.Errorf("%s: metric %s is not in internal/metrics.Names() "+
					"(nor go_*, process_*, promhttp_* or up): %q", q.where, n, q.expr)
			}
		}
	}
	if t.Failed() {
		return
	}
	// Not an error, but worth seeing: exported metrics nobody looks at.
	for _, n := range metrics.Names() {
		if !used[n] && !used[n+"_bucket"] && !used[n+"_count"] && !used[n+"_sum"] {
			t.Logf("metric %s is used by neither the dashboard nor the rules", n)
		}
	}
}

type metricSet map[string]bool

func knownMetrics() metricSet {
	s := metricSet{}
	for _, n := range metrics.Names() {
		s[n] = true
	}
	return s
}

// allowed reports whether a dashboard or rule may name metric n: one of the
// scheduler's, a histogram's _bucket, _sum or _count series (a counter,
// named _total, has none), a Go, process or promhttp collector's, or up.
func (s metricSet) allowed(n string) bool {
	if s[n] {
		return true
	}
	for _, suffix := range []string{"_bucket", "_sum", "_count"} {
		if base, ok := strings.CutSuffix(n, suffix); ok && s[base] && !strings.HasSuffix(base, "_total") {
			return true
		}
	}
	for _, prefix := range []string{"go_", "process_", "promhttp_"} {
		if strings.HasPrefix(n, prefix) {
			return true
		}
	}
	return n == "up"
}

// --- A small PromQL metric-name extractor ---------------------------------------

// notMetrics are PromQL words that are not metric names when they are not
// followed by "(": aggregation operators (sum by (x) (...)), binary and set
// operators, modifiers, and number literals.
var notMetrics = map[string]bool{
	// aggregations
	"sum": true, "min": true, "max": true, "avg": true, "group": true, "stddev": true,
	"stdvar": true, "count": true, "count_values": true, "bottomk": true, "topk": true,
	"quantile": true, "limitk": true, "limit_ratio": true,
	// operators and modifiers
	"and": true, "or": true, "unless": true, "atan2": true, "bool": true, "offset": true,
	"by": true, "without": true, "on": true, "ignoring": true, "group_left": true, "group_right": true,
	// numbers
	"inf": true, "nan": true,
}

// labelLists are the words followed by a parenthesised list of label names.
var labelLists = map[string]bool{
	"by": true, "without": true, "on": true, "ignoring": true, "group_left": true, "group_right": true,
}

func isIdentStart(c byte) bool {
	return c == '_' || c == ':' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z'
}

func isIdent(c byte) bool {
	return isIdentStart(c) || c >= '0' && c <= '9'
}

var (
	// nameMatcher is an equality matcher on the metric name: {__name__="x"}.
	nameMatcher = regexp.MustCompile(`__name__\s*=\s*("(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|` + "`[^`]*`)")
	metricName  = regexp.MustCompile(`^[a-zA-Z_:][a-zA-Z0-9_:]*$`)
)

// metricNames returns the metric names a PromQL expression selects, in order,
// without repeats: identifiers that are not functions (followed by "("),
// keywords, label names (inside {...} and by/without/on/ignoring/group_*
// lists), strings, numbers, durations or ranges ([...]). A {__name__="x"}
// matcher names x. Grafana variables ($var, ${var}) are skipped.
func metricNames(expr string) ([]string, error) {
	var names []string
	add := func(n string) {
		if !slices.Contains(names, n) {
			names = append(names, n)
		}
	}
	// skipString returns the index after the string literal starting at i.
	skipString := func(i int) (int, error) {
		quote := expr[i]
		for j := i + 1; j < len(expr); j++ {
			switch {
			case expr[j] == '\\' && quote != '`':
				j++
			case expr[j] == quote:
				return j + 1, nil
			}
		}
		return 0, fmt.Errorf("unterminated string at offset %d", i)
	}
	// closing returns the index after the bracket closing the one at i,
	// skipping strings inside.
	closing := func(i int, open, close byte) (int, error) {
		depth := 0
		for j := i; j < len(expr); {
			switch c := expr[j]; {
			case c == '"' || c == '\'' || c == '`':
				k, err := skipString(j)
				if err != nil {
					return 0, err
				}
				j = k
				continue
			case c == open:
				depth++
			case c == close:
				depth--
				if depth == 0 {
					return j + 1, nil
				}
			}
			j++
		}
		return 0, fmt.Errorf("unbalanced %q at offset %d", open, i)
	}
	nextNonSpace := func(i int) int {
		for i < len(expr) && strings.ContainsRune(" \t\r\n", rune(expr[i])) {
			i++
		}
		return i
	}

	depth := 0 // of parentheses
	for i := 0; i < len(expr); {
		c := expr[i]
		switch {
		case c == '(' || c == ')':
			if c == '(' {
				depth++
			} else if depth--; depth < 0 {
				return nil, fmt.Errorf("unbalanced ')' at offset %d", i)
			}
			i++
		case c == '#': // comment to the end of the line
			for i < len(expr) && expr[i] != '\n' {
				i++
			}
		case c == '"' || c == '\'' || c == '`':
			j, err := skipString(i)
			if err != nil {
				return nil, err
			}
			i = j
		case c == '{': // label matchers
			j, err := closing(i, '{', '}')
			if err != nil {
				return nil, err
			}
			for _, m := range nameMatcher.FindAllStringSubmatch(expr[i:j], -1) {
				v := m[1][1 : len(m[1])-1]
				if !metricName.MatchString(v) {
					return nil, fmt.Errorf("__name__ matcher %s is not a plain metric name", m[1])
				}
				add(v)
			}
			if strings.Contains(expr[i:j], "__name__") && !nameMatcher.MatchString(expr[i:j]) {
				return nil, fmt.Errorf("__name__ matcher in %s is not name=\"metric\"; the test cannot check it", expr[i:j])
			}
			i = j
		case c == '[': // range or subquery: durations and interval variables
			j, err := closing(i, '[', ']')
			if err != nil {
				return nil, err
			}
			i = j
		case c == '$': // Grafana variable
			i++
			if i < len(expr) && expr[i] == '{' {
				j := strings.IndexByte(expr[i:], '}')
				if j < 0 {
					return nil, fmt.Errorf("unterminated ${ at offset %d", i-1)
				}
				i += j + 1
				continue
			}
			for i < len(expr) && isIdent(expr[i]) {
				i++
			}
		case c >= '0' && c <= '9' || c == '.': // number or duration (5m, 1e3, 0x1f)
			for i < len(expr) && (isIdent(expr[i]) || expr[i] == '.') {
				i++
			}
		case isIdentStart(c):
			j := i
			for j < len(expr) && isIdent(expr[j]) {
				j++
			}
			word := expr[i:j]
			k := nextNonSpace(j)
			followedByParen := k < len(expr) && expr[k] == '('
			switch {
			case labelLists[strings.ToLower(word)] && followedByParen:
				end, err := closing(k, '(', ')')
				if err != nil {
					return nil, err
				}
				j = end
			case followedByParen, notMetrics[strings.ToLower(word)]:
				// a function, an aggregation or a keyword
			default:
				add(word)
			}
			i = j
		default: // operators, commas, @
			i++
		}
	}
	if depth != 0 {
		return nil, fmt.Errorf("unbalanced '('")
	}
	return names, nil
}

func TestMetricNameExtractor(t *testing.T) {
	for _, tc := range []struct {
		expr string
		want []string
	}{
		{`up`, []string{"up"}},
		{`up{job="defer-scheduler"} == 0`, []string{"up"}},
		{`sum by (target, kind) (rate(scheduler_dispatch_publish_errors_total{job=~"$job"}[$__rate_interval])) > 0`,
			[]string{"scheduler_dispatch_publish_errors_total"}},
		{`histogram_quantile(0.99, sum by (le) (rate(a_seconds_bucket{x="y"}[5m])))`, []string{"a_seconds_bucket"}},
		{`sum(rate(a_total[5m])) without (instance, pod) / ignoring(kind) group_left(version) b`, []string{"a_total", "b"}},
		{`max(x) > bool 60 unless count(y offset 1h) < 1e+3 or z @ start()`, []string{"x", "y", "z"}},
		{`absent(up{job="defer-scheduler"} == 1)`, []string{"up"}},
		{`label_replace(m, "dst", "$1", "src", "(.*)") and on(partition) n`, []string{"m", "n"}},
		{`{__name__="named", job="j"}`, []string{"named"}},
		{`count_values("version", build_info) # sum(commented_out)` + "\n+ Inf", []string{"build_info"}},
		{`rate(x[${__rate_interval}]) * $scale + rate(x[5m:1m])`, []string{"x"}},
		{`max by (job) (deriv(lag[10m])) > 0 and max by (job) (lag) > 1000`, []string{"lag"}},
		{`time() - process_start_time_seconds{job=~"$job"}`, []string{"process_start_time_seconds"}},
		{`sum  by(le)(rate(h_bucket[1m]))`, []string{"h_bucket"}},
		{`vector(1)`, nil},
	} {
		got, err := metricNames(tc.expr)
		if err != nil || !slices.Equal(got, tc.want) {
			t.Errorf("metricNames(%q) = %q, %v; want %q", tc.expr, got, err, tc.want)
		}
	}
	for _, bad := range []string{`rate(x[5m]`, `sum(x))`, `x{a="b}`, `x[5m`, `{__name__=~"scheduler_.*"}`} {
		if got, err := metricNames(bad); err == nil {
			t.Errorf("metricNames(%q) = %q; want an error", bad, got)
		}
	}

	// The check has teeth: a made-up name, a counter's non-existent
	// _bucket, and a near miss are refused; the legitimate ones pass.
	known := knownMetrics()
	for _, n := range []string{
		"scheduler_bogus_total", "scheduler_dispatch_published_total_bucket",
		"scheduler_ingested_records_total", "pg_stat_activity_count", "node_load1",
	} {
		if known.allowed(n) {
			t.Errorf("allowed(%q) = true; want false", n)
		}
	}
	for _, n := range []string{
		metrics.Messages, metrics.DispatchLateness + "_bucket", metrics.IngestBatchDuration + "_count",
		"go_goroutines", "process_resident_memory_bytes", "promhttp_metric_handler_requests_total",
		"up",
	} {
		if !known.allowed(n) {
			t.Errorf("allowed(%q) = false; want true", n)
		}
	}
}
