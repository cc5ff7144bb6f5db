package kubernetes_test

// No cluster runs the tests: the manifests are built with kustomize's own
// library (what `kubectl apply -k` runs), decoded strictly into the
// Kubernetes and Prometheus Operator API types, and checked against the
// scheduler's code: its configuration (internal/config), its routes and its
// memory formula (internal/service, read from source), the Dockerfile and
// the alert rules.

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
	"go/ast"
	"go/format"
	"go/parser"
	"go/token"
	"io/fs"
	"maps"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/apimachinery/pkg/util/validation"
	kjson "sigs.k8s.io/json"
	"sigs.k8s.io/kustomize/api/krusty"
	kusttypes "sigs.k8s.io/kustomize/api/types"
	"sigs.k8s.io/kustomize/kyaml/filesys"
	"sigs.k8s.io/yaml"

	"github.com/deferq/scheduler/internal/config"
)

// Paths relative to this package's directory (go test's working directory).
const (
	repoRoot   = "../.."
	alertsFile = "../prometheus/alerts.yaml"
	ruleFile   = "scheduler/prometheusrule.yaml"
	dockerfile = repoRoot + "/Dockerfile"
	serviceDir = repoRoot + "/internal/service"
)

// The kustomizations that can be applied, and what each must hold.
const (
	topDir         = "."
	baseDir        = "scheduler"
	migrateDir     = "migrate"
	secretsDir     = "secrets"
	withConsoleDir = "with-console"
)

const (
	deploymentName = "defer-scheduler"
	jobName        = "defer-scheduler-migrate"
	serviceName    = "defer-scheduler"
	consoleService = "defer-scheduler-console"
	imageName      = "deferq/scheduler"
	schedulerCtr   = "scheduler"
	migrateCtr     = "migrate"
)

var update = flag.Bool("update", false, "rewrite "+ruleFile+"'s spec from "+alertsFile)

// --- Decoding ------------------------------------------------------------------

// kinds maps apiVersion/kind to the Go type its manifests decode into.
var kinds = map[string]func() any{
	"v1/ConfigMap":                  func() any { return &corev1.ConfigMap{} },
	"v1/Secret":                     func() any { return &corev1.Secret{} },
	"v1/Service":                    func() any { return &corev1.Service{} },
	"apps/v1/Deployment":            func() any { return &appsv1.Deployment{} },
	"batch/v1/Job":                  func() any { return &batchv1.Job{} },
	"policy/v1/PodDisruptionBudget": func() any { return &policyv1.PodDisruptionBudget{} },
	"monitoring.coreos.com/v1/ServiceMonitor":       func() any { return &monitoringv1.ServiceMonitor{} },
	"monitoring.coreos.com/v1/PrometheusRule":       func() any { return &monitoringv1.PrometheusRule{} },
	"kustomize.config.k8s.io/v1beta1/Kustomization": func() any { return &kusttypes.Kustomization{} },
	"kustomize.config.k8s.io/v1alpha1/Component":    func() any { return &kusttypes.Kustomization{} },
}

// decodeStrict decodes one YAML document into v as the API server does
// under `kubectl apply --validate=strict` (kubectl's default): field names
// are case-sensitive, and an unknown or repeated field is an error. Under
// --validate=false or an older kubectl, the server would drop it silently.
func decodeStrict(doc []byte, v any) error {
	j, err := yaml.YAMLToJSONStrict(doc)
	if err != nil {
		return err
	}
	strict, err := kjson.UnmarshalStrict(j, v, kjson.DisallowDuplicateFields, kjson.DisallowUnknownFields)
	if err != nil {
		return err
	}
	return errors.Join(strict...)
}

// decodeManifest decodes one document into the type its apiVersion and kind
// name, which must be one of kinds.
func decodeManifest(doc []byte) (any, error) {
	var tm struct {
		APIVersion string `json:"apiVersion"`
		Kind       string `json:"kind"`
	}
	if err := yaml.Unmarshal(doc, &tm); err != nil {
		return nil, err
	}
	newObj, ok := kinds[tm.APIVersion+"/"+tm.Kind]
	if !ok {
		return nil, fmt.Errorf("apiVersion %q kind %q is none the test knows", tm.APIVersion, tm.Kind)
	}
	obj := newObj()
	if err := decodeStrict(doc, obj); err != nil {
		return nil, fmt.Errorf("%s %s: %w", tm.APIVersion, tm.Kind, err)
	}
	return obj, nil
}

var docSeparator = regexp.MustCompile(`(?m)^---[ \t]*$`)

// yamlFiles returns every YAML file under this directory.
func yamlFiles(t *testing.T) []string {
	t.Helper()
	var files []string
	err := filepath.WalkDir(".", func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() && (strings.HasSuffix(p, ".yaml") || strings.HasSuffix(p, ".yml")) {
			files = append(files, filepath.ToSlash(p))
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(files) == 0 {
		t.Fatal("no YAML files found")
	}
	return files
}

// readManifests decodes every document of a file strictly.
func readManifests(t *testing.T, path string) []any {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var objs []any
	for i, doc := range docSeparator.Split(string(b), -1) {
		if strings.TrimSpace(stripComments(doc)) == "" {
			continue
		}
		obj, err := decodeManifest([]byte(doc))
		if err != nil {
			t.Errorf("%s (document %d): %v", path, i+1, err)
			continue
		}
		objs = append(objs, obj)
	}
	return objs
}

func stripComments(doc string) string {
	var b strings.Builder
	for line := range strings.SplitSeq(doc, "\n") {
		if !strings.HasPrefix(strings.TrimSpace(line), "#") {
			b.WriteString(line + "\n")
		}
	}
	return b.String()
}

// TestManifestsDecodeStrictly: every YAML file here is a kind the test knows,
// without a field its Go type lacks, and with names Kubernetes accepts.
func TestManifestsDecodeStrictly(t *testing.T) {
	for _, f := range yamlFiles(t) {
		for _, obj := range readManifests(t, f) {
			checkNames(t, f, obj)
		}
	}
}

// The strict decoder is what makes the test worth running: a misspelt or
// misplaced field fails, in a manifest and in a kustomization.
func TestDecoderRefusesUnknownFields(t *testing.T) {
	for _, doc := range []string{
		"apiVersion: v1\nkind: Service\nmetadata: {name: x}\nspec: {ports: [{port: 1, targetport: http}]}\n",
		"apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: x}\nspec: {template: {spec: {containers: [{name: c, readinesProbe: {}}]}}}\n",
		"apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\ndata: {A: b}\ndata: {C: d}\n",
		"apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresource: [a.yaml]\n",
		"apiVersion: monitoring.coreos.com/v1\nkind: PrometheusRule\nmetadata: {name: x}\nspec: {groups: [{name: g, rules: [{alert: A, expr: up, four: 5m}]}]}\n",
		"apiVersion: v1\nkind: Pod\nmetadata: {name: x}\n",
	} {
		if _, err := decodeManifest([]byte(doc)); err == nil {
			t.Errorf("decodeManifest accepted:\n%s", doc)
		}
	}
}

// checkNames checks what the API server's validation would refuse first:
// object, container and port names, label keys and values.
func checkNames(t *testing.T, where string, obj any) {
	t.Helper()
	m, ok := obj.(metav1.Object)
	if !ok {
		return // a kustomization
	}
	for _, e := range validation.IsDNS1123Subdomain(m.GetName()) {
		t.Errorf("%s: name %q: %s", where, m.GetName(), e)
	}
	checkLabels(t, where, m.GetLabels())
	if spec := podSpecOf(obj); spec != nil {
		checkLabels(t, where+" pod template", podLabelsOf(obj))
		for _, c := range spec.Containers {
			for _, e := range validation.IsDNS1123Label(c.Name) {
				t.Errorf("%s: container name %q: %s", where, c.Name, e)
			}
			for _, p := range c.Ports {
				for _, e := range validation.IsValidPortName(p.Name) {
					t.Errorf("%s: port name %q: %s", where, p.Name, e)
				}
			}
			for _, e := range c.Env {
				for _, msg := range validation.IsEnvVarName(e.Name) {
					t.Errorf("%s: env name %q: %s", where, e.Name, msg)
				}
			}
		}
	}
}

func checkLabels(t *testing.T, where string, l map[string]string) {
	t.Helper()
	for k, v := range l {
		for _, e := range validation.IsQualifiedName(k) {
			t.Errorf("%s: label key %q: %s", where, k, e)
		}
		for _, e := range validation.IsValidLabelValue(v) {
			t.Errorf("%s: label %s value %q: %s", where, k, v, e)
		}
	}
}

// --- Kustomize -------------------------------------------------------------------

// build runs kustomize on dir as `kubectl apply -k dir` would, and decodes
// what it produces strictly.
func build(t *testing.T, dir string) []any {
	t.Helper()
	k := krusty.MakeKustomizer(krusty.MakeDefaultOptions())
	m, err := k.Run(filesys.MakeFsOnDisk(), dir)
	if err != nil {
		t.Fatalf("kustomize build %s: %v", dir, err)
	}
	var objs []any
	for _, r := range m.Resources() {
		b, err := r.AsYAML()
		if err != nil {
			t.Fatalf("kustomize build %s: %v", dir, err)
		}
		obj, err := decodeManifest(b)
		if err != nil {
			t.Fatalf("kustomize build %s: %s: %v", dir, r.CurId(), err)
		}
		checkNames(t, dir+": "+r.CurId().String(), obj)
		objs = append(objs, obj)
	}
	return objs
}

// find returns the object of type T named name.
func find[T metav1.Object](t *testing.T, objs []any, name string) T {
	t.Helper()
	for _, o := range objs {
		if v, ok := o.(T); ok && v.GetName() == name {
			return v
		}
	}
	var zero T
	t.Fatalf("no %T named %s", zero, name)
	return zero
}

func all[T any](objs []any) []T {
	var out []T
	for _, o := range objs {
		if v, ok := o.(T); ok {
			out = append(out, v)
		}
	}
	return out
}

// TestKustomizationsListEveryFile: each manifest is in exactly one
// kustomization (resources or patches), so that none is forgotten by `kubectl
// apply -k` and none applied twice; and each kustomization builds.
func TestKustomizationsListEveryFile(t *testing.T) {
	listed := map[string][]string{}
	var dirs []string
	for _, f := range yamlFiles(t) {
		if filepath.Base(f) != "kustomization.yaml" {
			continue
		}
		dir := filepath.Dir(f)
		dirs = append(dirs, dir)
		objs := readManifests(t, f)
		if len(objs) != 1 {
			t.Fatalf("%s: want one kustomization", f)
		}
		k := objs[0].(*kusttypes.Kustomization)
		//lint:ignore SA1019 refusing the deprecated fields takes naming them
		if len(k.PatchesStrategicMerge) > 0 || len(k.PatchesJson6902) > 0 || len(k.CommonLabels) > 0 {
			t.Errorf("%s: deprecated fields (patchesStrategicMerge, patchesJson6902, commonLabels): use patches and labels", f)
		}
		refs := slices.Clone(k.Resources)
		for _, p := range k.Patches {
			refs = append(refs, p.Path)
		}
		for _, r := range refs {
			p := filepath.ToSlash(filepath.Join(dir, r))
			st, err := os.Stat(p)
			switch {
			case err != nil:
				t.Errorf("%s lists %s: %v", f, r, err)
			case st.IsDir():
				if _, err := os.Stat(filepath.Join(p, "kustomization.yaml")); err != nil {
					t.Errorf("%s lists directory %s, which holds no kustomization.yaml", f, r)
				}
			default:
				listed[p] = append(listed[p], f)
			}
		}
	}
	for _, f := range yamlFiles(t) {
		if filepath.Base(f) == "kustomization.yaml" {
			continue
		}
		switch n := len(listed[f]); {
		case n == 0:
			t.Errorf("%s is in no kustomization.yaml: `kubectl apply -k` would never apply it", f)
		case n > 1:
			t.Errorf("%s is in %d kustomizations (%s): one applies it", f, n, strings.Join(listed[f], ", "))
		}
	}
	want := []string{topDir, "console", migrateDir, baseDir, secretsDir, withConsoleDir}
	slices.Sort(dirs)
	slices.Sort(want)
	if !slices.Equal(dirs, want) {
		t.Errorf("kustomizations in %v; the tests know %v: add the new one to them", dirs, want)
	}
	for _, dir := range []string{topDir, baseDir, migrateDir, secretsDir, withConsoleDir} {
		if len(build(t, dir)) == 0 {
			t.Errorf("kustomize build %s: nothing", dir)
		}
	}
}

// TestKustomizationsSplit: the base holds the scheduler and nothing that must
// not be re-applied with it (the migrate Job, whose template cannot change,
// and the Secret templates); the console comes only with its component.
func TestKustomizationsSplit(t *testing.T) {
	base := build(t, topDir)
	if !reflect.DeepEqual(base, build(t, baseDir)) {
		t.Errorf("kustomize build %s differs from %s: `kubectl apply -k deploy/kubernetes` must apply the scheduler as it is", topDir, baseDir)
	}
	for _, kind := range []any{&batchv1.Job{}, &corev1.Secret{}} {
		for _, o := range base {
			if reflect.TypeOf(o) == reflect.TypeOf(kind) {
				t.Errorf("the base kustomization holds a %T (%s)", o, o.(metav1.Object).GetName())
			}
		}
	}
	d := find[*appsv1.Deployment](t, base, deploymentName)
	if v, ok := envValue(container(t, d.Spec.Template.Spec, schedulerCtr), "CONSOLE_ADDR"); ok {
		t.Errorf("the base sets CONSOLE_ADDR=%q: the console must be off unless its component is added", v)
	}
	for _, s := range all[*corev1.Service](base) {
		if s.Name == consoleService {
			t.Errorf("the base holds the console's Service")
		}
	}
	wc := build(t, withConsoleDir)
	find[*corev1.Service](t, wc, consoleService)
	find[*batchv1.Job](t, build(t, migrateDir), jobName)
	secrets := build(t, secretsDir)
	if len(all[*corev1.Secret](secrets)) != len(secrets) {
		t.Errorf("%s holds more than Secrets", secretsDir)
	}
}

// --- The scheduler's configuration --------------------------------------------

// objects is every object the kustomizations apply, the Secret templates
// included, for resolving references.
type objects struct {
	base, withConsole, migrate, secrets []any
}

func load(t *testing.T) objects {
	t.Helper()
	return objects{
		base:        build(t, topDir),
		withConsole: build(t, withConsoleDir),
		migrate:     build(t, migrateDir),
		secrets:     build(t, secretsDir),
	}
}

// podEnv is a container's environment as the kubelet would assemble it from
// env and envFrom, the Secrets read from their templates; names lists where
// each variable comes from.
type podEnv struct {
	vars  map[string]string
	names map[string]string
}

func (e podEnv) environ() []string {
	var out []string
	for k, v := range e.vars {
		out = append(out, k+"="+v)
	}
	slices.Sort(out)
	return out
}

func containerEnv(t *testing.T, where string, c corev1.Container, cluster, secrets []any) podEnv {
	t.Helper()
	e := podEnv{vars: map[string]string{}, names: map[string]string{}}
	set := func(name, value, from string) {
		e.vars[name] = value
		e.names[name] = from
	}
	secretData := func(name string) (map[string]string, bool) {
		for _, s := range all[*corev1.Secret](secrets) {
			if s.Name == name {
				if len(s.Data) > 0 {
					t.Errorf("Secret %s: a template gives stringData, not base64 data", name)
				}
				return s.StringData, true
			}
		}
		return nil, false
	}
	for _, ef := range c.EnvFrom {
		if ef.Prefix != "" {
			t.Errorf("%s: envFrom with a prefix: the scheduler reads its variables by their plain names", where)
		}
		switch {
		case ef.ConfigMapRef != nil:
			var found bool
			for _, cm := range all[*corev1.ConfigMap](cluster) {
				if cm.Name == ef.ConfigMapRef.Name {
					found = true
					for k, v := range cm.Data {
						set(k, v, "ConfigMap "+cm.Name)
					}
				}
			}
			if !found {
				t.Errorf("%s: envFrom ConfigMap %s is not applied with it", where, ef.ConfigMapRef.Name)
			}
		case ef.SecretRef != nil:
			data, ok := secretData(ef.SecretRef.Name)
			if !ok {
				t.Errorf("%s: envFrom Secret %s has no template in %s", where, ef.SecretRef.Name, secretsDir)
			}
			for k, v := range data {
				set(k, v, "Secret "+ef.SecretRef.Name)
			}
		}
	}
	for _, ev := range c.Env {
		switch {
		case ev.ValueFrom == nil:
			set(ev.Name, ev.Value, "env")
		case ev.ValueFrom.SecretKeyRef != nil:
			ref := ev.ValueFrom.SecretKeyRef
			data, ok := secretData(ref.Name)
			v, has := data[ref.Key]
			if !ok || !has {
				t.Errorf("%s: %s comes from Secret %s key %s, which no template in %s has", where, ev.Name, ref.Name, ref.Key, secretsDir)
			}
			set(ev.Name, v, "Secret "+ref.Name)
		default:
			t.Errorf("%s: %s: only values and secretKeyRef are expected", where, ev.Name)
		}
	}
	return e
}

// knownVars returns the variables internal/config reads.
func knownVars() map[string]bool {
	known := map[string]bool{}
	for _, v := range config.Vars() {
		known[v.Name] = true
	}
	return known
}

// pod is a pod the kustomizations run, with its scheduler container's
// environment.
type pod struct {
	where string
	spec  corev1.PodSpec
	env   podEnv
}

func schedulerPods(t *testing.T, o objects) (base, withConsole, migrate pod) {
	t.Helper()
	mk := func(where string, obj any, cluster []any, ctr string) pod {
		spec := *podSpecOf(obj)
		return pod{where: where, spec: spec,
			env: containerEnv(t, where, container(t, spec, ctr), cluster, o.secrets)}
	}
	base = mk("Deployment "+deploymentName, find[*appsv1.Deployment](t, o.base, deploymentName), o.base, schedulerCtr)
	withConsole = mk("Deployment "+deploymentName+" with the console",
		find[*appsv1.Deployment](t, o.withConsole, deploymentName), o.withConsole, schedulerCtr)
	migrate = mk("Job "+jobName, find[*batchv1.Job](t, o.migrate, jobName), o.migrate, migrateCtr)
	return
}

// TestEnvNamesKnown: every variable the manifests give the scheduler, from
// env, a ConfigMap or a Secret, is one internal/config reads: a misspelt
// name would otherwise be ignored without a word.
func TestEnvNamesKnown(t *testing.T) {
	known := knownVars()
	base, wc, mig := schedulerPods(t, load(t))
	for _, p := range []pod{base, wc, mig} {
		for name, from := range p.env.names {
			switch {
			case known[name]:
			case name == "GOMEMLIMIT" || name == "GOGC":
				t.Errorf("%s: %s (%s): the service sets its own from its budgets, and the memory limit is sized for that one", p.where, name, from)
			default:
				t.Errorf("%s: %s (%s) is not a variable of internal/config (scheduler run --help)", p.where, name, from)
			}
		}
	}
}

// TestConfigAccepted: the scheduler accepts the environment the manifests
// give it (as `scheduler run` would read it), the Secret templates' values
// included, but for the console's session key, whose placeholder it must
// refuse: a usable key published in a template would sign anyone's session.
func TestConfigAccepted(t *testing.T) {
	base, wc, mig := schedulerPods(t, load(t))
	cfg := loadConfig(t, base)
	if err := cfg.RequireRun(); err != nil {
		t.Errorf("%s: %v", base.where, err)
	}
	if cfg.ConsoleAddr != "" {
		t.Errorf("%s: CONSOLE_ADDR=%q", base.where, cfg.ConsoleAddr)
	}

	placeholder := wc.env.vars["CONSOLE_SESSION_KEY"]
	if _, err := config.Load(wc.env.environ()); err == nil || !strings.Contains(err.Error(), "CONSOLE_SESSION_KEY") {
		t.Errorf("%s: the placeholder CONSOLE_SESSION_KEY %q is not refused (err %v)", wc.where, placeholder, err)
	}
	wc.env.vars["CONSOLE_SESSION_KEY"] = strings.Repeat("ab", 32)
	if cfg := loadConfig(t, wc); cfg.ConsoleAddr == "" {
		t.Errorf("%s: CONSOLE_ADDR is not set", wc.where)
	}

	loadConfig(t, mig)
	owner, service := dbUser(t, mig), dbUser(t, base)
	if owner == "" || owner == service {
		t.Errorf("%s connects as %q, the service as %q: migrate runs as the schema owner role", mig.where, owner, service)
	}
}

func loadConfig(t *testing.T, p pod) config.Config {
	t.Helper()
	cfg, err := config.Load(p.env.environ())
	if err != nil {
		t.Fatalf("%s: the scheduler refuses its configuration:\n%v", p.where, err)
	}
	return cfg
}

func dbUser(t *testing.T, p pod) string {
	t.Helper()
	u, err := url.Parse(p.env.vars["DATABASE_URL"])
	if err != nil {
		t.Fatalf("%s: DATABASE_URL: %v", p.where, err)
	}
	return u.User.Username()
}

// --- Routes, ports, probes ------------------------------------------------------

// routes returns the patterns internal/service registers ("GET /healthz",
// ...; those of HTTP_ADDR name their method, PPROF_ADDR's do not), read from
// its source: HandleFunc and Handle calls whose pattern is a literal.
func routes(t *testing.T) map[string]bool {
	t.Helper()
	fset := token.NewFileSet()
	files, err := filepath.Glob(filepath.Join(serviceDir, "*.go"))
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]bool{}
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		file, err := parser.ParseFile(fset, f, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		ast.Inspect(file, func(n ast.Node) bool {
			call, ok := n.(*ast.CallExpr)
			if !ok || len(call.Args) == 0 {
				return true
			}
			sel, ok := call.Fun.(*ast.SelectorExpr)
			if !ok || (sel.Sel.Name != "HandleFunc" && sel.Sel.Name != "Handle") {
				return true
			}
			if lit, ok := call.Args[0].(*ast.BasicLit); ok && lit.Kind == token.STRING {
				if s, err := strconv.Unquote(lit.Value); err == nil {
					out[s] = true
				}
			}
			return true
		})
	}
	for _, r := range []string{"GET /healthz", "GET /readyz", "GET /metrics"} {
		if !out[r] {
			t.Fatalf("internal/service registers no %q (found %v): the route parser or the service changed", r, out)
		}
	}
	return out
}

// readinessBound is how long /readyz may take: each of its checks is bounded
// at 2 s (internal/service readiness).
const readinessBound = 2 * time.Second

// TestProbes: liveness and start-up ask GET /healthz, which answers while the
// process runs, so that a replica waiting for Kafka or Postgres is not
// restarted; readiness asks GET /readyz, with a timeout above its checks'.
func TestProbes(t *testing.T) {
	served := routes(t)
	o := load(t)
	base, wc, _ := schedulerPods(t, o)
	for _, p := range []pod{base, wc} {
		c := container(t, p.spec, schedulerCtr)
		port := httpPort(t, p)
		for _, pr := range []struct {
			name  string
			probe *corev1.Probe
			path  string
		}{
			{"startupProbe", c.StartupProbe, "/healthz"},
			{"livenessProbe", c.LivenessProbe, "/healthz"},
			{"readinessProbe", c.ReadinessProbe, "/readyz"},
		} {
			where := p.where + " " + pr.name
			if pr.probe == nil || pr.probe.HTTPGet == nil {
				t.Errorf("%s: want an HTTP GET of %s", where, pr.path)
				continue
			}
			g := pr.probe.HTTPGet
			if g.Path != pr.path || !served["GET "+g.Path] {
				t.Errorf("%s: path %q, want %s, which internal/service serves", where, g.Path, pr.path)
			}
			if g.Scheme != "" && g.Scheme != corev1.URISchemeHTTP {
				t.Errorf("%s: scheme %s: HTTP_ADDR serves plain HTTP", where, g.Scheme)
			}
			if got := resolvePort(t, c, g.Port); got != port {
				t.Errorf("%s: port %s is %d, HTTP_ADDR's is %d", where, g.Port.String(), got, port)
			}
		}
		if r := c.ReadinessProbe; r != nil && time.Duration(r.TimeoutSeconds)*time.Second <= readinessBound {
			t.Errorf("%s readinessProbe: timeoutSeconds %d; /readyz may take %v", p.where, r.TimeoutSeconds, readinessBound)
		}
		if l := c.LivenessProbe; l != nil && time.Duration(l.PeriodSeconds*l.FailureThreshold)*time.Second < 30*time.Second {
			t.Errorf("%s livenessProbe: restarts after %d s without an answer; a collector busy under the memory limit can take that",
				p.where, l.PeriodSeconds*l.FailureThreshold)
		}
	}
}

// httpPort returns HTTP_ADDR's port, and checks that the container's port
// named http, and the Dockerfile's EXPOSE, are that port.
func httpPort(t *testing.T, p pod) int32 {
	t.Helper()
	cfg := loadConfig(t, withSessionKey(p))
	port := addrPort(t, "HTTP_ADDR", cfg.HTTPAddr)
	c := container(t, p.spec, schedulerCtr)
	if got := namedPort(t, c, "http"); got != port {
		t.Errorf("%s: containerPort http is %d, HTTP_ADDR=%s", p.where, got, cfg.HTTPAddr)
	}
	b, err := os.ReadFile(dockerfile)
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^EXPOSE\s+(\d+)`).FindSubmatch(b)
	if m == nil || string(m[1]) != strconv.Itoa(int(port)) {
		t.Errorf("the Dockerfile's EXPOSE (%q) is not HTTP_ADDR's port %d", m, port)
	}
	return port
}

// withSessionKey returns p with a valid console session key in place of
// the template's placeholder, for reading the rest of its configuration.
func withSessionKey(p pod) pod {
	if _, ok := p.env.vars["CONSOLE_SESSION_KEY"]; ok {
		vars := maps.Clone(p.env.vars)
		vars["CONSOLE_SESSION_KEY"] = strings.Repeat("ab", 32)
		p.env.vars = vars
	}
	return p
}

func addrPort(t *testing.T, name, addr string) int32 {
	t.Helper()
	_, p, err := net.SplitHostPort(addr)
	if err != nil {
		t.Fatalf("%s=%q: %v", name, addr, err)
	}
	n, err := strconv.Atoi(p)
	if err != nil {
		t.Fatalf("%s=%q: the manifests need a numeric port", name, addr)
	}
	return int32(n)
}

func namedPort(t *testing.T, c corev1.Container, name string) int32 {
	t.Helper()
	for _, p := range c.Ports {
		if p.Name == name {
			return p.ContainerPort
		}
	}
	t.Fatalf("container %s has no port named %s", c.Name, name)
	return 0
}

func resolvePort(t *testing.T, c corev1.Container, p intstr.IntOrString) int32 {
	t.Helper()
	if p.Type == intstr.Int {
		return p.IntVal
	}
	return namedPort(t, c, p.StrVal)
}

// TestPorts: the Services reach the ports the scheduler listens on, the
// ServiceMonitor scrapes a port of the Service and a path the service serves,
// and the console's port is CONSOLE_ADDR's.
func TestPorts(t *testing.T) {
	served := routes(t)
	o := load(t)
	base, wc, _ := schedulerPods(t, o)
	port := httpPort(t, base)
	c := container(t, base.spec, schedulerCtr)

	svc := find[*corev1.Service](t, o.base, serviceName)
	var svcPortName string
	for _, sp := range svc.Spec.Ports {
		if resolvePort(t, c, sp.TargetPort) == port {
			svcPortName = sp.Name
		}
	}
	if svcPortName == "" {
		t.Fatalf("Service %s has no port to HTTP_ADDR's %d", serviceName, port)
	}
	sm := find[*monitoringv1.ServiceMonitor](t, o.base, serviceName)
	if len(sm.Spec.Endpoints) != 1 {
		t.Fatalf("ServiceMonitor %s: want one endpoint", sm.Name)
	}
	ep := sm.Spec.Endpoints[0]
	if ep.Port != svcPortName {
		t.Errorf("ServiceMonitor %s scrapes port %q; the Service's port to HTTP_ADDR is %q", sm.Name, ep.Port, svcPortName)
	}
	if ep.Path != "/metrics" || !served["GET "+ep.Path] {
		t.Errorf("ServiceMonitor %s scrapes path %q, want /metrics", sm.Name, ep.Path)
	}

	cfg := loadConfig(t, withSessionKey(wc))
	consolePort := addrPort(t, "CONSOLE_ADDR", cfg.ConsoleAddr)
	wcc := container(t, wc.spec, schedulerCtr)
	if got := namedPort(t, wcc, "console"); got != consolePort {
		t.Errorf("%s: containerPort console is %d, CONSOLE_ADDR=%s", wc.where, got, cfg.ConsoleAddr)
	}
	if got := namedPort(t, wcc, "http"); got != port {
		t.Errorf("%s: the console component changed containerPort http to %d", wc.where, got)
	}
	cs := find[*corev1.Service](t, o.withConsole, consoleService)
	if len(cs.Spec.Ports) != 1 || resolvePort(t, wcc, cs.Spec.Ports[0].TargetPort) != consolePort {
		t.Errorf("Service %s does not reach CONSOLE_ADDR's port %d: %+v", cs.Name, consolePort, cs.Spec.Ports)
	}
}

// --- Selectors ------------------------------------------------------------------

// TestSelectors: the Deployment's pods are what its Service, the
// PodDisruptionBudget, the topology spread and the console's Service select,
// the ServiceMonitor selects the metrics Service only, and the migrate Job's
// pod is selected by none of them.
func TestSelectors(t *testing.T) {
	o := load(t)
	d := find[*appsv1.Deployment](t, o.withConsole, deploymentName)
	pods := labels.Set(d.Spec.Template.Labels)
	jobPods := labels.Set(find[*batchv1.Job](t, o.migrate, jobName).Spec.Template.Labels)

	selectors := map[string]labels.Selector{
		"Deployment " + d.Name: labelSelector(t, d.Spec.Selector),
		"PodDisruptionBudget":  labelSelector(t, find[*policyv1.PodDisruptionBudget](t, o.base, deploymentName).Spec.Selector),
	}
	for _, s := range all[*corev1.Service](o.withConsole) {
		selectors["Service "+s.Name] = labels.SelectorFromSet(s.Spec.Selector)
	}
	for i, c := range d.Spec.Template.Spec.TopologySpreadConstraints {
		selectors[fmt.Sprintf("topology spread %d", i)] = labelSelector(t, c.LabelSelector)
	}
	for name, sel := range selectors {
		if sel.Empty() || !sel.Matches(pods) {
			t.Errorf("%s selects %v, not the Deployment's pods %v", name, sel, pods)
		}
		if sel.Matches(jobPods) {
			t.Errorf("%s selects the migrate Job's pod %v", name, jobPods)
		}
	}

	sm := find[*monitoringv1.ServiceMonitor](t, o.base, serviceName)
	smSel := labelSelector(t, &sm.Spec.Selector)
	for _, s := range all[*corev1.Service](o.withConsole) {
		if got, want := smSel.Matches(labels.Set(s.Labels)), s.Name == serviceName; got != want {
			t.Errorf("ServiceMonitor %s selects Service %s: %v, want %v", sm.Name, s.Name, got, want)
		}
	}
}

func labelSelector(t *testing.T, s *metav1.LabelSelector) labels.Selector {
	t.Helper()
	sel, err := metav1.LabelSelectorAsSelector(s)
	if err != nil {
		t.Fatal(err)
	}
	return sel
}

// --- Availability, stop, security, image ----------------------------------------

// TestAvailability: several replicas, spread across nodes, one at a time
// disrupted.
func TestAvailability(t *testing.T) {
	o := load(t)
	d := find[*appsv1.Deployment](t, o.base, deploymentName)
	replicas := int32(1)
	if d.Spec.Replicas != nil {
		replicas = *d.Spec.Replicas
	}
	if replicas < 3 {
		t.Errorf("Deployment %s: %d replicas, want at least 3", d.Name, replicas)
	}
	pdb := find[*policyv1.PodDisruptionBudget](t, o.base, deploymentName)
	switch s := pdb.Spec; {
	case s.MaxUnavailable != nil && s.MinAvailable == nil:
		if s.MaxUnavailable.String() != "1" {
			t.Errorf("PodDisruptionBudget: maxUnavailable %s, want 1", s.MaxUnavailable.String())
		}
	case s.MinAvailable != nil && s.MaxUnavailable == nil:
		if s.MinAvailable.String() != strconv.Itoa(int(replicas)-1) {
			t.Errorf("PodDisruptionBudget: minAvailable %s, want %d", s.MinAvailable.String(), replicas-1)
		}
	default:
		t.Errorf("PodDisruptionBudget: want one of maxUnavailable and minAvailable")
	}
	spread := false
	for _, c := range d.Spec.Template.Spec.TopologySpreadConstraints {
		spread = spread || c.TopologyKey == "kubernetes.io/hostname" && c.WhenUnsatisfiable == corev1.DoNotSchedule
	}
	if a := d.Spec.Template.Spec.Affinity; a != nil && a.PodAntiAffinity != nil {
		spread = true
	}
	if !spread {
		t.Errorf("Deployment %s: replicas are not spread across nodes", d.Name)
	}
}

// shutdownExtra is what a stop takes beyond SHUTDOWN_TIMEOUT: up to a
// second to leave the consumer group (internal/service minGroupClose) and
// one to close the console, plus the margin the kubelet's SIGKILL must
// leave.
const shutdownExtra = 5 * time.Second

// TestTerminationGrace: the kubelet waits for the service's own stop before
// it kills it.
func TestTerminationGrace(t *testing.T) {
	base, wc, _ := schedulerPods(t, load(t))
	for _, p := range []pod{base, wc} {
		cfg := loadConfig(t, withSessionKey(p))
		grace := 30 * time.Second // Kubernetes' default
		if g := p.spec.TerminationGracePeriodSeconds; g != nil {
			grace = time.Duration(*g) * time.Second
		}
		if grace < cfg.ShutdownTimeout+shutdownExtra {
			t.Errorf("%s: terminationGracePeriodSeconds %v; the service's stop takes up to SHUTDOWN_TIMEOUT=%v + %v",
				p.where, grace, cfg.ShutdownTimeout, shutdownExtra)
		}
		for _, c := range p.spec.Containers {
			if c.Lifecycle != nil && c.Lifecycle.PreStop != nil {
				t.Errorf("%s: a preStop hook eats the grace period (and the image has no shell)", p.where)
			}
		}
	}
}

// TestSecurity: non-root with a numeric user (the Dockerfile's USER is a
// name, which the kubelet cannot check), a read-only root file system, no
// privilege escalation, no capabilities, no service account token.
func TestSecurity(t *testing.T) {
	b, err := os.ReadFile(dockerfile)
	if err != nil {
		t.Fatal(err)
	}
	users := regexp.MustCompile(`(?m)^USER\s+(\S+)`).FindAllSubmatch(b, -1)
	if len(users) == 0 {
		t.Fatal("the Dockerfile sets no USER")
	}
	user := string(users[len(users)-1][1])
	numeric := regexp.MustCompile(`^[0-9]+(:[0-9]+)?$`).MatchString(user)

	base, wc, mig := schedulerPods(t, load(t))
	for _, p := range []pod{base, wc, mig} {
		s := p.spec.SecurityContext
		if s == nil || s.RunAsNonRoot == nil || !*s.RunAsNonRoot {
			t.Errorf("%s: runAsNonRoot is not set", p.where)
		}
		if !numeric && (s == nil || s.RunAsUser == nil || *s.RunAsUser == 0) {
			t.Errorf("%s: the image's USER is %q, not a number: set runAsUser, or the kubelet refuses runAsNonRoot", p.where, user)
		}
		if s == nil || s.SeccompProfile == nil || s.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
			t.Errorf("%s: seccompProfile RuntimeDefault is not set", p.where)
		}
		if a := p.spec.AutomountServiceAccountToken; a == nil || *a {
			t.Errorf("%s: automountServiceAccountToken is not false; the scheduler never calls the API", p.where)
		}
		for _, c := range p.spec.Containers {
			cs := c.SecurityContext
			switch {
			case cs == nil:
				t.Errorf("%s %s: no securityContext", p.where, c.Name)
			default:
				if cs.AllowPrivilegeEscalation == nil || *cs.AllowPrivilegeEscalation {
					t.Errorf("%s %s: allowPrivilegeEscalation is not false", p.where, c.Name)
				}
				if cs.ReadOnlyRootFilesystem == nil || !*cs.ReadOnlyRootFilesystem {
					t.Errorf("%s %s: readOnlyRootFilesystem is not true", p.where, c.Name)
				}
				if cs.Capabilities == nil || !slices.Contains(cs.Capabilities.Drop, "ALL") || len(cs.Capabilities.Add) > 0 {
					t.Errorf("%s %s: capabilities must drop ALL and add none", p.where, c.Name)
				}
				if cs.Privileged != nil && *cs.Privileged {
					t.Errorf("%s %s: privileged", p.where, c.Name)
				}
			}
		}
	}
}

// TestImage: the Deployment and the Job run the image the Dockerfile builds,
// the same release, through its ENTRYPOINT, with the command each needs.
func TestImage(t *testing.T) {
	b, err := os.ReadFile(dockerfile)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Contains(b, []byte("-t "+imageName)) {
		t.Errorf("the Dockerfile does not build %s (docker build -t %s)", imageName, imageName)
	}
	base, wc, mig := schedulerPods(t, load(t))
	var images []string
	for _, p := range []struct {
		pod
		ctr  string
		args []string
	}{{base, schedulerCtr, []string{"run"}}, {wc, schedulerCtr, []string{"run"}}, {mig, migrateCtr, []string{"migrate"}}} {
		c := container(t, p.spec, p.ctr)
		if name, _, _ := strings.Cut(c.Image, ":"); name != imageName {
			t.Errorf("%s: image %q, want %s (the Dockerfile's)", p.where, c.Image, imageName)
		}
		images = append(images, c.Image)
		if len(c.Command) > 0 {
			t.Errorf("%s: command %q replaces the image's ENTRYPOINT; give args", p.where, c.Command)
		}
		if !slices.Equal(c.Args, p.args) {
			t.Errorf("%s: args %q, want %q", p.where, c.Args, p.args)
		}
		if len(p.spec.Containers) != 1 || len(p.spec.InitContainers) > 0 {
			t.Errorf("%s: want the one container", p.where)
		}
	}
	if images[0] != images[2] {
		t.Errorf("the Deployment runs %s, the migrate Job %s: they must run the same release (the images: of %s and %s)",
			images[0], images[2], baseDir, migrateDir)
	}
}

// --- Memory ------------------------------------------------------------------------

// documentedRSS is the README's bound for the default budgets ("High
// availability", Memory; cmd/scheduler TestIngestPeakRSSBoundedByBytes).
const documentedRSS = 256_000_000

// overSoftLimit is how far the process's RSS goes over the soft memory
// limit: "about 30 MB" (internal/service memoryLimit), "about 32 MB"
// (README).
const overSoftLimit = 32 << 20

// softMemoryLimit is internal/service's memoryLimit, which is unexported;
// TestMemoryFormulaUnchanged keeps the two the same.
func softMemoryLimit(cfg config.Config) int64 {
	const rest = 48 << 20
	return rest + 3*int64(cfg.IngestBufferBytes)/2 + 2*int64(cfg.DispatchLoops)*int64(cfg.DispatchRoundBytes)
}

// TestMemoryFormulaUnchanged reads memoryLimit in internal/service's source:
// when its formula changes, softMemoryLimit must follow.
func TestMemoryFormulaUnchanged(t *testing.T) {
	fset := token.NewFileSet()
	pkgs, err := filepath.Glob(filepath.Join(serviceDir, "*.go"))
	if err != nil {
		t.Fatal(err)
	}
	var body []string
	for _, f := range pkgs {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		file, err := parser.ParseFile(fset, f, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range file.Decls {
			fn, ok := d.(*ast.FuncDecl)
			if !ok || fn.Name.Name != "memoryLimit" {
				continue
			}
			for _, s := range fn.Body.List {
				var buf bytes.Buffer
				if err := format.Node(&buf, fset, s); err != nil {
					t.Fatal(err)
				}
				body = append(body, strings.Join(strings.Fields(buf.String()), " "))
			}
		}
	}
	want := []string{
		`if gomemlimit != "" { return 0, false }`,
		`const rest = 48 << 20`,
		`return rest + 3*int64(cfg.IngestBufferBytes)/2 + 2*int64(cfg.DispatchLoops)*int64(cfg.DispatchRoundBytes), true`,
	}
	if !slices.Equal(body, want) {
		t.Errorf("internal/service memoryLimit is now\n  %s\nnot\n  %s\nupdate softMemoryLimit here, and the arithmetic in deployment.yaml's comment",
			strings.Join(body, "\n  "), strings.Join(want, "\n  "))
	}
}

// TestMemoryResources: the container's memory limit holds what the service
// may use with the budgets the manifests set: its soft limit plus what the
// process holds beyond it, and at least the README's measured bound; the
// request is the limit.
func TestMemoryResources(t *testing.T) {
	base, wc, _ := schedulerPods(t, load(t))
	for _, p := range []pod{base, wc} {
		cfg := loadConfig(t, withSessionKey(p))
		soft := softMemoryLimit(cfg)
		need := max(soft+overSoftLimit, documentedRSS)
		c := container(t, p.spec, schedulerCtr)
		limit, ok := c.Resources.Limits[corev1.ResourceMemory]
		if !ok {
			t.Errorf("%s: no memory limit", p.where)
			continue
		}
		if limit.Value() < need {
			t.Errorf("%s: memory limit %s (%d bytes) is below %d: the soft limit %d (INGEST_BUFFER_BYTES=%d, DISPATCH_LOOPS=%d, DISPATCH_ROUND_BYTES=%d) plus %d, and at least %d",
				p.where, limit.String(), limit.Value(), need, soft, cfg.IngestBufferBytes, cfg.DispatchLoops, cfg.DispatchRoundBytes, overSoftLimit, documentedRSS)
		}
		if req := c.Resources.Requests[corev1.ResourceMemory]; req.Cmp(limit) != 0 {
			t.Errorf("%s: memory request %s is not the limit %s", p.where, req.String(), limit.String())
		}
		if _, ok := c.Resources.Requests[corev1.ResourceCPU]; !ok {
			t.Errorf("%s: no CPU request", p.where)
		}
	}
}

// The check has teeth: budgets raised past the limit fail it.
func TestMemoryResourcesCatchesLargerBudgets(t *testing.T) {
	cfg, err := config.Load([]string{"INGEST_BUFFER_BYTES=134217728"})
	if err != nil {
		t.Fatal(err)
	}
	limit := resource.MustParse("256Mi")
	if need := softMemoryLimit(cfg) + overSoftLimit; limit.Value() >= need {
		t.Errorf("a 128 MiB ingest budget needs %d bytes, and 256Mi (%d) passes", need, limit.Value())
	}
}

// --- Alerts -------------------------------------------------------------------------

// generatedSpec returns the text under prometheusrule.yaml's spec: alerts.yaml
// from its groups: line on, indented to sit under spec, its comments and
// formatting kept.
func generatedSpec(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile(alertsFile)
	if err != nil {
		t.Fatal(err)
	}
	var top map[string]any
	if err := yaml.Unmarshal(b, &top); err != nil {
		t.Fatalf("%s: %v", alertsFile, err)
	}
	if len(top) != 1 || top["groups"] == nil {
		t.Fatalf("%s: want groups: alone at the top level, found %v", alertsFile, slices.Sorted(maps.Keys(top)))
	}
	text := string(b)
	i := strings.Index("\n"+text, "\ngroups:")
	if i < 0 {
		t.Fatalf("%s: no groups: line", alertsFile)
	}
	var out strings.Builder
	for line := range strings.SplitSeq(strings.TrimRight(text[i:], "\n"), "\n") {
		if line != "" {
			out.WriteString("  ")
		}
		out.WriteString(line + "\n")
	}
	return out.String()
}

// TestPrometheusRuleIsAlertsYAML: the PrometheusRule's groups are alerts.yaml's
// groups, the same text and the same values; -update rewrites them.
func TestPrometheusRuleIsAlertsYAML(t *testing.T) {
	b, err := os.ReadFile(ruleFile)
	if err != nil {
		t.Fatal(err)
	}
	text := string(b)
	i := strings.Index(text, "\nspec:\n")
	if i < 0 {
		t.Fatalf("%s: no top-level spec: line", ruleFile)
	}
	head, spec := text[:i+len("\nspec:\n")], text[i+len("\nspec:\n"):]
	want := generatedSpec(t)
	if *update && spec != want {
		if err := os.WriteFile(ruleFile, []byte(head+want), 0o644); err != nil {
			t.Fatal(err)
		}
		t.Logf("rewrote %s's spec from %s", ruleFile, alertsFile)
		spec = want
		b = []byte(head + want)
	}
	if spec != want {
		t.Errorf("%s's spec is not %s's groups: in deploy/kubernetes run\n  go test -run TestPrometheusRuleIsAlertsYAML -update", ruleFile, alertsFile)
	}

	var alerts struct {
		Groups any `json:"groups"`
	}
	var rule struct {
		Spec struct {
			Groups any `json:"groups"`
		} `json:"spec"`
	}
	ab, err := os.ReadFile(alertsFile)
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(ab, &alerts); err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(b, &rule); err != nil {
		t.Fatal(err)
	}
	if alerts.Groups == nil || !reflect.DeepEqual(alerts.Groups, rule.Spec.Groups) {
		t.Errorf("%s's spec.groups differ from %s's groups", ruleFile, alertsFile)
	}
	objs := readManifests(t, ruleFile)
	if len(objs) == 1 {
		if pr, ok := objs[0].(*monitoringv1.PrometheusRule); !ok || len(pr.Spec.Groups) == 0 {
			t.Errorf("%s: no rule groups", ruleFile)
		}
	}
}

// TestServiceMonitorJob: the scrape job is the one alerts.yaml's `up` rules
// name.
func TestServiceMonitorJob(t *testing.T) {
	b, err := os.ReadFile(alertsFile)
	if err != nil {
		t.Fatal(err)
	}
	jobs := map[string]bool{}
	for _, m := range regexp.MustCompile(`\bjob\s*=\s*"([^"]*)"`).FindAllSubmatch(b, -1) {
		jobs[string(m[1])] = true
	}
	if len(jobs) != 1 {
		t.Fatalf("%s names jobs %v; want one", alertsFile, jobs)
	}
	sm := find[*monitoringv1.ServiceMonitor](t, build(t, baseDir), serviceName)
	job := ""
	if sm.Spec.JobLabel != "" {
		t.Errorf("ServiceMonitor %s: jobLabel takes the job from a Service label; the relabelling sets it", sm.Name)
	}
	for _, ep := range sm.Spec.Endpoints {
		for _, r := range ep.RelabelConfigs {
			if r.TargetLabel == "job" && (r.Action == "" || strings.EqualFold(r.Action, "replace")) &&
				len(r.SourceLabels) == 0 && r.Replacement != nil {
				job = *r.Replacement
			}
		}
	}
	if !jobs[job] {
		t.Errorf("ServiceMonitor %s relabels job to %q; %s looks for %v", sm.Name, job, alertsFile, jobs)
	}
}

// --- Helpers -------------------------------------------------------------------------

func container(t *testing.T, spec corev1.PodSpec, name string) corev1.Container {
	t.Helper()
	for _, c := range spec.Containers {
		if c.Name == name {
			return c
		}
	}
	t.Fatalf("no container %s", name)
	return corev1.Container{}
}

func envValue(c corev1.Container, name string) (string, bool) {
	for _, e := range c.Env {
		if e.Name == name {
			return e.Value, true
		}
	}
	return "", false
}

func podSpecOf(obj any) *corev1.PodSpec {
	switch o := obj.(type) {
	case *appsv1.Deployment:
		return &o.Spec.Template.Spec
	case *batchv1.Job:
		return &o.Spec.Template.Spec
	}
	return nil
}

func podLabelsOf(obj any) map[string]string {
	switch o := obj.(type) {
	case *appsv1.Deployment:
		return o.Spec.Template.Labels
	case *batchv1.Job:
		return o.Spec.Template.Labels
	}
	return nil
}
