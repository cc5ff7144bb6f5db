package config

import (
	"bytes"
	"cmp"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/deferq/scheduler/internal/policy"
)

// validEnv is a complete configuration for run, with nothing listening at
// its addresses: a case that ought to fail validation but does not makes run
// fail to connect (exit 1) rather than hang or pass.
var validEnv = []string{
	"DATABASE_URL=postgres://u:p@127.0.0.1:1/db?connect_timeout=2",
	"KAFKA_BROKERS=127.0.0.1:1",
}

// withEnv returns validEnv with extra appended (later wins, as in Load).
func withEnv(extra ...string) []string {
	return append(slices.Clone(validEnv), extra...)
}

func TestConfigDefaults(t *testing.T) {
	cfg, err := Load(nil)
	if err != nil {
		t.Fatalf("Load(nil): %v", err)
	}
	documented := map[string]string{}
	for _, v := range Vars() {
		documented[v.Name] = v.Default
	}
	tests := []struct {
		name string // variable
		def  string // its documented default
		got  any    // the loaded value
		want any
	}{
		{"DEFER_TOPIC", "scheduler.defer", cfg.DeferTopic, "scheduler.defer"},
		{"CONSUMER_GROUP", "defer-scheduler", cfg.ConsumerGroup, "defer-scheduler"},
		{"TARGET_TOPICS", "", cfg.TargetTopics, ""},
		{"HTTP_ADDR", ":8080", cfg.HTTPAddr, ":8080"},
		{"PPROF_ADDR", "", cfg.PprofAddr, ""},
		{"MAX_DELAY", "720h", cfg.MaxDelay, 720 * time.Hour},
		{"RETRY_POLICIES", "", cfg.RetryPolicies, ""},
		{"NON_RETRIABLE_ERRORS", "", cfg.NonRetriableErrors, ""},
		{"HISTORY_RETENTION", "720h", cfg.HistoryRetention, 720 * time.Hour},
		{"SIGNING_KEYS", "", cfg.SigningKeys, secret("")},
		{"SIGNING_KEYS_FILE", "", cfg.SigningKeysFile, ""},
		{"SIGNING_REQUIRED", "false", cfg.SigningRequired, false},
		{"INGEST_BATCH_SIZE", "1000", cfg.IngestBatchSize, 1000},
		{"INGEST_WRITERS", "2", cfg.IngestWriters, 2},
		{"INGEST_FUTURE_LINGER", "100ms", cfg.IngestFutureLinger, 100 * time.Millisecond},
		{"DISPATCH_LOOPS", "4", cfg.DispatchLoops, 4},
		{"LEASE_DURATION", "90s", cfg.LeaseDuration, 90 * time.Second},
		{"POLL_INTERVAL", "1s", cfg.PollInterval, time.Second},
		{"LISTEN_NOTIFY", "true", cfg.ListenNotify, true},
		{"KAFKA_TIMEOUT", "5s", cfg.KafkaTimeout, 5 * time.Second},
		{"KAFKA_MAX_MESSAGE_BYTES", "1048576", cfg.KafkaMaxMessageBytes, 1048576},
		{"KAFKA_TLS", "false", cfg.KafkaTLS, false},
		{"KAFKA_SASL_MECHANISM", "", cfg.KafkaSASLMechanism, ""},
		{"LOG_LEVEL", "info", cfg.LogLevel, "info"},
		{"LOG_FORMAT", "text", cfg.LogFormat, "text"},
		{"SHUTDOWN_TIMEOUT", "30s", cfg.ShutdownTimeout, 30 * time.Second},
		{"DATABASE_URL", "", cfg.DatabaseURL, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if !reflect.DeepEqual(tt.got, tt.want) {
				t.Errorf("loaded %v, want %v", tt.got, tt.want)
			}
			if d, ok := documented[tt.name]; !ok || d != tt.def {
				t.Errorf("Vars() default %q (listed: %v), want %q", d, ok, tt.def)
			}
		})
	}
	if cfg.KafkaBrokers != nil {
		t.Errorf("KAFKA_BROKERS default %q, want none", cfg.KafkaBrokers)
	}
	// TARGET_TOPICS empty allows no topic at all (docs/design.md section 2.4).
	for _, topic := range []string{"payments.retry", "scheduler.defer", ""} {
		if cfg.targets.Allows(topic) {
			t.Errorf("default TARGET_TOPICS allows %q", topic)
		}
	}

	// run needs the database and the brokers; nothing else does.
	err = cfg.RequireRun()
	if err == nil {
		t.Fatal("requireRun on the defaults: no error")
	}
	for _, name := range []string{"DATABASE_URL", "KAFKA_BROKERS"} {
		if !strings.Contains(err.Error(), name) {
			t.Errorf("requireRun error does not name %s:\n%v", name, err)
		}
	}
	full, err := Load(validEnv)
	if err != nil {
		t.Fatalf("Load(%q): %v", validEnv, err)
	}
	if err := full.RequireRun(); err != nil {
		t.Errorf("requireRun with %q: %v", validEnv, err)
	}
}

// TestEnvVarsDocumented checks that every field read from the environment is
// listed with a form and a help text, and that each documented default is
// itself a value the configuration accepts.
func TestEnvVarsDocumented(t *testing.T) {
	fields := 0
	ct := reflect.TypeFor[Config]()
	for i := range ct.NumField() {
		if ct.Field(i).Tag.Get("env") != "" {
			fields++
		}
	}
	vars := Vars()
	if len(vars) != fields || fields == 0 {
		t.Errorf("Vars() lists %d variables, config has %d env fields", len(vars), fields)
	}
	seen := map[string]bool{}
	for _, v := range vars {
		t.Run(v.Name, func(t *testing.T) {
			if seen[v.Name] {
				t.Errorf("%s listed twice", v.Name)
			}
			seen[v.Name] = true
			if !regexp.MustCompile(`^[A-Z][A-Z0-9_]*$`).MatchString(v.Name) {
				t.Errorf("name %q is not an upper-case variable name", v.Name)
			}
			if v.Form == "" || v.Help == "" {
				t.Errorf("form %q, help %q: both must be set (--help and errors print them)", v.Form, v.Help)
			}
			if v.Default != "" {
				if _, err := Load([]string{v.Name + "=" + v.Default}); err != nil {
					t.Errorf("%s=%s, its own default, is rejected: %v", v.Name, v.Default, err)
				}
			}
		})
	}
}

func TestConfigRejectsBadValues(t *testing.T) {
	tests := []struct {
		name string
		env  []string // on top of validEnv
		// vars: the error names at least one of these (the Kafka client
		// settings are checked together and reported as KAFKA_*).
		vars []string
		// want: the error contains all of these: the value, and what is
		// accepted.
		want []string
	}{
		{"duration unparsable", []string{"MAX_DELAY=abc"}, []string{"MAX_DELAY"},
			[]string{`MAX_DELAY="abc"`, "Go duration"}},
		{"duration negative", []string{"MAX_DELAY=-1s"}, []string{"MAX_DELAY"},
			[]string{`MAX_DELAY="-1s"`, "positive", "Go duration"}},
		{"integer below range", []string{"INGEST_BATCH_SIZE=0"}, []string{"INGEST_BATCH_SIZE"},
			[]string{`INGEST_BATCH_SIZE="0"`, "integer 1..100000"}},
		{"integer unparsable", []string{"INGEST_BATCH_SIZE=x"}, []string{"INGEST_BATCH_SIZE"},
			[]string{`INGEST_BATCH_SIZE="x"`, "integer 1..100000"}},
		{"writers above range", []string{"INGEST_WRITERS=65"}, []string{"INGEST_WRITERS"},
			[]string{`INGEST_WRITERS="65"`, "integer 1..64"}},
		{"integer above range", []string{"DB_MAX_CONNS=5000"}, []string{"DB_MAX_CONNS"},
			[]string{`DB_MAX_CONNS="5000"`, "integer 4..1000"}},
		{"dispatch loops zero", []string{"DISPATCH_LOOPS=0"}, []string{"DISPATCH_LOOPS"},
			[]string{`DISPATCH_LOOPS="0"`, "integer 1..256"}},
		{"claims at once zero", []string{"DISPATCH_CLAIMS=0"}, []string{"DISPATCH_CLAIMS"},
			[]string{`DISPATCH_CLAIMS="0"`, "integer 1..256"}},
		{"claims at once above range", []string{"DISPATCH_CLAIMS=257"}, []string{"DISPATCH_CLAIMS"},
			[]string{`DISPATCH_CLAIMS="257"`, "integer 1..256"}},
		{"express heads negative", []string{"DISPATCH_EXPRESS_HEADS=-1"}, []string{"DISPATCH_EXPRESS_HEADS"},
			[]string{`DISPATCH_EXPRESS_HEADS="-1"`, "integer 0..10000"}},
		{"express heads above range", []string{"DISPATCH_EXPRESS_HEADS=10001"}, []string{"DISPATCH_EXPRESS_HEADS"},
			[]string{`DISPATCH_EXPRESS_HEADS="10001"`, "integer 0..10000"}},
		{"poll interval too long", []string{"POLL_INTERVAL=10s"}, []string{"POLL_INTERVAL"},
			[]string{`POLL_INTERVAL="10s"`, "10ms..5s"}},
		{"poll interval too short", []string{"POLL_INTERVAL=1ms"}, []string{"POLL_INTERVAL"},
			[]string{`POLL_INTERVAL="1ms"`, "10ms..5s"}},
		{"target pattern malformed", []string{"TARGET_TOPICS=payments.*,orders.["}, []string{"TARGET_TOPICS"},
			[]string{`"orders.["`, "path.Match"}},
		{"defer topic name", []string{"DEFER_TOPIC=bad topic!"}, []string{"DEFER_TOPIC"},
			[]string{`DEFER_TOPIC="bad topic!"`, "[a-zA-Z0-9._-]"}},
		{"broker without port", []string{"KAFKA_BROKERS=kafka:9092,nohostport"}, []string{"KAFKA_BROKERS"},
			[]string{"nohostport", "host:port"}},
		{"http address without port", []string{"HTTP_ADDR=nocolon"}, []string{"HTTP_ADDR"},
			[]string{`HTTP_ADDR="nocolon"`, "host:port"}},
		{"pprof address without port", []string{"PPROF_ADDR=localhost"}, []string{"PPROF_ADDR"},
			[]string{`PPROF_ADDR="localhost"`, "host:port"}},
		{"console address without port", []string{"CONSOLE_ADDR=localhost"}, []string{"CONSOLE_ADDR"},
			[]string{`CONSOLE_ADDR="localhost"`, "host:port"}},
		{"console session key too short", []string{"CONSOLE_SESSION_KEY=abcd"}, []string{"CONSOLE_SESSION_KEY"},
			[]string{"value not shown", "at least 64 digits"}},
		{"console session lifetime", []string{"CONSOLE_SESSION_TTL=10s"}, []string{"CONSOLE_SESSION_TTL"},
			[]string{`CONSOLE_SESSION_TTL="10s"`, "1m..720h"}},
		{"console user role", []string{"CONSOLE_USERS=alice:root:pbkdf2-sha256$600000$c2FsdHNhbHQ$" + strings.Repeat("A", 43)}, []string{"CONSOLE_USERS"},
			[]string{"CONSOLE_USERS entry 1", `role "root"`, "viewer or operator"}},
		{"console user hash", []string{"CONSOLE_USERS=alice:viewer:secret"}, []string{"CONSOLE_USERS"},
			[]string{"CONSOLE_USERS entry 1", "user alice", "not shown", "hash-password"}},
		{"console users file missing", []string{"CONSOLE_USERS_FILE=/nonexistent/users"}, []string{"CONSOLE_USERS_FILE"},
			[]string{`CONSOLE_USERS_FILE="/nonexistent/users"`, "name:role:hash"}},
		{"log level", []string{"LOG_LEVEL=loud"}, []string{"LOG_LEVEL"},
			[]string{`LOG_LEVEL="loud"`, "debug, info, warn or error"}},
		{"log format", []string{"LOG_FORMAT=xml"}, []string{"LOG_FORMAT"},
			[]string{`LOG_FORMAT="xml"`, "text or json"}},
		{"boolean", []string{"LISTEN_NOTIFY=maybe"}, []string{"LISTEN_NOTIFY"},
			[]string{`LISTEN_NOTIFY="maybe"`, "true or false"}},
		{"future linger negative", []string{"INGEST_FUTURE_LINGER=-1s"}, []string{"INGEST_FUTURE_LINGER"},
			[]string{`INGEST_FUTURE_LINGER="-1s"`, "0..10s"}},
		{"future linger too long", []string{"INGEST_FUTURE_LINGER=11s"}, []string{"INGEST_FUTURE_LINGER"},
			[]string{`INGEST_FUTURE_LINGER="11s"`, "0..10s"}},
		{"kafka timeout too short", []string{"KAFKA_TIMEOUT=1ms"}, []string{"KAFKA_TIMEOUT"},
			[]string{`KAFKA_TIMEOUT="1ms"`, "100ms..1m"}},
		{"max message bytes too small", []string{"KAFKA_MAX_MESSAGE_BYTES=10"}, []string{"KAFKA_MAX_MESSAGE_BYTES"},
			[]string{`KAFKA_MAX_MESSAGE_BYTES="10"`, "1024..104857600"}},
		{"max message bytes not a number", []string{"KAFKA_MAX_MESSAGE_BYTES=1MB"}, []string{"KAFKA_MAX_MESSAGE_BYTES"},
			[]string{`KAFKA_MAX_MESSAGE_BYTES="1MB"`}},
		{"lease shorter than a publish", []string{"LEASE_DURATION=1s"}, []string{"LEASE_DURATION"},
			[]string{`LEASE_DURATION="1s"`, "longer than", "KAFKA_TIMEOUT"}},
		// The default lease (90s) outlasts a publish at the default
		// KAFKA_TIMEOUT (5s: 75.5s), not at 10s (150.5s).
		{"lease too short for the kafka timeout", []string{"KAFKA_TIMEOUT=10s"}, []string{"LEASE_DURATION"},
			[]string{`LEASE_DURATION="1m30s"`, "longer than", "KAFKA_TIMEOUT=10s"}},
		{"dispatch loop duration", []string{"DISPATCH_LOOP_DURATION=500ms"}, []string{"DISPATCH_LOOP_DURATION"},
			[]string{`DISPATCH_LOOP_DURATION="500ms"`, ">= 1s"}},
		{"empty consumer group", []string{"CONSUMER_GROUP= "}, []string{"CONSUMER_GROUP"},
			[]string{"non-empty"}},
		// The Kafka client settings are checked together by kafkaclient,
		// whose errors are reported as "KAFKA_* settings: ..." and name
		// neither the precise variable nor, for KAFKA_VERSION and the TLS
		// files, the accepted form. The precise name is accepted too.
		{"sasl mechanism", []string{"KAFKA_SASL_MECHANISM=GSSAPI"}, []string{"KAFKA_SASL_MECHANISM", "KAFKA_*"},
			[]string{"GSSAPI", "PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"}},
		{"sasl without user", []string{"KAFKA_SASL_MECHANISM=PLAIN"}, []string{"KAFKA_SASL_USER", "KAFKA_*"},
			[]string{"PLAIN", "user"}},
		{"kafka version", []string{"KAFKA_VERSION=banana"}, []string{"KAFKA_VERSION", "KAFKA_*"},
			[]string{"banana"}},
		{"tls ca file missing", []string{"KAFKA_TLS=true", "KAFKA_TLS_CA_FILE=/nonexistent"}, []string{"KAFKA_TLS_CA_FILE", "KAFKA_*"},
			[]string{"/nonexistent"}},
		{"tls cert without key", []string{"KAFKA_TLS=true", "KAFKA_TLS_CERT_FILE=/nonexistent.pem"}, []string{"KAFKA_TLS_KEY_FILE", "KAFKA_*"},
			[]string{"/nonexistent.pem", "together"}},
		// Policy errors carry the position in the value, 1-based.
		{"retry policy syntax", []string{"RETRY_POLICIES=orders.*: ladder 30s,5q"}, []string{"RETRY_POLICIES"},
			[]string{`RETRY_POLICIES="orders.*: ladder 30s,5q"`, "position 22:", `"5q"`, "pattern: policy entries"}},
		{"retry policy unknown keyword", []string{"RETRY_POLICIES=*: linear 1s max 3"}, []string{"RETRY_POLICIES"},
			[]string{`RETRY_POLICIES="*: linear 1s max 3"`, "position 4:", "linear"}},
		{"retry policy step beyond MAX_DELAY", []string{"MAX_DELAY=1h", "RETRY_POLICIES=*: ladder 2h"}, []string{"RETRY_POLICIES"},
			[]string{`RETRY_POLICIES="*: ladder 2h"`, "position 11:", "maximum delay", "at most MAX_DELAY"}},
		{"dead-letter copies back to the target", []string{"RETRY_POLICIES=orders.*: ladder 1s dlq {target}"}, []string{"RETRY_POLICIES"},
			[]string{`RETRY_POLICIES="orders.*: ladder 1s dlq {target}"`, "orders.*: dlq {target} sends each dead-letter copy back"}},
		{"dead-letter copies into the defer topic", []string{"DEFER_TOPIC=defer.in", "RETRY_POLICIES=*: ladder 1s; x.*: ladder 2s dlq defer.in"}, []string{"RETRY_POLICIES"},
			[]string{"x.*: dlq defer.in is DEFER_TOPIC"}},
		{"retry policies over several lines", []string{"RETRY_POLICIES=a.*: ladder 1s;\nb.*: exponential 1s"}, []string{"RETRY_POLICIES"},
			[]string{`RETRY_POLICIES="a.*: ladder 1s;\nb.*: exponential 1s"`, "position"}},
		{"non-retriable errors: empty item", []string{"NON_RETRIABLE_ERRORS=*Json*,,Fatal*"}, []string{"NON_RETRIABLE_ERRORS"},
			[]string{`NON_RETRIABLE_ERRORS="*Json*,,Fatal*"`, "position 8:", "comma-separated globs"}},
		{"history retention negative", []string{"HISTORY_RETENTION=-1h"}, []string{"HISTORY_RETENTION"},
			[]string{`HISTORY_RETENTION="-1h"`, "must not be negative", "Go duration >= 0"}},
		{"history retention unparsable", []string{"HISTORY_RETENTION=a month"}, []string{"HISTORY_RETENTION"},
			[]string{`HISTORY_RETENTION="a month"`, "Go duration >= 0"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			env := withEnv(tt.env...)
			check := func(where, msg string) {
				t.Helper()
				if !slices.ContainsFunc(tt.vars, func(v string) bool { return strings.Contains(msg, v) }) {
					t.Errorf("%s does not name %s:\n%s", where, strings.Join(tt.vars, " or "), msg)
				}
				for _, w := range tt.want {
					if !strings.Contains(msg, w) {
						t.Errorf("%s lacks %q:\n%s", where, w, msg)
					}
				}
			}

			_, err := Load(env)
			if err == nil {
				t.Fatalf("Load(%q): no error", env)
			}
			check("Load error", err.Error())
		})
	}
	// The cases above fail for their own variable only.
	if _, err := Load(validEnv); err != nil {
		t.Fatalf("Load(%q): %v", validEnv, err)
	}
}

// TestConfigReportsEveryProblem checks that one attempt reports every bad
// variable, each once, whether its value does not parse or parses but is
// out of range.
func TestConfigReportsEveryProblem(t *testing.T) {
	tests := []struct {
		name string
		env  []string
		bad  []string // variables that must each be reported once
	}{
		{"unparsable values", []string{"MAX_DELAY=abc", "INGEST_BATCH_SIZE=x", "LISTEN_NOTIFY=maybe"},
			[]string{"MAX_DELAY", "INGEST_BATCH_SIZE", "LISTEN_NOTIFY"}},
		{"values out of range", []string{"LOG_LEVEL=loud", "LOG_FORMAT=xml", "POLL_INTERVAL=10s", "DISPATCH_LOOPS=0", "HTTP_ADDR=nocolon"},
			[]string{"LOG_LEVEL", "LOG_FORMAT", "POLL_INTERVAL", "DISPATCH_LOOPS", "HTTP_ADDR"}},
		{"both kinds", []string{"MAX_DELAY=abc", "DISPATCH_WORKERS=many", "LOG_LEVEL=loud", "DEFER_TOPIC=a b"},
			[]string{"MAX_DELAY", "DISPATCH_WORKERS", "LOG_LEVEL", "DEFER_TOPIC"}},
		{"retry rules", []string{"RETRY_POLICIES=*: ladder", "NON_RETRIABLE_ERRORS=,", "HISTORY_RETENTION=-1s", "LOG_LEVEL=loud"},
			[]string{"RETRY_POLICIES", "NON_RETRIABLE_ERRORS", "HISTORY_RETENTION", "LOG_LEVEL"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := Load(withEnv(tt.env...))
			if err == nil {
				t.Fatal("no error")
			}
			lines := strings.Split(err.Error(), "\n")
			for _, name := range tt.bad {
				n := 0
				for _, l := range lines {
					if strings.HasPrefix(l, name+"=") {
						n++
					}
				}
				if n != 1 {
					t.Errorf("%s reported %d times, want once:\n%v", name, n, err)
				}
			}
		})
	}
}

// TestConfigRetryRules checks that valid retry rules are parsed for the
// service, against MAX_DELAY.
func TestConfigRetryRules(t *testing.T) {
	cfg, err := Load(withEnv(
		"MAX_DELAY=2h",
		"RETRY_POLICIES=payments.*: ladder 30s,5m,30m dlq {target}.dlq;\n  orders.*: exponential 1s x3 cap 1h forever release",
		"NON_RETRIABLE_ERRORS= *JsonParseException , com.acme.Validation* ",
		"HISTORY_RETENTION=0"))
	if err != nil {
		t.Fatalf("Load: %v", err)
	}
	tests := []struct {
		target     string
		text       string
		maxRetries int32
		forever    bool
		release    bool
		dlq        string
	}{
		{"payments.card", "ladder 30s,5m,30m dlq {target}.dlq", 3, false, false, "payments.card.dlq"},
		{"orders.created", "exponential 1s x3 cap 1h forever release", 0, true, true, ""},
		{"audit", policy.DefaultPolicy, 10, false, false, ""},
	}
	for _, tt := range tests {
		p := cfg.policies.For(tt.target)
		if p.Text != tt.text || p.MaxRetries != tt.maxRetries || p.Forever != tt.forever || p.ReleaseKey != tt.release ||
			p.DLQTopic(tt.target) != tt.dlq || p.MaxDelay != 2*time.Hour {
			t.Errorf("policy of %s: %q max %d forever %v release %v dlq %q capped at %v; want %q, %d, %v, %v, %q, 2h",
				tt.target, p.Text, p.MaxRetries, p.Forever, p.ReleaseKey, p.DLQTopic(tt.target), p.MaxDelay,
				tt.text, tt.maxRetries, tt.forever, tt.release, tt.dlq)
		}
	}
	for class, want := range map[string]string{
		"com.fasterxml.jackson.core.JsonParseException": "non_retriable",
		"com.acme.ValidationError":                      "non_retriable",
		"permanent":                                     "permanent",
		"java.net.SocketTimeoutException":               "",
	} {
		if code, _ := cfg.classifier.Classify(class); code != want {
			t.Errorf("Classify(%q) = %q, want %q", class, code, want)
		}
	}
	if cfg.HistoryRetention != 0 {
		t.Errorf("HISTORY_RETENTION=0 gave %v, want 0 (keep forever)", cfg.HistoryRetention)
	}

	// Without MAX_DELAY the policies cannot be checked: only MAX_DELAY is
	// reported, not a policy that would fit any sensible maximum.
	_, err = Load(withEnv("MAX_DELAY=abc", "RETRY_POLICIES=*: ladder 1s"))
	if err == nil || !strings.Contains(err.Error(), "MAX_DELAY=") || strings.Contains(err.Error(), "RETRY_POLICIES") {
		t.Errorf("bad MAX_DELAY with good policies: %v; want MAX_DELAY reported alone", err)
	}
}

// TestConfigSigning checks SIGNING_KEYS, SIGNING_KEYS_FILE and
// SIGNING_REQUIRED: keys from either or both, and errors that name the
// variable, the entry and the source but never show a key, in Load's
// error, in run's output, in --help, and when the configuration is printed.
func TestConfigSigning(t *testing.T) {
	hexA := strings.Repeat("a1", 32)
	hexB := strings.Repeat("B2", 40)
	hexC := strings.Repeat("c3", 32)
	short := strings.Repeat("d4", 20)
	// secrets are every key text used below; no output may contain one,
	// nor the start of one.
	secrets := []string{hexA, hexB, hexC, short, "a1a1a1a1", "B2B2B2B2", "c3c3c3c3", "d4d4d4d4"}
	dir := t.TempDir()
	file := func(name, content string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	good := file("good", "# keys\nbilling="+hexB+"\n\n  shipping = "+hexC+"\n")
	overlap := file("overlap", "orders="+hexC+"\n")
	bad := file("bad", "billing="+short+"\n# x\norders\n")

	tests := []struct {
		name     string
		env      []string
		sources  []string // on success
		required bool
		errs     []string // on failure: each must be in the error
	}{
		{name: "none", sources: nil},
		{name: "env", env: []string{"SIGNING_KEYS=orders=" + hexA + ", payments.v2=" + hexC}, sources: []string{"orders", "payments.v2"}},
		{name: "file", env: []string{"SIGNING_KEYS_FILE=" + good}, sources: []string{"billing", "shipping"}},
		{name: "both", env: []string{"SIGNING_KEYS=orders=" + hexA, "SIGNING_KEYS_FILE=" + good, "SIGNING_REQUIRED=true"},
			sources: []string{"billing", "orders", "shipping"}, required: true},
		{name: "a source in both", env: []string{"SIGNING_KEYS=billing=" + hexA, "SIGNING_KEYS_FILE=" + good},
			errs: []string{"SIGNING_KEYS and SIGNING_KEYS_FILE", `source "billing" is given in both`}},
		{name: "bad hex", env: []string{"SIGNING_KEYS=orders=" + hexA + ",billing=" + strings.Repeat("zz", 32)},
			errs: []string{"SIGNING_KEYS", "entry 2", `source "billing"`, "not hex"}},
		{name: "short key", env: []string{"SIGNING_KEYS=orders=" + short},
			errs: []string{"SIGNING_KEYS", "entry 1", `source "orders"`, "20 bytes, want at least 32"}},
		{name: "duplicate source", env: []string{"SIGNING_KEYS=orders=" + hexA + ",orders=" + hexC},
			errs: []string{"SIGNING_KEYS", "entry 2", `source "orders" is given again`}},
		{name: "bad file, every problem", env: []string{"SIGNING_KEYS_FILE=" + bad},
			errs: []string{`SIGNING_KEYS_FILE="` + bad + `": line 1: source "billing": key is 20 bytes`, `SIGNING_KEYS_FILE="` + bad + `": line 3 has no '='`}},
		{name: "file and env problems together", env: []string{"SIGNING_KEYS=" + hexA, "SIGNING_KEYS_FILE=" + overlap, "LOG_LEVEL=loud"},
			errs: []string{"SIGNING_KEYS (value not shown): entry 1 has no '='", "LOG_LEVEL"}},
		{name: "file missing", env: []string{"SIGNING_KEYS_FILE=" + filepath.Join(dir, "nope")},
			errs: []string{`SIGNING_KEYS_FILE="` + filepath.Join(dir, "nope") + `"`, "no such file", "source=KEY lines"}},
		{name: "required without keys", env: []string{"SIGNING_REQUIRED=true"},
			errs: []string{"SIGNING_REQUIRED=true", "every record would be rejected"}},
		{name: "required unparsable", env: []string{"SIGNING_REQUIRED=yes please"},
			errs: []string{`SIGNING_REQUIRED="yes please"`, "true or false"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			noSecret := func(where, text string) {
				t.Helper()
				for _, s := range secrets {
					if strings.Contains(text, s) || strings.Contains(strings.ToLower(text), strings.ToLower(s)) {
						t.Errorf("%s shows key material %q:\n%s", where, s, text)
					}
				}
			}
			env := withEnv(tt.env...)
			cfg, err := Load(env)
			// However the configuration is printed, no key shows.
			noSecret("the printed configuration", fmt.Sprintf("%v %+v %#v", cfg, cfg, cfg))
			if tt.errs == nil {
				if err != nil {
					t.Fatalf("Load: %v", err)
				}
				if got := cfg.signing.Sources(); !slices.Equal(got, tt.sources) || cfg.signing.Required() != tt.required {
					t.Errorf("sources %q required %v, want %q %v", got, cfg.signing.Required(), tt.sources, tt.required)
				}
				var buf bytes.Buffer
				cfg.LogPolicies(slog.New(slog.NewTextHandler(&buf, nil)))
				noSecret("the start-up log", buf.String())
				if len(tt.sources) > 0 && !strings.Contains(buf.String(), `msg="record signing" sources=`+strings.Join(tt.sources, ",")) {
					t.Errorf("the start-up log does not list the sources:\n%s", buf.String())
				}
				return
			}
			if err == nil {
				t.Fatal("Load: no error")
			}
			for _, w := range tt.errs {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error lacks %q:\n%v", w, err)
				}
			}
			noSecret("Load's error", err.Error())
		})
	}
}

// The start-up log lists the policies one entry per line, in the order they
// are tried, and the error classes parked without retry.
func TestLogPolicies(t *testing.T) {
	cfg, err := Load(withEnv("RETRY_POLICIES=payments.*: ladder 1s dlq {target}.dlq; *: exponential 1s max 3",
		"NON_RETRIABLE_ERRORS=*Json*"))
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	cfg.LogPolicies(slog.New(slog.NewTextHandler(&buf, nil)))
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	want := []string{
		`msg="retry policy" targets=payments.* policy="ladder 1s dlq {target}.dlq"`,
		`msg="retry policy" targets=* policy="exponential 1s x2 max 3"`,
		`msg="error classes parked without retry" patterns=permanent,*Json*`,
		`msg="attempt history" retention=720h0m0s`,
	}
	if len(lines) != len(want) {
		t.Fatalf("%d lines, want %d:\n%s", len(lines), len(want), buf.String())
	}
	for i, w := range want {
		if !strings.Contains(lines[i], w) {
			t.Errorf("line %d: %s\nwant it to contain %s", i+1, lines[i], w)
		}
	}
}

// TestConfigREADMETable checks that README.md documents every variable with
// its default, in a markdown table row such as
//
//	| `MAX_DELAY` | `720h` | longest delay ... |
//
// A variable without a default shows an empty cell or a dash.
func TestConfigREADMETable(t *testing.T) {
	data, err := os.ReadFile(filepath.Join(repoRoot, "README.md"))
	if err != nil {
		t.Fatalf("README.md must document the configuration: %v", err)
	}
	rows := readmeTables(string(data))
	vars := Vars()
	known := map[string]bool{}
	for _, v := range vars {
		known[v.Name] = true
	}
	for _, v := range vars {
		var seen []string
		ok := false
		for _, table := range rows {
			for _, r := range table {
				if len(r) < 2 || !strings.Contains(r[0], "`"+v.Name+"`") {
					continue
				}
				seen = append(seen, r[1])
				ok = ok || sameDefault(r[1], v.Default)
			}
		}
		switch {
		case len(seen) == 0:
			t.Errorf("README.md has no table row for %s (want | `%s` | `%s` | ...)", v.Name, v.Name, v.Default)
		case !ok:
			t.Errorf("README.md gives %s the default %q, want %q", v.Name, seen, cmp.Or(v.Default, "-"))
		}
	}
	// A table that documents variables documents only real ones.
	name := regexp.MustCompile("^`([A-Z][A-Z0-9_]+)`")
	for _, table := range rows {
		var listed []string
		documents := false
		for _, r := range table {
			if m := name.FindStringSubmatch(r[0]); m != nil {
				listed = append(listed, m[1])
				documents = documents || known[m[1]]
			}
		}
		if !documents {
			continue
		}
		for _, n := range listed {
			if !known[n] {
				t.Errorf("README.md documents %s, which the scheduler does not read", n)
			}
		}
	}
}

// sameDefault reports whether a README cell shows def.
func sameDefault(cell, def string) bool {
	cell = strings.TrimSpace(strings.ReplaceAll(cell, "`", ""))
	if def == "" {
		switch cell {
		case "", "-", "—", "–", "(none)", "none":
			return true
		}
		return false
	}
	return cell == def
}

// readmeTables returns the markdown tables of a document: each a list of
// rows, each a list of trimmed cells. Separator rows (|---|---|) are left
// out. A | inside `code` or escaped as \| does not split cells.
func readmeTables(doc string) [][][]string {
	var tables [][][]string
	var cur [][]string
	sep := regexp.MustCompile(`^:?-+:?$`)
	for _, line := range strings.Split(doc, "\n") {
		line = strings.TrimSpace(line)
		if !strings.HasPrefix(line, "|") {
			if cur != nil {
				tables = append(tables, cur)
				cur = nil
			}
			continue
		}
		cells := splitRow(line)
		if slices.ContainsFunc(cells, func(c string) bool { return !sep.MatchString(c) }) {
			cur = append(cur, cells)
		}
	}
	if cur != nil {
		tables = append(tables, cur)
	}
	return tables
}

func splitRow(line string) []string {
	line = strings.TrimPrefix(line, "|")
	var cells []string
	var cell strings.Builder
	code := false
	for i := 0; i < len(line); i++ {
		switch c := line[i]; {
		case c == '\\' && i+1 < len(line) && line[i+1] == '|':
			cell.WriteByte('|')
			i++
		case c == '`':
			code = !code
			cell.WriteByte(c)
		case c == '|' && !code:
			cells = append(cells, strings.TrimSpace(cell.String()))
			cell.Reset()
		default:
			cell.WriteByte(c)
		}
	}
	if rest := strings.TrimSpace(cell.String()); rest != "" {
		cells = append(cells, rest)
	}
	return cells
}

func TestConfigREADMEParser(t *testing.T) {
	doc := "text | not a table\n\n" +
		"| Variable | Default | Meaning |\n" +
		"|:--|--:|---|\n" +
		"| `A_B` | `x` | uses `a|b` and \\| here |\n" +
		"|`C`|—|\n" +
		"\n| `D` | |\n"
	want := [][][]string{
		{{"Variable", "Default", "Meaning"}, {"`A_B`", "`x`", "uses `a|b` and | here"}, {"`C`", "—"}},
		{{"`D`", ""}},
	}
	if got := readmeTables(doc); !reflect.DeepEqual(got, want) {
		t.Errorf("readmeTables:\n got %q\nwant %q", got, want)
	}
	tests := []struct {
		cell, def string
		want      bool
	}{
		{"`720h`", "720h", true},
		{" 720h ", "720h", true},
		{"`168h`", "720h", false},
		{"", "720h", false},
		{"—", "", true},
		{"–", "", true},
		{"-", "", true},
		{"", "", true},
		{"`x`", "", false},
	}
	for _, tt := range tests {
		if got := sameDefault(tt.cell, tt.def); got != tt.want {
			t.Errorf("sameDefault(%q, %q) = %v, want %v", tt.cell, tt.def, got, tt.want)
		}
	}
}

// repoRoot is the repository's root, relative to this package.
const repoRoot = "../.."
