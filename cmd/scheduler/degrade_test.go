package main

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/deferq/scheduler/internal/metrics"
	"github.com/deferq/scheduler/internal/pglocal"
	"github.com/deferq/scheduler/internal/pgtest"
	"github.com/deferq/scheduler/internal/tcpproxy"
)

// sendBatch produces n records for the target, due at once unless delay
// says otherwise, valued prefix-0 .. prefix-(n-1) and keyed over keys
// business keys.
func sendBatch(t *testing.T, prod sarama.SyncProducer, prefix string, n, keys int, delay string) []string {
	t.Helper()
	msgs := make([]*sarama.ProducerMessage, n)
	values := make([]string, n)
	for i := range n {
		values[i] = fmt.Sprintf("%s-%d", prefix, i)
		msgs[i] = deferRecord(fmt.Sprintf("k-%d", i%keys), values[i], "defer.target", targetTopic, "defer.delay", delay)
	}
	if err := prod.SendMessages(msgs); err != nil {
		t.Fatalf("produce %s: %v", prefix, err)
	}
	return values
}

// deliveredAll reports whether every value is among the deliveries.
func deliveredAll(values ...[]string) func([]delivery) bool {
	return func(ds []delivery) bool {
		seen := map[string]bool{}
		for _, d := range ds {
			seen[d.value] = true
		}
		for _, vs := range values {
			for _, v := range vs {
				if !seen[v] {
					return false
				}
			}
		}
		return true
	}
}

// duplicates counts deliveries beyond the first of each defer.id.
func duplicates(ds []delivery) int {
	seen := map[string]int{}
	dups := 0
	for _, d := range ds {
		if seen[d.id]++; seen[d.id] > 1 {
			dups++
		}
	}
	return dups
}

// committedTotal sums the group's committed offsets of the defer topic over
// its partitions (none committed counts 0).
func committedTotal(t *testing.T, brokers, group string) int64 {
	t.Helper()
	c := sarama.NewConfig()
	c.Version = sarama.V3_6_0_0
	admin, err := sarama.NewClusterAdmin([]string{brokers}, c)
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close()
	res, err := admin.ListConsumerGroupOffsets(group, map[string][]int32{deferTopic: {0, 1, 2, 3}})
	if err != nil {
		t.Fatal(err)
	}
	var total int64
	for _, b := range res.Blocks[deferTopic] {
		if b.Offset > 0 {
			total += b.Offset
		}
	}
	return total
}

// sum adds up every series of a counter.
func (s metricsSnapshot) sum(name string) float64 {
	var total float64
	if fam := s[name]; fam != nil {
		for _, m := range fam.GetMetric() {
			total += m.GetCounter().GetValue()
		}
	}
	return total
}

// alive fails the test if the scheduler has exited.
func (p *proc) alive(t *testing.T, when string) {
	t.Helper()
	select {
	case <-p.Done():
		t.Fatalf("scheduler exited %s (code %d):\n%s", when, p.Cmd.ProcessState.ExitCode(), p.Logs())
	default:
	}
}

func needPglocal(t *testing.T) {
	t.Helper()
	if _, err := pglocal.Binaries(); err != nil {
		if os.Geteuid() != 0 {
			t.Skipf("no PostgreSQL server binaries and not root: %v", err)
		}
		t.Fatalf("running as root, so the server binaries should be installed (bash .ci/run does): %v", err)
	}
}

// While Postgres is down, records keep arriving: ingest stores none, so it
// commits no offset past what is stored, /readyz fails naming postgres, and
// the process stays up. Once Postgres is back, every record is ingested and
// delivered once, by itself.
func TestDegradePostgresDown(t *testing.T) {
	needPglocal(t)
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()
	// A cluster of our own: the shared test server must not go down.
	pg, err := pglocal.Start(ctx, pglocal.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pg.Stop(context.Background()) })
	brokers := broker(t)
	const group = "e2e-pg-down"
	p := start(t, serviceEnv(pg.URL("postgres"), brokers, group), "--migrate")
	pool, err := pgxpool.New(ctx, pg.URL("postgres"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	out := read(t, brokers, targetTopic)
	prod := producer(t, brokers)

	before := sendBatch(t, prod, "before", 40, 8, "0")
	out.until(t, 30*time.Second, "the records sent before the outage", deliveredAll(before))
	// Sent and finalized: nothing is in flight when the database goes.
	waitRows(t, pool, 10*time.Second, "SELECT count(*) FROM deferred_message", 0)

	stopPostgres(ctx, t, pg.URL("postgres"))
	waitReadyz(t, p, http.StatusServiceUnavailable, "postgres")
	during := sendBatch(t, prod, "during", 40, 8, "0")
	// Several auto-commit intervals (1 s): ingest read the records but must
	// not commit them, since they are not stored.
	for range 8 {
		time.Sleep(500 * time.Millisecond)
		p.alive(t, "while Postgres was down")
		if c := committedTotal(t, brokers, group); c > int64(len(before)) {
			t.Fatalf("committed offsets sum to %d while Postgres is down, past the %d records stored", c, len(before))
		}
	}
	if code, body := p.Get("/readyz"); code != http.StatusServiceUnavailable || !strings.Contains(body, "postgres") {
		t.Errorf("/readyz = %d %s while Postgres is down, want 503 naming postgres", code, body)
	}
	if got := len(out.all()); got != len(before) {
		t.Errorf("%d deliveries while Postgres was down, want the %d from before", got, len(before))
	}

	if err := pg.Restart(ctx); err != nil { // starts the stopped server
		t.Fatal(err)
	}
	waitReadyz(t, p, http.StatusOK, "")
	out.until(t, 60*time.Second, "the records sent during the outage", deliveredAll(before, during))
	waitRows(t, pool, 20*time.Second, "SELECT count(*) FROM deferred_message", 0)
	// Late duplicates would come within the lease; wait it out.
	time.Sleep(2 * time.Second)
	got := out.all()
	t.Logf("%d deliveries of %d records, %d duplicates", len(got), len(before)+len(during), duplicates(got))
	if d := duplicates(got); d != 0 {
		t.Errorf("%d duplicate deliveries; nothing was in flight during the outage, want 0", d)
	}
	if len(got) != len(before)+len(during) {
		t.Errorf("%d deliveries, want %d", len(got), len(before)+len(during))
	}
	waitUntil(t, 10*time.Second, "offsets committed past every record", func() (bool, string) {
		c := committedTotal(t, brokers, group)
		return c == int64(len(before)+len(during)), fmt.Sprintf("committed %d", c)
	})
	var stored int64
	if err := pool.QueryRow(ctx, "SELECT coalesce(sum(next_offset), 0) FROM ingest_offset").Scan(&stored); err != nil {
		t.Fatal(err)
	}
	if stored != int64(len(before)+len(during)) {
		t.Errorf("ingest_offset sums to %d, want %d", stored, len(before)+len(during))
	}
	p.stop()
}

// waitUntil polls cond until it holds.
func waitUntil(t *testing.T, within time.Duration, what string, cond func() (bool, string)) {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		ok, state := cond()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %v (%s)", what, within, state)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// waitConnecting waits until p's /readyz answers 503 with kafka failing
// "connecting" to brokers: start-up waits for the brokers.
func waitConnecting(t *testing.T, p *proc, brokers string) {
	t.Helper()
	waitUntil(t, 30*time.Second, "/readyz to say kafka connecting", func() (bool, string) {
		p.alive(t, "while waiting for Kafka")
		code, body := p.Get("/readyz")
		if code != http.StatusServiceUnavailable {
			return false, fmt.Sprintf("%d %s", code, body)
		}
		failing, _ := readyzBody(t, body)["failing"].(map[string]any)
		why, _ := failing["kafka"].(string)
		return strings.Contains(why, "connecting") && strings.Contains(why, brokers), body
	})
}

// gatedBroker starts a kfake broker behind a gate, with the defer and target
// topics. kfake advertises the address of its listener in metadata; a gated
// listener is that address, so every client connection, the scheduler's and
// the test's, goes through the gate.
func gatedBroker(t *testing.T) (string, *tcpproxy.Gate) {
	t.Helper()
	gate := &tcpproxy.Gate{}
	kc, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(4, deferTopic, targetTopic), kfake.ListenFn(gate.Listen))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(kc.Close)
	return kc.ListenAddrs()[0], gate
}

// While the broker is unreachable, dispatch backs off (a bounded number of
// publish attempts, not a spin), no lease is taken for longer than
// LEASE_DURATION, and /readyz fails naming kafka. Once it is back, the
// messages that fell due meanwhile go out, ingest resumes, nothing is lost.
func TestDegradeBrokerDown(t *testing.T) {
	brokers, gate := gatedBroker(t)
	db := pgtest.NewDB(t)
	ctx := t.Context()
	p := start(t, serviceEnv(db.URL, brokers, "e2e-broker-down"))
	out := read(t, brokers, targetTopic)
	prod := producer(t, brokers)

	before := sendBatch(t, prod, "before", 20, 5, "0")
	out.until(t, 30*time.Second, "the records sent before the outage", deliveredAll(before))
	// Due a few seconds from now: they fall due while the broker is away.
	const keys = 10
	due := sendBatch(t, prod, "due", 20, keys, "3s")
	waitRows(t, db.Pool, 10*time.Second, "SELECT count(*) FROM deferred_message WHERE state = 'pending'", len(due))
	m0 := scrapeMetrics(t, p)

	gate.Cut()
	waitReadyz(t, p, http.StatusServiceUnavailable, "kafka")
	const outage = 12 * time.Second // past the due time and two leases (6 s)
	for end := time.Now().Add(outage); time.Now().Before(end); {
		time.Sleep(250 * time.Millisecond)
		p.alive(t, "while the broker was down")
		var over int
		if err := db.Pool.QueryRow(ctx,
			"SELECT count(*) FROM deferred_key WHERE leased_until > now() + interval '6 seconds 500 milliseconds'").Scan(&over); err != nil {
			t.Fatal(err)
		}
		if over > 0 {
			t.Fatalf("%d keys leased for longer than LEASE_DURATION", over)
		}
	}
	// A failed publish gives its key back at once, with a back-off in
	// leased_until (leased_by NULL) that doubles from 100 ms per consecutive
	// failure (sql/queries/dispatch_release.sql): so each key was tried about
	// log2(outage/100ms) times, and only a round in progress holds a lease.
	var held, maxFailures int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE leased_by IS NOT NULL AND leased_until > now()),
		coalesce(max(failures), 0) FROM deferred_key`).Scan(&held, &maxFailures); err != nil {
		t.Fatal(err)
	}
	m1 := scrapeMetrics(t, p)
	attempts := m1.sum(metrics.DispatchPublishErrors) - m0.sum(metrics.DispatchPublishErrors)
	r0, _ := m0.histogram(metrics.DispatchRoundDuration)
	r1, _ := m1.histogram(metrics.DispatchRoundDuration)
	t.Logf("during a %v outage: %v failed publishes of %d messages, %d dispatch rounds, at most %d consecutive failures per key, %d keys leased at the end",
		outage, attempts, len(due), r1-r0, maxFailures, held)
	if attempts < 1 || maxFailures < 1 {
		t.Errorf("no failed publish during the outage although %d messages fell due", len(due))
	}
	// log2(12 s / 100 ms) is about 7; a spin would be thousands.
	const perKey = 10
	if maxFailures > perKey {
		t.Errorf("a key failed %d times in a row in %v, more than %d: it does not back off", maxFailures, outage, perKey)
	}
	if limit := float64(len(due) * perKey); attempts > limit {
		t.Errorf("%v failed publishes in %v for %d messages, more than %v: dispatch spins", attempts, outage, len(due), limit)
	}
	if held > keys {
		t.Errorf("%d keys leased at the end of the outage, more than the %d due", held, keys)
	}
	if got := len(out.all()); got != len(before) {
		t.Errorf("%d deliveries during the outage, want the %d from before", got, len(before))
	}

	gate.Restore()
	waitReadyz(t, p, http.StatusOK, "")
	after := sendBatch(t, prod, "after", 20, 5, "0")
	out.until(t, 60*time.Second, "every record after the outage", deliveredAll(before, due, after))
	waitRows(t, db.Pool, 20*time.Second, "SELECT count(*) FROM deferred_key", 0)
	got := out.all()
	t.Logf("%d deliveries of %d records, %d duplicates", len(got), len(before)+len(due)+len(after), duplicates(got))
	// A publish cut mid-flight may have reached the broker unacknowledged
	// and be sent again (at-least-once): at most one message per key.
	if d := duplicates(got); d > keys {
		t.Errorf("%d duplicate deliveries, more than one per key (%d)", d, keys)
	}
	p.stop()
}

// A broker that stops answering (a hung process, a network that drops
// packets) must not hold a stopping scheduler past SHUTDOWN_TIMEOUT, after
// which Kubernetes kills it anyway: the consumer group's last offset commit
// and its leave request each wait for the consumer's read timeout (25 s).
// Nothing is lost by not waiting: the rows stored before the stop are
// delivered by the next process.
func TestShutdownWithinTimeoutWhenBrokerStalls(t *testing.T) {
	brokers, gate := gatedBroker(t)
	db := pgtest.NewDB(t)
	const shutdown = 3 * time.Second
	env := append(serviceEnv(db.URL, brokers, "e2e-broker-stall"), "SHUTDOWN_TIMEOUT="+shutdown.String())
	p := start(t, env)
	prod := producer(t, brokers)
	// Due once the next process runs: stored by this one, sent by that one.
	due := sendBatch(t, prod, "stall", 20, 5, "6s")
	waitRows(t, db.Pool, 10*time.Second, "SELECT count(*) FROM deferred_message WHERE state = 'pending'", len(due))

	gate.Stall()
	began := time.Now()
	p.Cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.Done():
	case <-time.After(shutdown + 30*time.Second):
		t.Fatalf("scheduler still running %v after SIGTERM with SHUTDOWN_TIMEOUT=%v:\n%s", time.Since(began), shutdown, p.Logs())
	}
	took := time.Since(began)
	t.Logf("stopped %v after SIGTERM, with the broker stalled and SHUTDOWN_TIMEOUT=%v", took.Round(time.Millisecond), shutdown)
	// SHUTDOWN_TIMEOUT, one second for the group (minGroupClose), and
	// slack for closing the rest on a busy machine; waiting for the group
	// instead takes the consumer's read timeout (25 s) at least once.
	if limit := shutdown + 5*time.Second; took > limit {
		t.Errorf("stopped %v after SIGTERM, more than %v:\n%s", took, limit, p.Logs())
	}
	if code := p.Cmd.ProcessState.ExitCode(); code != 0 {
		t.Errorf("exit code %d, want 0:\n%s", code, p.Logs())
	}
	if logs := p.Logs(); !strings.Contains(logs, "consumer group did not close within SHUTDOWN_TIMEOUT") {
		t.Errorf("no word of the consumer group left behind in the logs:\n%s", logs)
	}

	gate.Restore()
	out := read(t, brokers, targetTopic)
	next := start(t, env)
	out.until(t, 60*time.Second, "the records stored before the stop", deliveredAll(due))
	next.stop()
}

// A record the database refuses (here a trigger raises for it) neither
// stops ingest nor goes missing: it is stored as rejected with reason
// store_failed, and the records around it are delivered. A record that
// cannot be stored even so holds its partition, /readyz fails naming
// ingest, and it goes through once the database takes it.
func TestDegradePoisonRecord(t *testing.T) {
	db := pgtest.NewDB(t)
	ctx := t.Context()
	brokers := broker(t)
	trigger := func(cond string) {
		t.Helper()
		for _, q := range []string{
			`CREATE OR REPLACE FUNCTION poison_e2e() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF ` + cond + ` THEN
        RAISE EXCEPTION 'refused record %', convert_from(NEW.value, 'UTF8');
    END IF;
    RETURN NEW;
END $$`,
			`CREATE OR REPLACE TRIGGER poison_e2e BEFORE INSERT ON deferred_message FOR EACH ROW EXECUTE FUNCTION poison_e2e()`,
		} {
			if _, err := db.Pool.Exec(ctx, q); err != nil {
				t.Fatalf("%s: %v", q, err)
			}
		}
	}
	trigger(`NEW.value = convert_to('poison', 'UTF8') AND NEW.state <> 'rejected'`)
	p := start(t, serviceEnv(db.URL, brokers, "e2e-poison"))
	out := read(t, brokers, targetTopic)
	prod := producer(t, brokers)

	rec := func(v string) *sarama.ProducerMessage {
		return deferRecord("same-key", v, "defer.target", targetTopic, "defer.delay", "0")
	}
	if err := prod.SendMessages([]*sarama.ProducerMessage{rec("good-1"), rec("poison"), rec("good-2")}); err != nil {
		t.Fatal(err)
	}
	out.until(t, 30*time.Second, "the records around the refused one", deliveredAll([]string{"good-1", "good-2"}))
	var state, reason string
	if err := db.Pool.QueryRow(ctx, "SELECT state, reason FROM deferred_message WHERE value = 'poison'").Scan(&state, &reason); err != nil {
		t.Fatal(err)
	}
	if state != "rejected" || !strings.HasPrefix(reason, "store_failed: ") || !strings.Contains(reason, "refused record poison") {
		t.Errorf("refused record stored as %s (%s), want rejected with store_failed and the database's error", state, reason)
	}
	waitMetrics(t, p, 10*time.Second, "store_failed counted", func(s metricsSnapshot) bool {
		return s.is(1, metrics.IngestRejected, "reason", "store_failed")
	})
	if code, body := p.Get("/readyz"); code != http.StatusOK {
		t.Errorf("/readyz = %d %s after a refused record was stored as rejected", code, body)
	}

	// Refused even as rejected: the partition waits, and says so.
	trigger(`NEW.value = convert_to('stuck', 'UTF8')`)
	if err := prod.SendMessages([]*sarama.ProducerMessage{rec("stuck"), rec("good-3")}); err != nil {
		t.Fatal(err)
	}
	waitReadyz(t, p, http.StatusServiceUnavailable, "ingest")
	time.Sleep(time.Second)
	p.alive(t, "with a record it cannot store")
	for _, d := range out.all() {
		if d.value == "stuck" || d.value == "good-3" {
			t.Errorf("%s delivered although it could not be stored", d.value)
		}
	}
	if _, err := db.Pool.Exec(ctx, "DROP TRIGGER poison_e2e ON deferred_message"); err != nil {
		t.Fatal(err)
	}
	out.until(t, 30*time.Second, "the once stuck records", deliveredAll([]string{"stuck", "good-3"}))
	waitReadyz(t, p, http.StatusOK, "")
	got := out.all()
	order := make([]string, 0, len(got))
	for _, d := range got {
		order = append(order, d.value)
	}
	if want := "good-1 good-2 stuck good-3"; strings.Join(order, " ") != want {
		t.Errorf("deliveries %v, want %s", order, want)
	}
	p.stop()
}

// While start-up waits for the brokers, /readyz answers 503 naming kafka
// ("connecting"), and the scheduler becomes ready when a broker appears.
func TestReadyzWhileConnectingToKafka(t *testing.T) {
	db := pgtest.NewDB(t)
	brokers := freeAddr(t) // nothing listens there yet
	p := launch(t, serviceEnv(db.URL, brokers, "e2e-connecting"))
	waitConnecting(t, p, brokers)
	if code, _ := p.Get("/healthz"); code != http.StatusOK {
		t.Errorf("/healthz = %d while connecting, want 200", code)
	}
	_, portText, _ := net.SplitHostPort(brokers)
	port, _ := strconv.Atoi(portText)
	kc, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.Ports(port), kfake.SeedTopics(4, deferTopic, targetTopic))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(kc.Close)
	waitReadyz(t, p, http.StatusOK, "")
	p.stop()
}

// `run` refuses a schema it does not match, exiting non-zero with a message
// that says what is wrong and what to do: a database migrated by a newer
// release (refused by run, run --migrate and migrate alike) and, without
// --migrate, one that lacks migrations.
func TestRunRefusesMismatchedSchema(t *testing.T) {
	newer := pgtest.NewDB(t)
	if _, err := newer.Pool.Exec(t.Context(), "INSERT INTO scheduler_migration (version, name) VALUES (9999, 'from_the_future')"); err != nil {
		t.Fatal(err)
	}
	emptyURL, _ := emptyDB(t)
	tooNew := []string{"database schema is newer than this binary", "migration 9999", "run a newer release"}
	for _, tc := range []struct {
		name string
		url  string
		args []string
		want []string
	}{
		{"newer/run", newer.URL, []string{"run"}, tooNew},
		{"newer/run --migrate", newer.URL, []string{"run", "--migrate"}, tooNew},
		{"newer/migrate", newer.URL, []string{"migrate"}, tooNew},
		{"unmigrated/run", emptyURL, []string{"run"}, []string{"the database lacks", "run `scheduler migrate` or start with --migrate"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
			defer cancel()
			cmd := exec.CommandContext(ctx, binary(t), tc.args...)
			// No broker: the schema is checked before Kafka is waited for.
			cmd.Env = append(serviceEnv(tc.url, freeAddr(t), "e2e-schema"), "HTTP_ADDR="+freeAddr(t))
			out, err := cmd.CombinedOutput()
			if ctx.Err() != nil {
				t.Fatalf("did not exit within 30s:\n%s", out)
			}
			if err == nil || cmd.ProcessState.ExitCode() == 0 {
				t.Fatalf("exit code 0:\n%s", out)
			}
			for _, want := range tc.want {
				if !strings.Contains(string(out), want) {
					t.Errorf("output lacks %q:\n%s", want, out)
				}
			}
		})
	}
}
