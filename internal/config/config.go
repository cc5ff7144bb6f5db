// Package config reads and checks the service's configuration: environment
// variables, each with its default, the form a valid value takes and a help
// line, as `scheduler run --help` prints them and the README's table lists
// them (a test keeps the two equal). Every error names the variable and the
// accepted form, and every problem is reported at once.
package config

import (
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/IBM/sarama"
	"github.com/caarlos0/env/v11"

	"github.com/deferq/scheduler/internal/batchproducer"
	"github.com/deferq/scheduler/internal/console/access"
	"github.com/deferq/scheduler/internal/defer/protocol"
	"github.com/deferq/scheduler/internal/kafkaclient"
	"github.com/deferq/scheduler/internal/policy"
)

// Config is the service's configuration, read from the environment. The
// `form` tag says what a valid value looks like: it is printed by --help and
// in every error about the variable. The README's table lists the same
// variables with the same defaults (a test checks that).
type Config struct {
	DatabaseURL       string        `env:"DATABASE_URL" form:"PostgreSQL URL, e.g. postgres://user:pass@host:5432/db" help:"the service's database (required for run and migrate); session settings go in its query string, e.g. ?options=-c%20jit%3Doff"`
	DirectDatabaseURL secret        `env:"DIRECT_DATABASE_URL" form:"PostgreSQL URL, or empty" help:"a connection that reaches PostgreSQL without a pooler in transaction mode, for what needs a session of its own: migrate's lock and LISTEN; empty: DATABASE_URL; never printed"`
	KafkaBrokers      []string      `env:"KAFKA_BROKERS" envSeparator:"," form:"comma-separated host:port list" help:"Kafka bootstrap brokers (required for run)"`
	DeferTopic        string        `env:"DEFER_TOPIC" envDefault:"scheduler.defer" form:"Kafka topic name" help:"topic deferred records are read from"`
	ConsumerGroup     string        `env:"CONSUMER_GROUP" envDefault:"defer-scheduler" form:"consumer group id" help:"consumer group of ingest"`
	TargetTopics      string        `env:"TARGET_TOPICS" form:"comma-separated path.Match globs, e.g. orders.*,payments.retry" help:"topics messages may be republished to; empty allows none"`
	HTTPAddr          string        `env:"HTTP_ADDR" envDefault:":8080" form:"host:port" help:"address of /healthz, /readyz, /metrics and the client library's key gate (POST /v1/key-state, /v1/key-set, /v1/key-changes)"`
	PprofAddr         string        `env:"PPROF_ADDR" form:"host:port, or empty" help:"serve net/http/pprof's /debug/pprof/ here, for profiling (bind it to localhost); empty: off"`
	MaxDelay          time.Duration `env:"MAX_DELAY" envDefault:"720h" form:"Go duration, e.g. 168h" help:"longest delay a record may ask for; longer is rejected"`

	RetryPolicies      string        `env:"RETRY_POLICIES" form:"pattern: policy entries separated by ';', durations at most MAX_DELAY, e.g. payments.*: ladder 30s,5m,30m dlq {target}.dlq; *: exponential 1s x2 cap 1h max 10 (see docs/policies.md)" help:"retry policy per target topic: the delay of records without defer.at or defer.delay, how many retries, whether a parked message holds its key, dead-letter topic; unmatched targets get exponential 30s x2 cap 1h jitter 20% max 10"`
	NonRetriableErrors string        `env:"NON_RETRIABLE_ERRORS" form:"comma-separated globs over defer.error.class (* any run, ? one character), e.g. *JsonParseException,com.acme.Validation*" help:"error classes parked at ingest without a retry, besides permanent"`
	HistoryRetention   time.Duration `env:"HISTORY_RETENTION" envDefault:"720h" form:"Go duration >= 0, e.g. 720h; 0 keeps history forever" help:"how long the attempt history (deferred_attempt) is kept"`

	SigningKeys     secret `env:"SIGNING_KEYS" form:"comma-separated source=KEY entries, source 1-128 of [A-Za-z0-9._-], KEY in hex, at least 64 digits (32 bytes), e.g. billing=<64 hex digits>" help:"HMAC-SHA256 keys of the sources (defer.source) whose records must be signed (docs/signing.md); never printed"`
	SigningKeysFile string `env:"SIGNING_KEYS_FILE" form:"path to a readable file of source=KEY lines (KEY in hex, at least 64 digits; # comments, blank lines)" help:"file of signing keys, one source=KEY per line, besides SIGNING_KEYS (a source may be in one of them only)"`
	SigningRequired bool   `env:"SIGNING_REQUIRED" envDefault:"false" form:"true or false" help:"also reject records without defer.source or from a source with no signing key"`

	IngestBatchSize    int           `env:"INGEST_BATCH_SIZE" envDefault:"1000" form:"integer 1..100000" help:"records per batch of one partition, and per insert statement"`
	IngestBatchBytes   int           `env:"INGEST_BATCH_BYTES" envDefault:"4194304" form:"integer 1024..268435456" help:"bytes of records per batch of one partition, and per insert statement; a larger record is written alone"`
	IngestWriters      int           `env:"INGEST_WRITERS" envDefault:"2" form:"integer 1..64" help:"writes (a COPY or an insert statement) ingest runs at once; batches of other partitions that are ready meanwhile go together in the next one"`
	IngestBufferBytes  int           `env:"INGEST_BUFFER_BYTES" envDefault:"33554432" form:"integer 1048576..4294967296" help:"bytes of records ingest holds at once, read from Kafka and not yet stored, over every partition it consumes (fetched, queued and batched); a larger record is still read, alone"`
	IngestBatchLinger  time.Duration `env:"INGEST_BATCH_LINGER" envDefault:"20ms" form:"Go duration, e.g. 20ms" help:"longest a record waits for its batch to fill; it goes at once when nothing else is being written"`
	IngestFutureLinger time.Duration `env:"INGEST_FUTURE_LINGER" envDefault:"100ms" form:"Go duration 0..10s" help:"longest a batch waits to fill while each of its records falls due at least this plus 1s after it was read (such records lose nothing by waiting: their delays count from when they were read); 0 writes them as any other"`

	DispatchLoops         int           `env:"DISPATCH_LOOPS" envDefault:"4" form:"integer 1..256" help:"dispatch loops shared by all replicas on the database"`
	DispatchWorkers       int           `env:"DISPATCH_WORKERS" envDefault:"4" form:"integer 1..256" help:"dispatch loops this replica runs at most"`
	DispatchClaims        int           `env:"DISPATCH_CLAIMS" envDefault:"1" form:"integer 1..256" help:"claim statements this replica's dispatch loops run at once; the others wait their turn (loops claiming at once slow each other's claims, which due messages wait for)"`
	DispatchExpressHeads  int           `env:"DISPATCH_EXPRESS_HEADS" envDefault:"32" form:"integer 0..10000" help:"while another target has a backlog, a target with at most this many due heads is claimed at once, outside the claim turns, when a notification says a head became due and every dispatch loop is busy; 0 turns express claims off"`
	DispatchBatchKeys     int           `env:"DISPATCH_BATCH_KEYS" envDefault:"500" form:"integer 1..100000" help:"keys claimed per round"`
	DispatchKeyBatch      int           `env:"DISPATCH_KEY_BATCH" envDefault:"100" form:"integer 1..10000" help:"consecutive due messages of one key published per round"`
	DispatchRoundMessages int           `env:"DISPATCH_ROUND_MESSAGES" envDefault:"5000" form:"integer 1..1000000" help:"most messages one dispatch round claims and holds in memory (rate-limited targets' claims come on top); a round takes many keys with short runs or few keys with whole runs within it"`
	DispatchRoundBytes    int           `env:"DISPATCH_ROUND_BYTES" envDefault:"8388608" form:"integer 1024..1073741824" help:"most bytes of messages (key, value and headers) one dispatch round claims and holds in memory; a round always takes at least one message, however large"`
	DispatchLoopDuration  time.Duration `env:"DISPATCH_LOOP_DURATION" envDefault:"30s" form:"Go duration >= 1s" help:"how long one River loop job runs before its successor takes over"`
	LeaseDuration         time.Duration `env:"LEASE_DURATION" envDefault:"90s" form:"Go duration longer than 17 x KAFKA_TIMEOUT + 0.3s (the longest publish)" help:"how long a claim holds its keys; after a crash, its keys wait this long"`
	PollInterval          time.Duration `env:"POLL_INTERVAL" envDefault:"1s" form:"Go duration, 10ms..5s" help:"longest a dispatch loop sleeps without a due head or a notification"`
	ListenNotify          bool          `env:"LISTEN_NOTIFY" envDefault:"true" form:"true or false" help:"wake on Postgres notifications, listening on DIRECT_DATABASE_URL (else DATABASE_URL, which must then not lead through a pooler in transaction mode); false: poll only"`
	DBMaxConns            int32         `env:"DB_MAX_CONNS" envDefault:"20" form:"integer 4..1000" help:"Postgres connection pool size"`

	KafkaVersion            string        `env:"KAFKA_VERSION" envDefault:"3.6.0" form:"Kafka version, e.g. 3.6.0" help:"protocol version to speak to the brokers"`
	KafkaClientID           string        `env:"KAFKA_CLIENT_ID" envDefault:"defer-scheduler" form:"string" help:"client.id sent to the brokers"`
	KafkaTimeout            time.Duration `env:"KAFKA_TIMEOUT" envDefault:"5s" form:"Go duration, 100ms..1m" help:"bound on each Kafka network step (dial, write, read); publish retries derive from it"`
	KafkaMaxMessageBytes    int           `env:"KAFKA_MAX_MESSAGE_BYTES" envDefault:"1048576" form:"integer, 1024..104857600" help:"largest record the scheduler republishes (and copies to a dead-letter topic); larger ones are parked with reason too_large. The brokers' and topics' max.message.bytes must allow it too"`
	KafkaTLS                bool          `env:"KAFKA_TLS" envDefault:"false" form:"true or false" help:"connect to the brokers with TLS"`
	KafkaTLSCAFile          string        `env:"KAFKA_TLS_CA_FILE" form:"path to a PEM file" help:"CA bundle for the brokers' certificates (default: system roots)"`
	KafkaTLSCertFile        string        `env:"KAFKA_TLS_CERT_FILE" form:"path to a PEM file" help:"client certificate for mutual TLS"`
	KafkaTLSKeyFile         string        `env:"KAFKA_TLS_KEY_FILE" form:"path to a PEM file" help:"client key for mutual TLS"`
	KafkaTLSInsecureSkipVer bool          `env:"KAFKA_TLS_INSECURE_SKIP_VERIFY" envDefault:"false" form:"true or false" help:"do not verify the brokers' certificates (testing only)"`
	KafkaSASLMechanism      string        `env:"KAFKA_SASL_MECHANISM" form:"empty, PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512" help:"SASL mechanism (empty: no SASL)"`
	KafkaSASLUser           string        `env:"KAFKA_SASL_USER" form:"string" help:"SASL user"`
	KafkaSASLPassword       secret        `env:"KAFKA_SASL_PASSWORD" form:"string" help:"SASL password"`

	LogLevel        string        `env:"LOG_LEVEL" envDefault:"info" form:"debug, info, warn or error" help:"log level"`
	LogFormat       string        `env:"LOG_FORMAT" envDefault:"text" form:"text or json" help:"log format"`
	ShutdownTimeout time.Duration `env:"SHUTDOWN_TIMEOUT" envDefault:"30s" form:"Go duration" help:"longest a graceful stop waits for in-flight work"`
	MetricsInterval time.Duration `env:"METRICS_INTERVAL" envDefault:"15s" form:"Go duration, 100ms..1h" help:"how often the backlog gauges (scheduler_messages, scheduler_oldest_due_seconds, ...) and scheduler_ready are refreshed; each refresh counts deferred_message, and a count that takes more than a 20th of the interval stretches the gauges' interval to 20 times the count"`

	// The operator console (internal/console, docs/console.md).
	ConsoleAddr           string        `env:"CONSOLE_ADDR" form:"host:port, or empty" help:"serve the operator console (docs/console.md) here, apart from HTTP_ADDR so that it can be exposed to people while /metrics stays internal; empty: off"`
	ConsoleDatabaseURL    secret        `env:"CONSOLE_DATABASE_URL" form:"PostgreSQL URL, or empty" help:"the console's database connection, meant to log in as the operator role of sql/roles; empty: DATABASE_URL; never printed"`
	ConsoleUsers          secret        `env:"CONSOLE_USERS" form:"comma-separated name:role:hash entries, role viewer or operator, hash as printed by scheduler console hash-password" help:"who may log in to the console; with no user at all it serves only a page saying how to configure access; never printed"`
	ConsoleUsersFile      string        `env:"CONSOLE_USERS_FILE" form:"path to a readable file of name:role:hash lines (# comments, blank lines)" help:"file of console users, one name:role:hash per line, besides CONSOLE_USERS"`
	ConsoleSessionKey     secret        `env:"CONSOLE_SESSION_KEY" form:"hex, at least 64 digits (32 bytes), or empty" help:"key that signs console session cookies, the same on every replica; empty: a random key per process (sessions end at restart and are not shared between replicas); never printed"`
	ConsoleSessionTTL     time.Duration `env:"CONSOLE_SESSION_TTL" envDefault:"12h" form:"Go duration, 1m..720h" help:"how long a console login lasts"`
	ConsoleCookieSecure   bool          `env:"CONSOLE_COOKIE_SECURE" envDefault:"false" form:"true or false" help:"mark the console's session cookie Secure even when the request did not come over TLS (set it behind a proxy that ends TLS)"`
	ConsolePayloadPreview bool          `env:"CONSOLE_PAYLOAD_PREVIEW" envDefault:"true" form:"true or false" help:"show message payloads and header values in the console; false hides them (personal data) and the pages say so"`

	// What validate builds from the variables; see the accessors below.
	targets      protocol.TargetPatterns
	policies     *policy.Set
	classifier   policy.Classifier
	signing      *protocol.Signing
	consoleUsers []access.User
	// raw is the environment as given, so errors quote values as typed.
	raw map[string]string
}

// Load reads the configuration from environ (os.Environ form) and
// validates it. Every error names the variable and the accepted form.
func Load(environ []string) (Config, error) {
	vars := map[string]string{}
	for _, kv := range environ {
		if k, v, ok := strings.Cut(kv, "="); ok {
			vars[k] = v
		}
	}
	var c Config
	perr := env.ParseWithOptions(&c, env.Options{Environment: vars})
	// raw is quoted in errors; secrets must never be.
	delete(vars, "SIGNING_KEYS")
	delete(vars, "KAFKA_SASL_PASSWORD")
	delete(vars, "CONSOLE_DATABASE_URL")
	delete(vars, "CONSOLE_USERS")
	delete(vars, "CONSOLE_SESSION_KEY")
	c.raw = vars
	if perr == nil {
		return c, c.validate()
	}
	// Report every problem at once: values that did not parse, and what
	// validation finds in the rest. A variable that did not parse holds its
	// zero value, so validation's complaints about it (or mentioning it) are
	// noise and are dropped.
	failed := map[string]bool{}
	var agg env.AggregateError
	if errors.As(perr, &agg) {
		for _, e := range agg.Errors {
			var pe env.ParseError
			if errors.As(e, &pe) {
				if f, ok := reflect.TypeFor[Config]().FieldByName(pe.Name); ok {
					failed[f.Tag.Get("env")] = true
				}
			}
		}
	}
	errs := []error{explainEnvError(perr, vars)}
	if verr := c.validate(); verr != nil {
		for _, e := range verr.(interface{ Unwrap() []error }).Unwrap() {
			noise := false
			for name := range failed {
				noise = noise || strings.Contains(e.Error(), name+"=")
			}
			if !noise {
				errs = append(errs, e)
			}
		}
	}
	return c, errors.Join(errs...)
}

// explainEnvError rewrites caarlos0/env errors, which name Go fields, into
// ones that name the variable, the value and what is accepted.
func explainEnvError(err error, vars map[string]string) error {
	var agg env.AggregateError
	if !errors.As(err, &agg) {
		return err
	}
	var out []error
	for _, e := range agg.Errors {
		var pe env.ParseError
		if errors.As(e, &pe) {
			if f, ok := reflect.TypeFor[Config]().FieldByName(pe.Name); ok {
				name := f.Tag.Get("env")
				out = append(out, fmt.Errorf("%s=%q is not valid (%v): want %s", name, vars[name], pe.Err, f.Tag.Get("form")))
				continue
			}
		}
		out = append(out, e)
	}
	return errors.Join(out...)
}

func (c *Config) bad(name, value, form string, why ...any) error {
	if v, ok := c.raw[name]; ok {
		value = v // as typed, not as Go prints the parsed value
	}
	msg := fmt.Sprintf("%s=%q is not valid", name, value)
	if len(why) > 0 {
		msg += " (" + fmt.Sprint(why...) + ")"
	}
	return errors.New(msg + ": want " + form)
}

// validate checks values beyond their type. It reports every problem, not
// just the first, so one start-up attempt shows everything to fix.
func (c *Config) validate() error {
	var errs []error
	intRange := func(name string, v, lo, hi int) {
		if v < lo || v > hi {
			errs = append(errs, c.bad(name, fmt.Sprint(v), fmt.Sprintf("integer %d..%d", lo, hi)))
		}
	}
	intRange("INGEST_BATCH_SIZE", c.IngestBatchSize, 1, 100000)
	intRange("INGEST_BATCH_BYTES", c.IngestBatchBytes, 1024, 256<<20)
	intRange("INGEST_WRITERS", c.IngestWriters, 1, 64)
	intRange("INGEST_BUFFER_BYTES", c.IngestBufferBytes, 1<<20, 4<<30)
	intRange("DISPATCH_ROUND_BYTES", c.DispatchRoundBytes, 1024, 1<<30)
	intRange("DISPATCH_LOOPS", c.DispatchLoops, 1, 256)
	intRange("DISPATCH_WORKERS", c.DispatchWorkers, 1, 256)
	intRange("DISPATCH_CLAIMS", c.DispatchClaims, 1, 256)
	intRange("DISPATCH_EXPRESS_HEADS", c.DispatchExpressHeads, 0, 10000)
	intRange("DISPATCH_BATCH_KEYS", c.DispatchBatchKeys, 1, 100000)
	intRange("DISPATCH_ROUND_MESSAGES", c.DispatchRoundMessages, 1, 1000000)
	intRange("DISPATCH_KEY_BATCH", c.DispatchKeyBatch, 1, 10000)
	intRange("DB_MAX_CONNS", int(c.DBMaxConns), 4, 1000)

	positive := func(name string, d time.Duration, form string) {
		if d <= 0 {
			errs = append(errs, c.bad(name, d.String(), form, "must be positive"))
		}
	}
	positive("MAX_DELAY", c.MaxDelay, "Go duration, e.g. 168h")
	positive("INGEST_BATCH_LINGER", c.IngestBatchLinger, "Go duration, e.g. 20ms")
	if c.IngestFutureLinger < 0 || c.IngestFutureLinger > 10*time.Second {
		errs = append(errs, c.bad("INGEST_FUTURE_LINGER", c.IngestFutureLinger.String(), fieldForm("IngestFutureLinger")))
	}
	positive("SHUTDOWN_TIMEOUT", c.ShutdownTimeout, "Go duration")
	if c.KafkaTimeout < 100*time.Millisecond || c.KafkaTimeout > time.Minute {
		errs = append(errs, c.bad("KAFKA_TIMEOUT", c.KafkaTimeout.String(), "Go duration, 100ms..1m"))
	}
	if c.KafkaMaxMessageBytes < 1024 || c.KafkaMaxMessageBytes > 100<<20 {
		errs = append(errs, c.bad("KAFKA_MAX_MESSAGE_BYTES", strconv.Itoa(c.KafkaMaxMessageBytes), fieldForm("KafkaMaxMessageBytes")))
	}
	// The backlog query counts the whole table: a floor keeps a typo from
	// turning it into a busy loop.
	if c.MetricsInterval < 100*time.Millisecond || c.MetricsInterval > time.Hour {
		errs = append(errs, c.bad("METRICS_INTERVAL", c.MetricsInterval.String(), "Go duration, 100ms..1h"))
	}
	if c.DispatchLoopDuration < time.Second {
		errs = append(errs, c.bad("DISPATCH_LOOP_DURATION", c.DispatchLoopDuration.String(), "Go duration >= 1s"))
	}
	// Notifications only announce heads due within 5 s (see the migration),
	// so a loop must never sleep longer than that without looking.
	if c.PollInterval < 10*time.Millisecond || c.PollInterval > 5*time.Second {
		errs = append(errs, c.bad("POLL_INTERVAL", c.PollInterval.String(), "Go duration, 10ms..5s"))
	}

	var err error
	if c.targets, err = protocol.ParseTargetPatterns(c.TargetTopics); err != nil {
		errs = append(errs, c.bad("TARGET_TOPICS", c.TargetTopics, "comma-separated path.Match globs, e.g. orders.*,payments.retry", err))
	}
	// Policies are checked against MAX_DELAY; a MAX_DELAY that is not
	// positive is reported above, and checking against it would only add
	// noise.
	if c.MaxDelay > 0 {
		// A *policy.SyntaxError's text starts with its position.
		if c.policies, err = policy.Parse(c.RetryPolicies, c.MaxDelay); err != nil {
			errs = append(errs, c.bad("RETRY_POLICIES", c.RetryPolicies, fieldForm("RetryPolicies"), err))
		} else if err := dlqLoops(c.policies, c.DeferTopic); err != nil {
			errs = append(errs, c.bad("RETRY_POLICIES", c.RetryPolicies, fieldForm("RetryPolicies"), err))
		}
	}
	if c.classifier, err = policy.ParseClassifier(c.NonRetriableErrors); err != nil {
		errs = append(errs, c.bad("NON_RETRIABLE_ERRORS", c.NonRetriableErrors, fieldForm("NonRetriableErrors"), err))
	}
	errs = append(errs, c.loadSigning()...)
	errs = append(errs, c.loadConsole()...)
	if c.HistoryRetention < 0 {
		errs = append(errs, c.bad("HISTORY_RETENTION", c.HistoryRetention.String(), fieldForm("HistoryRetention"), "must not be negative"))
	}
	if !protocol.ValidTopic(c.DeferTopic) {
		errs = append(errs, c.bad("DEFER_TOPIC", c.DeferTopic, "Kafka topic name: 1-249 of [a-zA-Z0-9._-]"))
	}
	if strings.TrimSpace(c.ConsumerGroup) == "" {
		errs = append(errs, c.bad("CONSUMER_GROUP", c.ConsumerGroup, "non-empty consumer group id"))
	}
	for _, b := range c.KafkaBrokers {
		if _, _, err := net.SplitHostPort(strings.TrimSpace(b)); err != nil {
			errs = append(errs, c.bad("KAFKA_BROKERS", strings.Join(c.KafkaBrokers, ","), "comma-separated host:port list", err))
			break
		}
	}
	if _, _, err := net.SplitHostPort(c.HTTPAddr); err != nil {
		errs = append(errs, c.bad("HTTP_ADDR", c.HTTPAddr, "host:port, e.g. :8080", err))
	}
	if c.PprofAddr != "" {
		if _, _, err := net.SplitHostPort(c.PprofAddr); err != nil {
			errs = append(errs, c.bad("PPROF_ADDR", c.PprofAddr, "host:port, e.g. 127.0.0.1:6060, or empty", err))
		}
	}
	switch c.LogLevel {
	case "debug", "info", "warn", "error":
	default:
		errs = append(errs, c.bad("LOG_LEVEL", c.LogLevel, "debug, info, warn or error"))
	}
	switch c.LogFormat {
	case "text", "json":
	default:
		errs = append(errs, c.bad("LOG_FORMAT", c.LogFormat, "text or json"))
	}
	kafkaOK := true
	if _, err := sarama.ParseKafkaVersion(c.KafkaVersion); err != nil {
		errs = append(errs, c.bad("KAFKA_VERSION", c.KafkaVersion, "Kafka version, e.g. 3.6.0"))
		kafkaOK = false
	}
	if c.KafkaSASLMechanism != "" && !slices.Contains(kafkaclient.SASLMechanisms(), c.KafkaSASLMechanism) {
		errs = append(errs, c.bad("KAFKA_SASL_MECHANISM", c.KafkaSASLMechanism, "empty, PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512"))
		kafkaOK = false
	} else if c.KafkaSASLMechanism != "" && c.KafkaSASLUser == "" {
		errs = append(errs, fmt.Errorf("KAFKA_SASL_USER is not set: KAFKA_SASL_MECHANISM=%s needs a user", c.KafkaSASLMechanism))
		kafkaOK = false
	} else if c.KafkaSASLMechanism != "" && c.KafkaSASLPassword == "" {
		errs = append(errs, fmt.Errorf("KAFKA_SASL_PASSWORD is not set: KAFKA_SASL_MECHANISM=%s needs a password", c.KafkaSASLMechanism))
		kafkaOK = false
	}
	if (c.KafkaTLSCertFile == "") != (c.KafkaTLSKeyFile == "") {
		errs = append(errs, fmt.Errorf("KAFKA_TLS_CERT_FILE=%q and KAFKA_TLS_KEY_FILE=%q: set both together for mutual TLS, or neither",
			c.KafkaTLSCertFile, c.KafkaTLSKeyFile))
		kafkaOK = false
	}
	for _, f := range []struct{ name, path string }{
		{"KAFKA_TLS_CA_FILE", c.KafkaTLSCAFile}, {"KAFKA_TLS_CERT_FILE", c.KafkaTLSCertFile}, {"KAFKA_TLS_KEY_FILE", c.KafkaTLSKeyFile},
	} {
		if f.path == "" {
			continue
		}
		if _, err := os.Stat(f.path); err != nil {
			errs = append(errs, c.bad(f.name, f.path, "path to a readable PEM file", err))
			kafkaOK = false
		}
	}
	if !kafkaOK {
		// Already reported by variable.
	} else if kc, err := c.Kafka().Config(); err != nil {
		errs = append(errs, fmt.Errorf("KAFKA_* settings: %w", err))
	} else if limit := batchproducer.MaxDuration(batchproducer.Config(kc)); c.LeaseDuration <= limit {
		errs = append(errs, c.bad("LEASE_DURATION", c.LeaseDuration.String(),
			fmt.Sprintf("Go duration longer than the longest publish with KAFKA_TIMEOUT=%v, which is %v", c.KafkaTimeout, limit)))
	}
	return errors.Join(errs...)
}

// loadSigning reads the signing keys of SIGNING_KEYS and SIGNING_KEYS_FILE
// into c.signing. Its errors name the variable, the entry or line, and the
// source, but never quote a key or the value of SIGNING_KEYS.
func (c *Config) loadSigning() []error {
	var errs []error
	keys, err := protocol.ParseSigningKeys(string(c.SigningKeys))
	errs = append(errs, prefixed("SIGNING_KEYS (value not shown)", err)...)
	if path := c.SigningKeysFile; path != "" {
		data, err := os.ReadFile(path)
		if err != nil {
			errs = append(errs, c.bad("SIGNING_KEYS_FILE", path, fieldForm("SigningKeysFile"), err))
		} else {
			more, err := protocol.ParseSigningKeysFile(data)
			errs = append(errs, prefixed(fmt.Sprintf("SIGNING_KEYS_FILE=%q", path), err)...)
			err = protocol.MergeSigningKeys(keys, more)
			errs = append(errs, prefixed("SIGNING_KEYS and SIGNING_KEYS_FILE", err)...)
		}
	}
	if len(errs) > 0 {
		return errs
	}
	if c.SigningRequired && len(keys) == 0 {
		return []error{errors.New("SIGNING_REQUIRED=true but neither SIGNING_KEYS nor SIGNING_KEYS_FILE gives a key: every record would be rejected")}
	}
	if c.signing, err = protocol.NewSigning(keys, c.SigningRequired); err != nil {
		return prefixed("SIGNING_KEYS", err)
	}
	return nil
}

// loadConsole checks the CONSOLE_* settings and reads the console's users
// from CONSOLE_USERS and CONSOLE_USERS_FILE. Its errors never quote a hash,
// the session key or the console's database URL.
func (c *Config) loadConsole() []error {
	var errs []error
	if c.ConsoleAddr != "" {
		if _, _, err := net.SplitHostPort(c.ConsoleAddr); err != nil {
			errs = append(errs, c.bad("CONSOLE_ADDR", c.ConsoleAddr, "host:port, e.g. :8081, or empty", err))
		}
	}
	if k := string(c.ConsoleSessionKey); k != "" {
		if b, err := hex.DecodeString(k); err != nil || len(b) < 32 {
			errs = append(errs, errors.New("CONSOLE_SESSION_KEY (value not shown) is not valid: want hex, at least 64 digits (32 bytes), e.g. from openssl rand -hex 32"))
		}
	}
	if c.ConsoleSessionTTL < time.Minute || c.ConsoleSessionTTL > 720*time.Hour {
		errs = append(errs, c.bad("CONSOLE_SESSION_TTL", c.ConsoleSessionTTL.String(), fieldForm("ConsoleSessionTTL")))
	}
	var fileText string
	if path := c.ConsoleUsersFile; path != "" {
		data, err := os.ReadFile(path)
		if err != nil {
			errs = append(errs, c.bad("CONSOLE_USERS_FILE", path, fieldForm("ConsoleUsersFile"), err))
		}
		fileText = string(data)
	}
	users, err := access.ParseUsers(access.Entries(string(c.ConsoleUsers), fileText, c.ConsoleUsersFile))
	if err != nil {
		errs = append(errs, err.(interface{ Unwrap() []error }).Unwrap()...)
	}
	c.consoleUsers = users
	return errs
}

// ConsoleUserList returns the console's users, from CONSOLE_USERS and
// CONSOLE_USERS_FILE; none means the console serves only a page saying how
// to configure access.
func (c *Config) ConsoleUserList() []access.User { return c.consoleUsers }

// ConsoleDB returns the URL the console connects with:
// CONSOLE_DATABASE_URL, or DATABASE_URL when that is empty.
func (c *Config) ConsoleDB() string {
	if c.ConsoleDatabaseURL != "" {
		return string(c.ConsoleDatabaseURL)
	}
	return c.DatabaseURL
}

// DirectDB returns the URL of a session of its own (migrate's lock,
// LISTEN): DIRECT_DATABASE_URL, or DATABASE_URL when that is empty; and
// the variable it came from, for messages.
func (c *Config) DirectDB() (url, source string) {
	if c.DirectDatabaseURL != "" {
		return string(c.DirectDatabaseURL), "DIRECT_DATABASE_URL"
	}
	return c.DatabaseURL, "DATABASE_URL"
}

// ConsoleKey returns CONSOLE_SESSION_KEY decoded, or nil when it is empty.
func (c *Config) ConsoleKey() []byte {
	b, _ := hex.DecodeString(string(c.ConsoleSessionKey)) // validated
	return b
}

// prefixed returns each error joined in err (errors.Join) prefixed with
// what, so that each problem has a line that names its variable.
func prefixed(what string, err error) []error {
	if err == nil {
		return nil
	}
	list := []error{err}
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		list = j.Unwrap()
	}
	out := make([]error, len(list))
	for i, e := range list {
		out[i] = fmt.Errorf("%s: %w", what, e)
	}
	return out
}

// secret is a configuration value that must never be printed: fmt, with
// any verb, and slog show it as "(not shown)".
type secret string

// Format implements fmt.Formatter.
func (secret) Format(f fmt.State, _ rune) { _, _ = io.WriteString(f, "(not shown)") }

// LogValue implements slog.LogValuer.
func (secret) LogValue() slog.Value { return slog.StringValue("(not shown)") }

// Targets returns TARGET_TOPICS as patterns.
func (c *Config) Targets() protocol.TargetPatterns { return c.targets }

// Policies returns the retry policies RETRY_POLICIES sets, capped at
// MAX_DELAY.
func (c *Config) Policies() *policy.Set { return c.policies }

// Classifier returns NON_RETRIABLE_ERRORS as an error-class classifier.
func (c *Config) Classifier() policy.Classifier { return c.classifier }

// Signing returns the signing keys of SIGNING_KEYS and SIGNING_KEYS_FILE and
// SIGNING_REQUIRED, or nil when no key is configured and signing is not
// required.
func (c *Config) Signing() *protocol.Signing { return c.signing }

// RequireRun checks what only `run` needs.
func (c *Config) RequireRun() error {
	var errs []error
	if c.DatabaseURL == "" {
		errs = append(errs, errors.New("DATABASE_URL is not set: want a PostgreSQL URL, e.g. postgres://user:pass@host:5432/db"))
	}
	if len(c.KafkaBrokers) == 0 {
		errs = append(errs, errors.New("KAFKA_BROKERS is not set: want a comma-separated host:port list"))
	}
	return errors.Join(errs...)
}

// Kafka returns the settings of the service's Kafka clients.
func (c *Config) Kafka() kafkaclient.Settings {
	return kafkaclient.Settings{
		Version: c.KafkaVersion, ClientID: c.KafkaClientID, Timeout: c.KafkaTimeout,
		TLS: c.KafkaTLS, TLSCAFile: c.KafkaTLSCAFile, TLSCertFile: c.KafkaTLSCertFile, TLSKeyFile: c.KafkaTLSKeyFile,
		TLSInsecureSkipVer: c.KafkaTLSInsecureSkipVer,
		SASLMechanism:      c.KafkaSASLMechanism, SASLUser: c.KafkaSASLUser, SASLPassword: string(c.KafkaSASLPassword),
	}
}

// Logger returns the logger LOG_LEVEL and LOG_FORMAT ask for, writing to w.
func (c *Config) Logger(w io.Writer) *slog.Logger {
	var level slog.Level
	_ = level.UnmarshalText([]byte(c.LogLevel)) // validated
	opts := &slog.HandlerOptions{Level: level}
	if c.LogFormat == "json" {
		return slog.New(slog.NewJSONHandler(w, opts))
	}
	return slog.New(slog.NewTextHandler(w, opts))
}

// LogPolicies logs the effective retry rules, one line per policy entry in
// the order they are tried, so that what a message will get can be read off
// the start-up log.
func (c *Config) LogPolicies(logger *slog.Logger) {
	// Set.String renders "pattern: policy" entries joined by "; ", the
	// default last; neither patterns nor policies can contain ";".
	for e := range strings.SplitSeq(c.policies.String(), "; ") {
		targets, pol, _ := strings.Cut(e, ": ")
		logger.Info("retry policy", "targets", targets, "policy", pol)
	}
	// "permanent" is always parked; NON_RETRIABLE_ERRORS adds to it.
	classes := "permanent"
	if p := c.classifier.String(); p != "" {
		classes += "," + p
	}
	logger.Info("error classes parked without retry", "patterns", classes)
	logger.Info("attempt history", "retention", c.HistoryRetention)
	// Sources only: keys are never logged.
	if srcs := c.signing.Sources(); len(srcs) > 0 {
		logger.Info("record signing", "sources", strings.Join(srcs, ","), "required", c.signing.Required())
	}
}

// fieldForm returns the form tag of the Config field named name, so that a
// long form is written once.
func fieldForm(name string) string {
	f, _ := reflect.TypeFor[Config]().FieldByName(name)
	return f.Tag.Get("form")
}

// Var describes one variable: its name, default ("" for none), the form a
// valid value takes, and what it does. --help prints them; tests check the
// README and compose.yaml against them.
type Var struct {
	Name, Default, Form, Help string
}

// Vars returns every variable Config reads, in its field order.
func Vars() []Var {
	t := reflect.TypeFor[Config]()
	var out []Var
	for i := range t.NumField() {
		f := t.Field(i)
		if name := f.Tag.Get("env"); name != "" {
			out = append(out, Var{Name: name, Default: f.Tag.Get("envDefault"), Form: f.Tag.Get("form"), Help: f.Tag.Get("help")})
		}
	}
	return out
}

// PrintEnvHelp writes the table of variables `scheduler run --help` shows:
// name, default, and meaning followed by the form a valid value takes (the
// values and ranges the README and the error messages give).
func PrintEnvHelp(w io.Writer) {
	tw := tabwriter.NewWriter(w, 2, 8, 2, ' ', 0)
	fmt.Fprintln(tw, "  VARIABLE\tDEFAULT\tMEANING (ACCEPTED VALUES)")
	for _, v := range Vars() {
		def := v.Default
		if def == "" {
			def = "-"
		}
		help := v.Help
		if v.Form != "" {
			help += " (accepts: " + v.Form + ")"
		}
		fmt.Fprintf(tw, "  %s\t%s\t%s\n", v.Name, def, help)
	}
	tw.Flush()
}

// dlqLoops refuses dead-letter topics that would feed copies back into the
// scheduler: the defer topic itself (each copy would be ingested, parked
// again and copied again, forever), or the target topic ("dlq {target}":
// the failing consumer would get every copy and defer it again).
func dlqLoops(set *policy.Set, deferTopic string) error {
	patterns, policies := set.Policies()
	for i, p := range policies {
		switch {
		case p.DLQ == "":
		case p.DLQ == "{target}":
			return fmt.Errorf("%s: dlq {target} sends each dead-letter copy back to the topic whose consumer failed on it; use e.g. dlq {target}.dlq", patterns[i])
		case p.DLQ == deferTopic:
			return fmt.Errorf("%s: dlq %s is DEFER_TOPIC: every copy would be ingested and parked again, forever", patterns[i], p.DLQ)
		}
	}
	return nil
}
