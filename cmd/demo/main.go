// Command demo runs the scheduler end to end with nothing set up and
// narrates a short scenario: deferral, per-key order, an SQL expedite and a
// rejected record. `make demo` runs it. It needs PostgreSQL's server
// binaries for a throwaway cluster (scripts/install-postgres.sh installs
// them; make demo runs it first), or DATABASE_URL.
package main

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/url"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/deferq/scheduler/internal/cmdflag"
	"github.com/deferq/scheduler/internal/config"
	"github.com/deferq/scheduler/internal/console"
	"github.com/deferq/scheduler/internal/pgconnect"
	"github.com/deferq/scheduler/internal/pglocal"
	"github.com/deferq/scheduler/internal/service"
)

const (
	demoTarget = "payments.retry"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	os.Exit(run(ctx, os.Args[1:], os.Environ(), os.Stdout, os.Stderr))
}

// run is main without the process: it runs the service end to end on
// embedded defaults and narrates the scenario, and returns the exit code.
func run(ctx context.Context, args, environ []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("demo", flag.ContinueOnError)
	verbose := fs.Bool("v", false, "also print the service's own logs")
	consoleAddr := fs.String("console", "", "also serve the operator console on this host:port (e.g. 127.0.0.1:8081) with a password made for this run, and keep running after the scenario until interrupted")
	if done, code := cmdflag.Parse(fs, args, stdout, stderr, func(w io.Writer) {
		fmt.Fprint(w, `Usage: demo [flags]   (make demo)

Runs the scheduler end to end with nothing set up: a throwaway PostgreSQL
cluster from the system's binaries (scripts/install-postgres.sh installs them;
make demo runs it first), or DATABASE_URL when set (the demo then works in a
schema of its own, dropped at the end), and an in-process Kafka broker.
A scripted scenario shows messages deferred, held, republished in per-key
order, one expedited with SQL, and one bad record rejected with its reason.
It ends by itself (about 15 seconds) and removes what it created.
With --console ADDR it also serves the operator console there (user demo,
a password printed at the start, made for this run) and keeps running after
the scenario, so that you can look around, until Ctrl-C.

`)
	}); done {
		return code
	}
	d := &demo{out: stdout, consoleAddr: *consoleAddr}
	if err := d.run(ctx, environ, *verbose, stderr); err != nil {
		fmt.Fprintf(stderr, "demo: %v\n", err)
		return 1
	}
	return 0
}

type demo struct {
	out   io.Writer
	start time.Time
	// consoleAddr, when set, is where the console is served; the demo then
	// waits to be interrupted after its scenario.
	consoleAddr string
}

// consoleEnv returns the settings that serve the console at d.consoleAddr
// for a user demo with a password made now, and that password. There is
// no default password: each run makes its own.
func (d *demo) consoleEnv() ([]string, string, error) {
	if d.consoleAddr == "" {
		return nil, "", nil
	}
	b := make([]byte, 12)
	if _, err := rand.Read(b); err != nil {
		return nil, "", fmt.Errorf("make the console's password: %w", err)
	}
	password := base64.RawURLEncoding.EncodeToString(b)
	hash, err := console.HashPassword(password)
	if err != nil {
		return nil, "", err
	}
	return []string{"CONSOLE_ADDR=" + d.consoleAddr, "CONSOLE_USERS=demo:operator:" + hash}, password, nil
}

func (d *demo) say(format string, args ...any) {
	fmt.Fprintf(d.out, "[%5.1fs] %s\n", time.Since(d.start).Seconds(), fmt.Sprintf(format, args...))
}

func (d *demo) run(ctx context.Context, environ []string, verbose bool, stderr io.Writer) error {
	d.start = time.Now()
	dbURL := cmdflag.Lookup(environ, "DATABASE_URL")
	if dbURL == "" {
		if _, err := pglocal.Binaries(); err != nil {
			return fmt.Errorf("%w: run scripts/install-postgres.sh (make demo does), or set DATABASE_URL to a PostgreSQL server", err)
		}
		d.say("starting a throwaway PostgreSQL cluster")
		cluster, err := pglocal.Start(ctx, pglocal.Options{})
		if err != nil {
			return err
		}
		defer func() {
			if err := cluster.Stop(context.WithoutCancel(ctx)); err != nil {
				fmt.Fprintf(stderr, "demo: stop PostgreSQL: %v\n", err)
			}
			d.say("removed the throwaway PostgreSQL cluster")
		}()
		dbURL = cluster.URL("postgres")
	} else {
		// Never touch the objects of a real deployment: the demo works in a
		// schema of its own and drops it at the end.
		schemaURL, drop, err := demoSchema(ctx, dbURL)
		if err != nil {
			return err
		}
		defer func() {
			if err := drop(context.WithoutCancel(ctx)); err != nil {
				fmt.Fprintf(stderr, "demo: %v\n", err)
			}
			d.say("dropped the demo's schema")
		}()
		dbURL = schemaURL
		d.say("using DATABASE_URL, in a schema of the demo's own")
	}

	broker, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(3, "scheduler.defer", demoTarget, gateMain, gateRetry))
	if err != nil {
		return fmt.Errorf("start in-process Kafka broker: %w", err)
	}
	defer broker.Close()
	addr := broker.ListenAddrs()[0]
	d.say("in-process Kafka broker on %s with topics scheduler.defer, %s, %s and %s", addr, demoTarget, gateMain, gateRetry)

	consoleEnv, password, err := d.consoleEnv()
	if err != nil {
		return err
	}
	cfg, err := config.Load(append(append(environ,
		"DATABASE_URL="+dbURL, "KAFKA_BROKERS="+addr, "TARGET_TOPICS=payments.*",
		"HTTP_ADDR=127.0.0.1:0", "CONSUMER_GROUP=demo-scheduler", "POLL_INTERVAL=200ms",
		"DISPATCH_LOOPS=2", "DISPATCH_WORKERS=2", "RETRY_POLICIES="+gatePolicy), consoleEnv...))
	if err != nil {
		return err
	}
	logger := slog.New(slog.DiscardHandler)
	if verbose {
		logger = cfg.Logger(stderr)
	}
	svcCtx, stopSvc := context.WithCancel(ctx)
	defer stopSvc()
	svc, err := service.New(svcCtx, cfg, logger, service.Options{Migrate: true, Version: "demo"})
	if err != nil {
		return err
	}
	// The demo's own statements (the operator's expedite) change messages,
	// so its pool is checked as the service's is (README, "Session
	// settings").
	pool, err := pgconnect.Open(ctx, dbURL, pgconnect.Options{Source: "DATABASE_URL", AppName: "defer-scheduler-demo"})
	if err != nil {
		return fmt.Errorf("the demo's own connection: %w", err)
	}
	defer pool.Close()
	d.say("migrated the database; scheduler running (TARGET_TOPICS=payments.*)")
	svcDone := make(chan error, 1)
	go func() { svcDone <- svc.Run(svcCtx) }()
	if d.consoleAddr != "" {
		d.say("operator console: http://%s (user demo, password %s)", d.consoleAddr, password)
	}
	scenarioErr := d.scenario(ctx, pool.Pool, addr)
	if scenarioErr == nil {
		scenarioErr = d.gateScenario(ctx, addr, svc.HTTPAddr())
	}
	if scenarioErr == nil && d.consoleAddr != "" {
		d.say("scenario done; the console stays at http://%s until Ctrl-C", d.consoleAddr)
		select {
		case <-ctx.Done():
		case err := <-svcDone:
			return fmt.Errorf("the scheduler stopped: %w", err)
		}
	}
	stopSvc()
	if err := errors.Join(scenarioErr, <-svcDone); err != nil {
		return err
	}
	d.say("scheduler stopped cleanly")
	return nil
}

// demoSchema creates a schema for the demo in the database at dbURL and
// returns a URL whose search_path puts the demo's tables (and River's) there,
// and a function that drops it.
func demoSchema(ctx context.Context, dbURL string) (string, func(context.Context) error, error) {
	u, err := url.Parse(dbURL)
	if err != nil {
		return "", nil, fmt.Errorf("DATABASE_URL is not a valid URL: %w", err)
	}
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		return "", nil, fmt.Errorf("connect to DATABASE_URL: %w", err)
	}
	defer conn.Close(ctx)
	schema := fmt.Sprintf("scheduler_demo_%d", os.Getpid())
	if _, err := conn.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{schema}.Sanitize()); err != nil {
		return "", nil, fmt.Errorf("create schema %s for the demo: %w", schema, err)
	}
	// The query string is edited as written, not re-encoded: url.Values
	// would write a space of options=-c%20jit%3Doff as '+', which neither
	// pgx nor libpq reads as one. A search_path of the URL's own goes (pgx
	// takes a parameter's first value).
	var params []string
	for p := range strings.SplitSeq(u.RawQuery, "&") {
		if k, _, _ := strings.Cut(p, "="); p != "" && k != "search_path" {
			params = append(params, p)
		}
	}
	u.RawQuery = strings.Join(append(params, "search_path="+url.QueryEscape(schema)), "&")
	drop := func(ctx context.Context) error {
		conn, err := pgx.Connect(ctx, dbURL)
		if err != nil {
			return fmt.Errorf("drop schema %s: %w", schema, err)
		}
		defer conn.Close(ctx)
		if _, err := conn.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{schema}.Sanitize()+" CASCADE"); err != nil {
			return fmt.Errorf("drop schema %s: %w", schema, err)
		}
		return nil
	}
	return u.String(), drop, nil
}

type demoRecord struct {
	label   string
	key     string
	headers map[string]string
}

func (d *demo) scenario(ctx context.Context, pool *pgxpool.Pool, addr string) error {
	pc := sarama.NewConfig()
	pc.Producer.Return.Successes = true
	pc.Producer.Partitioner = sarama.NewMurmur2Partitioner
	producer, err := sarama.NewSyncProducer([]string{addr}, pc)
	if err != nil {
		return fmt.Errorf("demo producer: %w", err)
	}
	defer producer.Close()

	arrivals := make(chan *sarama.ConsumerMessage, 16)
	cctx, stopConsumer := context.WithCancel(ctx)
	defer stopConsumer()
	if err := consumeAll(cctx, addr, demoTarget, arrivals); err != nil {
		return err
	}

	d.say("a payments consumer fails on three messages of order demo-42 and defers them:")
	records := []demoRecord{
		{"demo-42 #1 (retry in 4s)", "demo-42", map[string]string{"defer.delay": "4s"}},
		{"demo-42 #2 (retry in 1s)", "demo-42", map[string]string{"defer.delay": "1s"}},
		{"demo-42 #3 (retry now)", "demo-42", map[string]string{"defer.delay": "0s"}},
		{"demo-7  #1 (retry in 1h)", "demo-7", map[string]string{"defer.delay": "1h"}},
		{"no target (bad record)", "demo-bad", map[string]string{"defer.delay": "1s", "defer.target": ""}},
	}
	for _, r := range records {
		msg := &sarama.ProducerMessage{Topic: "scheduler.defer", Key: sarama.StringEncoder(r.key),
			Value: sarama.StringEncoder(`{"payment":"` + r.label + `"}`)}
		hdr := map[string]string{"defer.target": demoTarget, "defer.error.class": "ProviderTimeout", "trace-id": "abc123"}
		for k, v := range r.headers {
			hdr[k] = v
		}
		for _, k := range []string{"trace-id", "defer.target", "defer.delay", "defer.error.class"} {
			if v := hdr[k]; v != "" {
				msg.Headers = append(msg.Headers, sarama.RecordHeader{Key: []byte(k), Value: []byte(v)})
			}
		}
		if _, _, err := producer.SendMessage(msg); err != nil {
			return fmt.Errorf("produce %s: %w", r.label, err)
		}
		d.say("  produced %s", r.label)
	}
	d.say("demo-42 #2 and #3 are due first, but per-key order holds them behind #1.")

	if err := waitFor(ctx, 10*time.Second, func() (bool, error) {
		var n int
		err := pool.QueryRow(ctx, "SELECT count(*) FROM deferred_message WHERE business_key LIKE 'demo-%'").Scan(&n)
		return n >= 5, err
	}); err != nil {
		return fmt.Errorf("waiting for ingest: %w", err)
	}
	d.say("stored in Postgres:")
	if err := d.table(ctx, pool, `SELECT id, business_key, seq, state,
		to_char(greatest(next_run_at - now(), interval '0'), 'HH24:MI:SS') AS due_in, coalesce(reason, '') AS reason
		FROM deferred_message WHERE business_key LIKE 'demo-%' ORDER BY id`); err != nil {
		return err
	}
	d.say("the bad record is kept as 'rejected' with its reason; it is never sent on its own.")

	got := 0
	var order []string
	expect := func(n int, within time.Duration) error {
		deadline := time.After(within)
		for got < n {
			select {
			case m := <-arrivals:
				got++
				order = append(order, string(m.Value))
				d.say("  -> %s: %s  (defer.id=%s defer.attempt=%s)", demoTarget, m.Value, header(m, "defer.id"), header(m, "defer.attempt"))
			case <-deadline:
				return fmt.Errorf("only %d of %d messages arrived on %s", got, n, demoTarget)
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		return nil
	}
	d.say("waiting: #1 goes out at 4s, and #2 and #3 right behind it, in order:")
	if err := expect(3, 10*time.Second); err != nil {
		return err
	}
	// The demo shows the promise; it also checks it.
	for i, v := range order {
		if want := fmt.Sprintf("demo-42 #%d", i+1); !strings.Contains(v, want) {
			return fmt.Errorf("per-key order broken: arrival %d is %s, want %s", i+1, v, want)
		}
	}

	d.say("an operator expedites order demo-7 with plain SQL:")
	const expedite = "UPDATE deferred_message SET next_run_at = now() WHERE business_key = 'demo-7'"
	d.say("  %s", expedite)
	if _, err := pool.Exec(ctx, expedite); err != nil {
		return err
	}
	if err := expect(4, 5*time.Second); err != nil {
		return err
	}
	// The broker acknowledges before the rows are deleted (publish, then
	// finalize), so give finalize its moment.
	if err := waitFor(ctx, 5*time.Second, func() (bool, error) {
		var n int
		err := pool.QueryRow(ctx, "SELECT count(*) FROM deferred_message WHERE business_key LIKE 'demo-%' AND state = 'pending'").Scan(&n)
		return n == 0, err
	}); err != nil {
		return fmt.Errorf("waiting for published rows to be deleted: %w", err)
	}
	d.say("left in the table (published rows are deleted once the broker acknowledged them):")
	if err := d.table(ctx, pool, `SELECT id, business_key, state, reason FROM deferred_message
		WHERE business_key LIKE 'demo-%' ORDER BY id`); err != nil {
		return err
	}
	d.say("done: 4 messages republished in per-key order, 1 rejected and kept for an operator.")
	return nil
}

func header(m *sarama.ConsumerMessage, key string) string {
	for _, h := range m.Headers {
		if string(h.Key) == key {
			return string(h.Value)
		}
	}
	return ""
}

// consumeAll reads every partition of topic from the oldest offset into out.
func consumeAll(ctx context.Context, addr, topic string, out chan<- *sarama.ConsumerMessage) error {
	consumer, err := sarama.NewConsumer([]string{addr}, sarama.NewConfig())
	if err != nil {
		return fmt.Errorf("demo consumer: %w", err)
	}
	parts, err := consumer.Partitions(topic)
	if err != nil {
		consumer.Close()
		return fmt.Errorf("partitions of %s: %w", topic, err)
	}
	var pcs []sarama.PartitionConsumer
	for _, p := range parts {
		pc, err := consumer.ConsumePartition(topic, p, sarama.OffsetOldest)
		if err != nil {
			consumer.Close()
			return fmt.Errorf("consume %s/%d: %w", topic, p, err)
		}
		pcs = append(pcs, pc)
		go func() {
			for m := range pc.Messages() {
				select {
				case out <- m:
				case <-ctx.Done():
				}
			}
		}()
	}
	context.AfterFunc(ctx, func() {
		// sarama wants partition consumers closed before their consumer.
		for _, pc := range pcs {
			pc.Close()
		}
		consumer.Close()
	})
	return nil
}

func waitFor(ctx context.Context, within time.Duration, cond func() (bool, error)) error {
	deadline := time.Now().Add(within)
	for {
		ok, err := cond()
		if err != nil {
			return err
		}
		if ok {
			return nil
		}
		if time.Now().After(deadline) {
			return errors.New("timed out")
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// table prints a query's result as an aligned table.
func (d *demo) table(ctx context.Context, pool *pgxpool.Pool, query string) error {
	rows, err := pool.Query(ctx, query)
	if err != nil {
		return err
	}
	defer rows.Close()
	tw := tabwriter.NewWriter(d.out, 2, 8, 2, ' ', 0)
	var names []string
	for _, f := range rows.FieldDescriptions() {
		names = append(names, f.Name)
	}
	fmt.Fprintln(tw, "         "+strings.Join(names, "\t"))
	for rows.Next() {
		vals, err := rows.Values()
		if err != nil {
			return err
		}
		cells := make([]string, len(vals))
		for i, v := range vals {
			if v == nil {
				v = ""
			}
			cells[i] = fmt.Sprint(v)
		}
		fmt.Fprintln(tw, "         "+strings.Join(cells, "\t"))
	}
	if err := rows.Err(); err != nil {
		return err
	}
	return tw.Flush()
}
