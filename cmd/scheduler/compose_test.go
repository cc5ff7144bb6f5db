package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/deferq/scheduler/internal/config"
	"gopkg.in/yaml.v3"
)

// No Docker engine runs the tests, so compose.yaml, the Dockerfile and
// .dockerignore are checked by reading them: the stack must start in the
// right order, and what it gives the scheduler must be a configuration the
// scheduler accepts.

// repoRoot is where compose.yaml, the Dockerfile and go.mod live, relative
// to this package's directory (go test's working directory).
const repoRoot = "../.."

// The compose file, as much of it as the tests look at. Fields that compose
// accepts in more than one form decode from either.
type composeFile struct {
	Services map[string]composeService `yaml:"services"`
	Volumes  map[string]any            `yaml:"volumes"`
}

type composeService struct {
	Image       string         `yaml:"image"`
	Build       composeBuild   `yaml:"build"`
	Command     composeCommand `yaml:"command"`
	Environment composeEnv     `yaml:"environment"`
	DependsOn   composeDeps    `yaml:"depends_on"`
	Healthcheck *struct {
		Test composeCommand `yaml:"test"`
	} `yaml:"healthcheck"`
	Ports   []string `yaml:"ports"`
	Volumes []string `yaml:"volumes"`
}

// composeBuild is `build: dir` or `build: {context: dir, dockerfile: file}`.
type composeBuild struct {
	Set        bool
	Context    string
	Dockerfile string
}

func (b *composeBuild) UnmarshalYAML(n *yaml.Node) error {
	b.Set = true
	if n.Kind == yaml.ScalarNode {
		b.Context = n.Value
		return nil
	}
	var long struct {
		Context    string `yaml:"context"`
		Dockerfile string `yaml:"dockerfile"`
	}
	if err := n.Decode(&long); err != nil {
		return err
	}
	b.Context, b.Dockerfile = long.Context, long.Dockerfile
	return nil
}

// composeCommand is a list, or a string that compose splits like a shell.
type composeCommand []string

func (c *composeCommand) UnmarshalYAML(n *yaml.Node) error {
	if n.Kind == yaml.ScalarNode {
		*c = strings.Fields(n.Value)
		return nil
	}
	var l []string
	err := n.Decode(&l)
	*c = l
	return err
}

// composeEnv is a mapping (NAME: value) or a list (NAME=value). A name
// without a value is passed through from the shell running compose; it maps
// to "" here.
type composeEnv map[string]string

func (e *composeEnv) UnmarshalYAML(n *yaml.Node) error {
	m := composeEnv{}
	switch n.Kind {
	case yaml.MappingNode:
		for i := 0; i+1 < len(n.Content); i += 2 {
			v := n.Content[i+1]
			if v.Kind != yaml.ScalarNode {
				return fmt.Errorf("line %d: environment value of %s is not a scalar", v.Line, n.Content[i].Value)
			}
			if v.Tag == "!!null" {
				m[n.Content[i].Value] = ""
				continue
			}
			m[n.Content[i].Value] = v.Value
		}
	case yaml.SequenceNode:
		for _, item := range n.Content {
			k, v, _ := strings.Cut(item.Value, "=")
			m[k] = v
		}
	default:
		return fmt.Errorf("line %d: environment is neither a mapping nor a list", n.Line)
	}
	*e = m
	return nil
}

// environ returns e in os.Environ form, sorted.
func (e composeEnv) environ() []string {
	var out []string
	for k, v := range e {
		out = append(out, k+"="+v)
	}
	slices.Sort(out)
	return out
}

// composeDeps is depends_on: a list of services (condition service_started)
// or a mapping of service to {condition: ...}.
type composeDeps map[string]string

func (d *composeDeps) UnmarshalYAML(n *yaml.Node) error {
	m := composeDeps{}
	switch n.Kind {
	case yaml.SequenceNode:
		for _, item := range n.Content {
			m[item.Value] = "service_started"
		}
	case yaml.MappingNode:
		var long map[string]struct {
			Condition string `yaml:"condition"`
		}
		if err := n.Decode(&long); err != nil {
			return err
		}
		for s, v := range long {
			if v.Condition == "" {
				v.Condition = "service_started"
			}
			m[s] = v.Condition
		}
	default:
		return fmt.Errorf("line %d: depends_on is neither a list nor a mapping", n.Line)
	}
	*d = m
	return nil
}

func loadCompose(t *testing.T) composeFile {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(repoRoot, "compose.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var c composeFile
	if err := yaml.Unmarshal(data, &c); err != nil {
		t.Fatalf("compose.yaml: %v", err)
	}
	for _, name := range []string{"postgres", "kafka", "kafka-init", "migrate", "scheduler"} {
		if _, ok := c.Services[name]; !ok {
			t.Fatalf("compose.yaml has no service %q (has %v)", name, mapKeys(c.Services))
		}
	}
	return c
}

func mapKeys[V any](m map[string]V) []string {
	var ks []string
	for k := range m {
		ks = append(ks, k)
	}
	slices.Sort(ks)
	return ks
}

func TestComposeServicesAndDependencies(t *testing.T) {
	c := loadCompose(t)
	tests := []struct {
		service string
		want    map[string]string // dependency -> condition
	}{
		{"scheduler", map[string]string{
			"postgres":   "service_healthy",
			"kafka-init": "service_completed_successfully",
			"migrate":    "service_completed_successfully",
		}},
		{"migrate", map[string]string{"postgres": "service_healthy"}},
		{"kafka-init", map[string]string{"kafka": "service_healthy"}},
	}
	for _, tt := range tests {
		t.Run(tt.service, func(t *testing.T) {
			got := c.Services[tt.service].DependsOn
			for dep, cond := range tt.want {
				if got[dep] != cond {
					t.Errorf("depends_on %s: condition %q, want %q", dep, got[dep], cond)
				}
			}
		})
	}
	// Waiting for a service to be healthy needs a health check on it.
	for name, s := range c.Services {
		for dep, cond := range s.DependsOn {
			d, ok := c.Services[dep]
			switch {
			case !ok:
				t.Errorf("%s depends on %s, which is not a service", name, dep)
			case cond == "service_healthy" && (d.Healthcheck == nil || len(d.Healthcheck.Test) == 0):
				t.Errorf("%s waits for %s to be healthy, but %s has no healthcheck", name, dep, dep)
			}
		}
	}
	if hc := c.Services["postgres"].Healthcheck; hc == nil || !strings.Contains(strings.Join(hc.Test, " "), "pg_isready") {
		t.Errorf("postgres healthcheck %v does not run pg_isready", hc)
	}
}

func TestComposePostgres(t *testing.T) {
	c := loadCompose(t)
	pg := c.Services["postgres"]
	if !strings.HasPrefix(pg.Image, "postgres:") {
		t.Errorf("postgres image %q, want postgres:<version>", pg.Image)
	}
	if pg.Environment["POSTGRES_PASSWORD"] == "" {
		t.Error("postgres sets no POSTGRES_PASSWORD (the image refuses to start without one)")
	}
	if !slices.ContainsFunc(pg.Volumes, func(v string) bool { return strings.HasSuffix(v, ":/var/lib/postgresql/data") }) {
		t.Errorf("postgres volumes %v: none holds /var/lib/postgresql/data", pg.Volumes)
	}
	// The image's defaults: user postgres, database named after the user.
	user := orDefault(pg.Environment["POSTGRES_USER"], "postgres")
	db := orDefault(pg.Environment["POSTGRES_DB"], user)
	for _, svc := range []string{"scheduler", "migrate"} {
		t.Run(svc, func(t *testing.T) {
			raw := c.Services[svc].Environment["DATABASE_URL"]
			u, err := url.Parse(raw)
			if err != nil {
				t.Fatalf("DATABASE_URL %q: %v", raw, err)
			}
			pass, _ := u.User.Password()
			checks := []struct{ what, got, want string }{
				{"scheme", u.Scheme, "postgres"},
				{"host", u.Hostname(), "postgres"},
				{"port", orDefault(u.Port(), "5432"), "5432"},
				{"user", u.User.Username(), user},
				{"password", pass, pg.Environment["POSTGRES_PASSWORD"]},
				{"database", strings.TrimPrefix(u.Path, "/"), db},
			}
			for _, ch := range checks {
				if ch.got != ch.want && !(ch.what == "scheme" && ch.got == "postgresql") {
					t.Errorf("DATABASE_URL %q: %s %q, want %q (from the postgres service)", raw, ch.what, ch.got, ch.want)
				}
			}
		})
	}
}

// orDefault returns s, or def when s is empty.
func orDefault(s, def string) string {
	if s == "" {
		return def
	}
	return s
}

func TestComposeKafka(t *testing.T) {
	c := loadCompose(t)
	env := c.Services["kafka"].Environment
	fixed := []struct{ name, want string }{
		{"KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR", "1"},
		{"KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR", "1"},
		{"KAFKA_TRANSACTION_STATE_LOG_MIN_ISR", "1"},
		{"KAFKA_AUTO_CREATE_TOPICS_ENABLE", "false"},
		{"KAFKA_CONTROLLER_QUORUM_VOTERS", env["KAFKA_NODE_ID"] + "@kafka:9093"},
	}
	for _, f := range fixed {
		if env[f.name] != f.want {
			t.Errorf("kafka %s=%q, want %q", f.name, env[f.name], f.want)
		}
	}
	if env["KAFKA_NODE_ID"] == "" {
		t.Error("kafka sets no KAFKA_NODE_ID")
	}
	roles := strings.Split(env["KAFKA_PROCESS_ROLES"], ",")
	if !slices.Contains(roles, "broker") || !slices.Contains(roles, "controller") {
		t.Errorf("kafka KAFKA_PROCESS_ROLES=%q, want broker and controller (single-node KRaft)", env["KAFKA_PROCESS_ROLES"])
	}
	listeners := parseListeners(t, env["KAFKA_LISTENERS"])
	for _, name := range strings.Split(env["KAFKA_CONTROLLER_LISTENER_NAMES"], ",") {
		if _, ok := listeners[name]; !ok {
			t.Errorf("controller listener %q is not in KAFKA_LISTENERS=%q", name, env["KAFKA_LISTENERS"])
		}
	}
	protocols := map[string]string{}
	for _, kv := range strings.Split(env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"], ",") {
		k, v, _ := strings.Cut(kv, ":")
		protocols[k] = v
	}
	for name, addr := range parseListeners(t, env["KAFKA_ADVERTISED_LISTENERS"]) {
		l, ok := listeners[name]
		if !ok {
			t.Errorf("advertised listener %s is not in KAFKA_LISTENERS=%q", name, env["KAFKA_LISTENERS"])
			continue
		}
		if port(addr) != port(l) {
			t.Errorf("advertised listener %s=%s, but it listens on %s", name, addr, l)
		}
		if protocols[name] == "" {
			t.Errorf("listener %s has no protocol in KAFKA_LISTENER_SECURITY_PROTOCOL_MAP", name)
		}
	}
}

// parseListeners parses "NAME://host:port,..." into name -> host:port.
func parseListeners(t *testing.T, s string) map[string]string {
	t.Helper()
	out := map[string]string{}
	for _, l := range strings.Split(s, ",") {
		name, addr, ok := strings.Cut(strings.TrimSpace(l), "://")
		if !ok {
			t.Errorf("listener %q is not NAME://host:port", l)
			continue
		}
		out[name] = addr
	}
	return out
}

func port(hostport string) string {
	_, p, _ := net.SplitHostPort(hostport)
	return p
}

// internalKafkaAddrs returns the advertised addresses of the kafka service
// that other containers reach by its service name, with their protocols.
func internalKafkaAddrs(t *testing.T, c composeFile) map[string]string {
	t.Helper()
	env := c.Services["kafka"].Environment
	protocols := map[string]string{}
	for _, kv := range strings.Split(env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"], ",") {
		k, v, _ := strings.Cut(kv, ":")
		protocols[k] = v
	}
	out := map[string]string{}
	for name, addr := range parseListeners(t, env["KAFKA_ADVERTISED_LISTENERS"]) {
		if host, _, err := net.SplitHostPort(addr); err == nil && host == "kafka" {
			out[addr] = protocols[name]
		}
	}
	if len(out) == 0 {
		t.Fatalf("kafka advertises no listener on host kafka: KAFKA_ADVERTISED_LISTENERS=%q", env["KAFKA_ADVERTISED_LISTENERS"])
	}
	return out
}

func TestComposeSchedulerEnvironment(t *testing.T) {
	c := loadCompose(t)
	known := map[string]bool{}
	for _, v := range config.Vars() {
		known[v.Name] = true
	}
	for _, svc := range []string{"scheduler", "migrate"} {
		t.Run(svc, func(t *testing.T) {
			env := c.Services[svc].Environment
			for _, name := range mapKeys(env) {
				if !known[name] {
					t.Errorf("%s sets %s, which is not a scheduler variable (scheduler run --help lists them)", svc, name)
				}
			}
			cfg, err := config.Load(env.environ())
			if err != nil {
				t.Fatalf("%s's environment does not load:\n%v", svc, err)
			}
			if cfg.DatabaseURL == "" {
				t.Errorf("%s sets no DATABASE_URL", svc)
			}
		})
	}

	env := c.Services["scheduler"].Environment
	for _, name := range []string{"DATABASE_URL", "KAFKA_BROKERS", "TARGET_TOPICS"} {
		if env[name] == "" {
			t.Errorf("scheduler does not set %s", name)
		}
	}
	cfg, err := config.Load(env.environ())
	if err != nil {
		t.Fatalf("scheduler's environment does not load:\n%v", err)
	}
	if err := cfg.RequireRun(); err != nil {
		t.Errorf("scheduler's environment is not enough for run:\n%v", err)
	}

	internal := internalKafkaAddrs(t, c)
	for _, b := range cfg.KafkaBrokers {
		proto, ok := internal[b]
		switch {
		case !ok:
			t.Errorf("KAFKA_BROKERS has %s, want one of kafka's internal advertised listeners %v", b, mapKeys(internal))
		case proto != "PLAINTEXT" && !cfg.KafkaTLS:
			t.Errorf("KAFKA_BROKERS %s is a %s listener, but KAFKA_TLS is off", b, proto)
		}
	}

	// The published port is the one the scheduler listens on.
	_, httpPort, _ := net.SplitHostPort(cfg.HTTPAddr)
	if !slices.ContainsFunc(c.Services["scheduler"].Ports, func(p string) bool {
		return strings.HasSuffix(p, ":"+httpPort) || p == httpPort
	}) {
		t.Errorf("scheduler ports %v do not publish HTTP_ADDR's port %s", c.Services["scheduler"].Ports, httpPort)
	}
}

// kafkaTopicsCall is one kafka-topics.sh invocation in kafka-init.
type kafkaTopicsCall struct {
	create           bool
	topic, bootstrap string
}

func kafkaInitCalls(t *testing.T, c composeFile) []kafkaTopicsCall {
	t.Helper()
	script := strings.Join(c.Services["kafka-init"].Command, " ")
	parts := strings.Split(script, "kafka-topics.sh")
	var calls []kafkaTopicsCall
	flagValue := func(s, flag string) string {
		m := regexp.MustCompile(`(?:^|\s)` + regexp.QuoteMeta(flag) + `(?:\s+|=)("?)([^\s"]+)`).FindStringSubmatch(s)
		if m == nil {
			return ""
		}
		return m[2]
	}
	for _, p := range parts[1:] {
		// The invocation ends at the end of its line or command.
		p, _, _ = strings.Cut(p, "\n")
		p, _, _ = strings.Cut(p, ";")
		p, _, _ = strings.Cut(p, "&&")
		calls = append(calls, kafkaTopicsCall{
			create:    regexp.MustCompile(`(^|\s)--create(\s|$)`).MatchString(p),
			topic:     flagValue(p, "--topic"),
			bootstrap: flagValue(p, "--bootstrap-server"),
		})
	}
	if len(calls) == 0 {
		t.Fatalf("kafka-init does not run kafka-topics.sh: command %q", script)
	}
	return calls
}

func TestComposeTopics(t *testing.T) {
	c := loadCompose(t)
	internal := internalKafkaAddrs(t, c)
	created := map[string]bool{}
	for _, call := range kafkaInitCalls(t, c) {
		if _, ok := internal[call.bootstrap]; !ok {
			t.Errorf("kafka-init: kafka-topics.sh --bootstrap-server %q, want one of %v", call.bootstrap, mapKeys(internal))
		}
		if call.create {
			if call.topic == "" {
				t.Error("kafka-init: kafka-topics.sh --create without --topic")
			}
			created[call.topic] = true
		}
	}

	var deferDefault string
	for _, v := range config.Vars() {
		if v.Name == "DEFER_TOPIC" {
			deferDefault = v.Default
		}
	}
	cfg, err := config.Load(c.Services["scheduler"].Environment.environ())
	if err != nil {
		t.Fatalf("scheduler's environment does not load:\n%v", err)
	}
	for _, topic := range []string{deferDefault, cfg.DeferTopic} {
		if !created[topic] {
			t.Errorf("kafka-init creates %v, not the defer topic %q", mapKeys(created), topic)
		}
	}
	// Every other topic is an example target, and must be one the scheduler
	// is allowed to publish to.
	targets := 0
	for topic := range created {
		if topic == cfg.DeferTopic {
			continue
		}
		targets++
		if !cfg.Targets().Allows(topic) {
			t.Errorf("kafka-init creates %s, which TARGET_TOPICS=%q does not allow", topic, cfg.TargetTopics)
		}
	}
	if targets == 0 {
		t.Error("kafka-init creates no target topic to republish to")
	}
}

func TestComposeCommands(t *testing.T) {
	c := loadCompose(t)
	tests := []struct {
		service, command string
	}{
		{"scheduler", "run"},
		{"migrate", "migrate"},
	}
	for _, tt := range tests {
		t.Run(tt.service, func(t *testing.T) {
			s := c.Services[tt.service]
			if len(s.Command) == 0 || s.Command[0] != tt.command {
				t.Fatalf("command %q, want %q first", s.Command, tt.command)
			}
			// --help after the command's own flags: exit 0 only if they parse.
			var stderr bytes.Buffer
			args := append(slices.Clone([]string(s.Command)), "--help")
			if code := run(context.Background(), args, nil, io.Discard, &stderr); code != 0 {
				t.Errorf("scheduler %q: exit %d, want 0: %s", args, code, stderr.String())
			}
			if !s.Build.Set {
				t.Fatal("not built from this repository (no build:)")
			}
			if ctx := filepath.Clean(orDefault(s.Build.Context, ".")); ctx != "." {
				t.Errorf("build context %q, want the repository root", s.Build.Context)
			}
			if df := orDefault(s.Build.Dockerfile, "Dockerfile"); df != "Dockerfile" {
				t.Errorf("build dockerfile %q, want Dockerfile", df)
			}
		})
	}
	if a, b := c.Services["scheduler"].Image, c.Services["migrate"].Image; a != b {
		t.Errorf("scheduler image %q and migrate image %q differ: migrate must run the same build", a, b)
	}
}

// dockerInstruction is one Dockerfile instruction, continuation lines joined.
type dockerInstruction struct {
	line      int
	cmd, args string
}

func readDockerfile(t *testing.T) []dockerInstruction {
	t.Helper()
	f, err := os.Open(filepath.Join(repoRoot, "Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var out []dockerInstruction
	var cur strings.Builder
	start := 0
	sc := bufio.NewScanner(f)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if strings.HasPrefix(line, "#") || (line == "" && cur.Len() == 0) {
			continue
		}
		if cur.Len() == 0 {
			start = n
		}
		if s, ok := strings.CutSuffix(line, `\`); ok {
			cur.WriteString(s + " ")
			continue
		}
		cur.WriteString(line)
		cmd, args, _ := strings.Cut(cur.String(), " ")
		out = append(out, dockerInstruction{start, strings.ToUpper(cmd), strings.TrimSpace(args)})
		cur.Reset()
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

func TestComposeDockerfile(t *testing.T) {
	ins := readDockerfile(t)
	index := func(pred func(dockerInstruction) bool) int { return slices.IndexFunc(ins, pred) }
	var froms []int
	for i, in := range ins {
		if in.cmd == "FROM" {
			froms = append(froms, i)
		}
	}
	if len(froms) < 2 {
		t.Fatalf("want a multi-stage build (builder and runtime), got %d FROM", len(froms))
	}
	final := ins[froms[len(froms)-1]:]

	// The builder: Go at least as new as go.mod's, modules downloaded in a
	// layer of their own before the sources are copied, a static binary.
	builder := strings.Fields(ins[froms[0]].args)
	goImage, _, _ := strings.Cut(builder[0], "@")
	goTag, ok := strings.CutPrefix(goImage, "golang:")
	if !ok {
		t.Fatalf("builder image %q, want golang:<version>", builder[0])
	}
	stage := ""
	if len(builder) == 3 && strings.EqualFold(builder[1], "AS") {
		stage = builder[2]
	}
	if want := goModVersion(t); !strings.HasPrefix(goTag, want) {
		t.Errorf("builder golang:%s, want golang:%s (go.mod's go directive)", goTag, want)
	}
	modCopy := index(func(in dockerInstruction) bool {
		return in.cmd == "COPY" && strings.Contains(in.args, "go.mod") && strings.Contains(in.args, "go.sum")
	})
	download := index(func(in dockerInstruction) bool {
		return in.cmd == "RUN" && strings.Contains(in.args, "go mod download")
	})
	srcCopy := index(func(in dockerInstruction) bool {
		f := strings.Fields(in.args)
		return in.cmd == "COPY" && len(f) >= 2 && f[0] == "."
	})
	build := index(func(in dockerInstruction) bool { return in.cmd == "RUN" && strings.Contains(in.args, "go build") })
	if modCopy < 0 || download < 0 || srcCopy < 0 || build < 0 ||
		!(modCopy < download && download < srcCopy && srcCopy < build && build < froms[len(froms)-1]) {
		t.Errorf("builder steps out of order or missing: COPY go.mod go.sum at %d, go mod download at %d, COPY . at %d, go build at %d (instruction indexes)",
			modCopy, download, srcCopy, build)
	}
	var binary string
	if build >= 0 {
		args := ins[build].args
		for _, want := range []string{"-trimpath", "-X main.version=", "./cmd/scheduler"} {
			if !strings.Contains(args, want) {
				t.Errorf("go build step %q lacks %s", args, want)
			}
		}
		// distroless/static has no C library: the binary must not need one.
		cgoOff := strings.Contains(args, "CGO_ENABLED=0") || slices.ContainsFunc(ins[:build], func(in dockerInstruction) bool {
			return in.cmd == "ENV" && strings.Contains(in.args, "CGO_ENABLED=0")
		})
		if !cgoOff {
			t.Errorf("go build step %q runs without CGO_ENABLED=0", args)
		}
		if m := regexp.MustCompile(`\s-o\s+(\S+)`).FindStringSubmatch(args); m != nil {
			binary = m[1]
		} else {
			t.Errorf("go build step %q has no -o", args)
		}
	}

	// The runtime: distroless, the binary copied from the builder, run as
	// the entrypoint with `run` as default command.
	if img := ins[froms[len(froms)-1]].args; !strings.HasPrefix(img, "gcr.io/distroless/static") {
		t.Errorf("runtime image %q, want gcr.io/distroless/static-*", img)
	}
	exec := func(cmd string) []string {
		i := slices.IndexFunc(final, func(in dockerInstruction) bool { return in.cmd == cmd })
		if i < 0 {
			t.Errorf("no %s in the final stage", cmd)
			return nil
		}
		var l []string
		if err := json.Unmarshal([]byte(final[i].args), &l); err != nil || len(l) == 0 {
			t.Errorf("line %d: %s %s is not in exec form (a JSON list): distroless has no shell", final[i].line, cmd, final[i].args)
		}
		return l
	}
	entry, defCmd := exec("ENTRYPOINT"), exec("CMD")
	if len(defCmd) == 0 || defCmd[0] != "run" {
		t.Errorf("CMD %q, want [\"run\"]", defCmd)
	}
	if len(entry) > 0 && filepath.Base(entry[0]) != "scheduler" {
		t.Errorf("ENTRYPOINT %q does not run the scheduler binary", entry)
	}
	if len(entry) > 0 && binary != "" {
		copied := slices.ContainsFunc(final, func(in dockerInstruction) bool {
			f := strings.Fields(in.args)
			return in.cmd == "COPY" && len(f) == 3 && f[0] == "--from="+stage && f[1] == binary &&
				(f[2] == entry[0] || f[2] == filepath.Dir(entry[0])+"/")
		})
		if !copied {
			t.Errorf("final stage has no COPY --from=%s %s %s: the ENTRYPOINT is not the binary built", stage, binary, entry[0])
		}
	}
	var defaultPort string
	for _, v := range config.Vars() {
		if v.Name == "HTTP_ADDR" {
			_, defaultPort, _ = net.SplitHostPort(v.Default)
		}
	}
	if !slices.ContainsFunc(final, func(in dockerInstruction) bool {
		return in.cmd == "EXPOSE" && slices.Contains(strings.Fields(in.args), defaultPort)
	}) {
		t.Errorf("final stage does not EXPOSE %s (HTTP_ADDR's default port)", defaultPort)
	}
}

// goModVersion returns go.mod's go directive as major.minor.
func goModVersion(t *testing.T) string {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(repoRoot, "go.mod"))
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^go (\d+\.\d+)`).FindSubmatch(data)
	if m == nil {
		t.Fatal("go.mod has no go directive")
	}
	return string(m[1])
}

// dockerignore matches paths the way .dockerignore does: patterns relative
// to the context root, *, ? and [..] within a path element, ** across
// elements, a pattern excluding a directory excludes what it holds, a
// leading ! re-includes, and the last matching pattern wins.
type dockerignore []struct {
	re     *regexp.Regexp
	negate bool
}

func parseDockerignore(t *testing.T, data string) dockerignore {
	t.Helper()
	var d dockerignore
	for _, line := range strings.Split(data, "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		negate := strings.HasPrefix(line, "!")
		p := strings.TrimPrefix(filepath.ToSlash(filepath.Clean(strings.TrimPrefix(line, "!"))), "/")
		var re strings.Builder
		re.WriteString("^")
		for i := 0; i < len(p); i++ {
			switch c := p[i]; {
			case strings.HasPrefix(p[i:], "**/"):
				re.WriteString("(.*/)?")
				i += 2
			case strings.HasPrefix(p[i:], "**"):
				re.WriteString(".*")
				i++
			case c == '*':
				re.WriteString("[^/]*")
			case c == '?':
				re.WriteString("[^/]")
			case c == '[':
				j := strings.IndexByte(p[i:], ']')
				if j < 0 {
					t.Fatalf(".dockerignore: %q: unclosed [", line)
				}
				re.WriteString(p[i : i+j+1])
				i += j
			case c == '\\' && i+1 < len(p):
				i++
				re.WriteString(regexp.QuoteMeta(p[i : i+1]))
			default:
				re.WriteString(regexp.QuoteMeta(string(c)))
			}
		}
		re.WriteString("(/.*)?$")
		rx, err := regexp.Compile(re.String())
		if err != nil {
			t.Fatalf(".dockerignore: %q: %v", line, err)
		}
		d = append(d, struct {
			re     *regexp.Regexp
			negate bool
		}{rx, negate})
	}
	return d
}

func (d dockerignore) excludes(path string) bool {
	excluded := false
	for _, p := range d {
		if p.re.MatchString(path) {
			excluded = !p.negate
		}
	}
	return excluded
}

func TestComposeDockerignore(t *testing.T) {
	data, err := os.ReadFile(filepath.Join(repoRoot, ".dockerignore"))
	if err != nil {
		t.Fatal(err)
	}
	ignore := parseDockerignore(t, string(data))

	// The matcher itself, so that a broken one cannot pass everything.
	self := parseDockerignore(t, "bin\n**/testdata\n*.md\n!KEEP.md\n")
	for path, want := range map[string]bool{
		"bin/scheduler": true, "cmd/bin": false, "internal/defer/testdata/fuzz/x": true,
		"testdata/x": true, "README.md": true, "KEEP.md": false, "docs/a.md": false,
	} {
		if got := self.excludes(path); got != want {
			t.Errorf("matcher: excludes(%q) = %v, want %v", path, got, want)
		}
	}

	for _, path := range []string{".git/HEAD", "bin/scheduler"} {
		if !ignore.excludes(path) {
			t.Errorf(".dockerignore does not exclude %s", path)
		}
	}
	// What the build needs: go.mod, go.sum, the sources and the files they
	// embed (the SQL).
	needed := []string{"go.mod", "go.sum"}
	err = filepath.WalkDir(repoRoot, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(repoRoot, p)
		rel = filepath.ToSlash(rel)
		if d.IsDir() {
			if rel == ".git" || filepath.Base(rel) == "testdata" {
				return filepath.SkipDir
			}
			return nil
		}
		if (strings.HasSuffix(rel, ".go") && !strings.HasSuffix(rel, "_test.go")) || strings.HasSuffix(rel, ".sql") {
			needed = append(needed, rel)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, path := range needed {
		if ignore.excludes(path) {
			t.Errorf(".dockerignore excludes %s, which the build needs", path)
		}
	}
}
