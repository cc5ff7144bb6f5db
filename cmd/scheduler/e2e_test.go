package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/url"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/deferq/scheduler/internal/pgtest"
	"github.com/deferq/scheduler/migrations"
)

// emptyDB creates a database with nothing in it, for tests of migrate.
func emptyDB(t *testing.T) (string, *pgxpool.Pool) {
	t.Helper()
	ctx := context.Background()
	admin, err := pgxpool.New(ctx, pgtest.AdminURL(t))
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close()
	name := fmt.Sprintf("e2e_%d", rand.Uint32())
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+name); err != nil {
		t.Fatal(err)
	}
	u, err := url.Parse(pgtest.AdminURL(t))
	if err != nil {
		t.Fatal(err)
	}
	u.Path = "/" + name
	pool, err := pgxpool.New(ctx, u.String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		pool.Close()
		a, err := pgxpool.New(context.Background(), pgtest.AdminURL(t))
		if err == nil {
			a.Exec(context.Background(), "DROP DATABASE IF EXISTS "+name+" WITH (FORCE)")
			a.Close()
		}
	})
	return u.String(), pool
}

func kcat(t *testing.T) string {
	t.Helper()
	path, err := exec.LookPath("kcat")
	if err != nil {
		t.Fatal("kcat is not installed (Debian package kcat); .ci/run installs it")
	}
	return path
}

// The built binary, driven by the real kcat client: migrate a fresh
// database (twice at once), run, produce with kcat, read the retry topic
// with kcat, stop with SIGTERM.
func TestKcatEndToEnd(t *testing.T) {
	kc := kcat(t)
	brokers := broker(t)
	dbURL, pool := emptyDB(t)
	env := serviceEnv(dbURL, brokers, "e2e-kcat")

	// Two replicas migrating at once: both succeed, each migration once.
	var wg sync.WaitGroup
	outs := make([]string, 2)
	for i := range outs {
		wg.Go(func() {
			cmd := exec.Command(binary(t), "migrate")
			cmd.Env = env
			out, err := cmd.CombinedOutput()
			if err != nil {
				t.Errorf("migrate %d: %v\n%s", i, err, out)
			}
			outs[i] = string(out)
		})
	}
	wg.Wait()
	all, err := migrations.All()
	if err != nil {
		t.Fatal(err)
	}
	if applied := fmt.Sprintf("%d of the scheduler's", len(all)); !strings.Contains(outs[0]+outs[1], applied) || !strings.Contains(outs[0]+outs[1], "0 of the scheduler's") {
		t.Fatalf("want one migrate to apply and the other to find nothing to do:\n%s\n%s", outs[0], outs[1])
	}

	p := start(t, env)
	if code, body := p.Get("/healthz"); code != 200 || strings.TrimSpace(body) != "ok" {
		t.Fatalf("/healthz = %d %q", code, body)
	}

	produce := func(key, value string, headers ...string) {
		t.Helper()
		args := []string{"-b", brokers, "-P", "-t", deferTopic, "-k", key}
		for _, h := range headers {
			args = append(args, "-H", h)
		}
		cmd := exec.Command(kc, args...)
		cmd.Stdin = strings.NewReader(value + "\n")
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("kcat produce: %v\n%s", err, out)
		}
	}
	// #2 and #3 are due before #1 but must come out after it.
	produce("order-1", "first", "defer.target=orders.retry", "defer.delay=1500ms", "trace=t-1", "defer.error.class=Timeout")
	produce("order-1", "second", "defer.target=orders.retry", "defer.delay=0", "trace=t-2")
	produce("order-1", "third", "defer.target=orders.retry", "defer.delay=200ms", "trace=t-3")
	produce("order-9", "bad", "defer.delay=1s")                                     // no target
	produce("order-8", "elsewhere", "defer.target=payments.retry", "defer.delay=0") // not allowed

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, kc, "-b", brokers, "-C", "-t", targetTopic, "-o", "beginning", "-c", "3",
		"-f", "%p|%k|%s|%h\n").Output()
	if err != nil {
		t.Fatalf("kcat consume: %v\n%s", err, out)
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	if len(lines) != 3 {
		t.Fatalf("kcat read %d records, want 3:\n%s", len(lines), out)
	}
	want := sarama.NewMurmur2Partitioner(targetTopic)
	wantPart, _ := want.Partition(&sarama.ProducerMessage{Key: sarama.StringEncoder("order-1")}, 4)
	for i, value := range []string{"first", "second", "third"} {
		f := strings.SplitN(lines[i], "|", 4)
		if len(f) != 4 {
			t.Fatalf("kcat line %q", lines[i])
		}
		if f[1] != "order-1" || f[2] != value {
			t.Fatalf("record %d = key %q value %q, want order-1 %q (per-key order)", i, f[1], f[2], value)
		}
		if f[0] != strconv.Itoa(int(wantPart)) {
			t.Fatalf("partition %s, want %d (murmur2, as the Java client)", f[0], wantPart)
		}
		h := f[3]
		for _, must := range []string{"trace=t-" + strconv.Itoa(i+1), "defer.target=orders.retry", "defer.attempt=1", "defer.id=", "defer.seq=", "defer.scheduled-at="} {
			if !strings.Contains(h, must) {
				t.Fatalf("headers %q lack %q", h, must)
			}
		}
		if strings.Contains(h, "defer.delay") {
			t.Fatalf("headers %q still carry the one-shot defer.delay", h)
		}
	}

	waitRows(t, pool, 10*time.Second, "SELECT count(*) FROM deferred_message WHERE state = 'rejected'", 2)
	var reasons []string
	rows, _ := pool.Query(context.Background(), "SELECT reason FROM deferred_message WHERE state = 'rejected' ORDER BY reason")
	reasons, err = pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(reasons[0], "missing_target:") || !strings.HasPrefix(reasons[1], "target_not_allowed:") {
		t.Fatalf("rejection reasons %q", reasons)
	}
	waitRows(t, pool, 10*time.Second, "SELECT count(*) FROM deferred_message WHERE state = 'pending'", 0)
	p.stop()
	if !strings.Contains(p.Logs(), "stopped") {
		t.Fatalf("no clean stop in the logs:\n%s", p.Logs())
	}
}

// Kill the service with SIGKILL at random points of ingest and dispatch and
// start it again: every message is republished at least once, duplicates
// carry the same defer.id, and first deliveries keep per-key order.
func TestNoLossAcrossCrashes(t *testing.T) {
	brokers := broker(t)
	db := pgtest.NewDB(t)
	env := serviceEnv(db.URL, brokers, "e2e-crash")
	r := read(t, brokers, targetTopic)
	prod := producer(t, brokers)
	rng := rand.New(rand.NewPCG(1, 2))

	const keys, perKey = 40, 50 // 2000 messages
	next := make([]int, keys)
	produceChunk := func(n int) {
		var batch []*sarama.ProducerMessage
		for range n {
			k := rng.IntN(keys)
			if next[k] == perKey {
				continue
			}
			key := fmt.Sprintf("order-%d", k)
			batch = append(batch, deferRecord(key, fmt.Sprintf("%s:%d", key, next[k]),
				"defer.target", targetTopic, "defer.delay", fmt.Sprintf("%dms", rng.IntN(800))))
			next[k]++
		}
		if err := prod.SendMessages(batch); err != nil {
			t.Fatal(err)
		}
	}
	total := func() (n int) {
		for _, c := range next {
			n += c
		}
		return n
	}

	p := start(t, env)
	kills := 0
	for round := range 4 {
		produceChunk(700)
		time.Sleep(time.Duration(150+rng.IntN(600)) * time.Millisecond)
		p.Kill()
		kills++
		t.Logf("kill %d: %d produced, %d delivered so far", round+1, total(), len(r.all()))
		p = start(t, env)
	}
	for k := range keys {
		for next[k] < perKey {
			key := fmt.Sprintf("order-%d", k)
			if _, _, err := prod.SendMessage(deferRecord(key, fmt.Sprintf("%s:%d", key, next[k]),
				"defer.target", targetTopic, "defer.delay", "0")); err != nil {
				t.Fatal(err)
			}
			next[k]++
		}
	}
	sent := total()
	got := r.until(t, 90*time.Second, "every message delivered", func(ds []delivery) bool {
		seen := map[string]bool{}
		for _, d := range ds {
			seen[d.value] = true
		}
		return len(seen) == sent
	})
	waitRows(t, db.Pool, 30*time.Second, "SELECT count(*) FROM deferred_message", 0)
	p.stop()

	ids := map[string]string{}
	firsts := map[string][]int{}
	dups := 0
	for _, d := range got {
		if id, ok := ids[d.value]; ok {
			dups++
			if id != d.id {
				t.Fatalf("%s delivered with defer.id %s and %s", d.value, id, d.id)
			}
			continue
		}
		ids[d.value] = d.id
		i, _ := strconv.Atoi(d.value[strings.IndexByte(d.value, ':')+1:])
		firsts[d.key] = append(firsts[d.key], i)
	}
	for key, seq := range firsts {
		for i, v := range seq {
			if v != i {
				t.Fatalf("key %s first deliveries out of order: %v", key, seq)
			}
		}
	}
	t.Logf("sent %d, delivered %d distinct, %d duplicates (same defer.id), %d kills", sent, len(ids), dups, kills)
}

// Two service instances on one database, many keys, later messages due
// before earlier ones: per-key order holds and no message is published twice.
func TestTwoInstancesKeepPerKeyOrder(t *testing.T) {
	brokers := broker(t)
	db := pgtest.NewDB(t)
	env := append(serviceEnv(db.URL, brokers, "e2e-two"), "DISPATCH_LOOP_DURATION=1s", "DISPATCH_LOOPS=4")
	r := read(t, brokers, targetTopic)
	a := start(t, env)
	b := start(t, env)

	const keys, perKey = 100, 20
	prod := producer(t, brokers)
	var batch []*sarama.ProducerMessage
	for i := range perKey {
		for k := range keys {
			key := fmt.Sprintf("acct-%d", k)
			// Message i is due (perKey-i)*40ms from now: the last is due first.
			batch = append(batch, deferRecord(key, fmt.Sprintf("%s:%d", key, i),
				"defer.target", targetTopic, "defer.delay", fmt.Sprintf("%dms", (perKey-i)*40)))
		}
	}
	if err := prod.SendMessages(batch); err != nil {
		t.Fatal(err)
	}
	r.until(t, 60*time.Second, "all delivered", atLeast(keys*perKey))
	waitRows(t, db.Pool, 10*time.Second, "SELECT count(*) FROM deferred_message", 0)
	time.Sleep(500 * time.Millisecond)
	got := r.all()

	seen := map[string]bool{}
	order := map[string]int{}
	for _, d := range got {
		if seen[d.id] {
			t.Fatalf("defer.id %s (%s) published twice", d.id, d.value)
		}
		seen[d.id] = true
		i, _ := strconv.Atoi(d.value[strings.IndexByte(d.value, ':')+1:])
		if i != order[d.key] {
			t.Fatalf("key %s: got message %d, want %d", d.key, i, order[d.key])
		}
		order[d.key]++
	}
	if len(got) != keys*perKey {
		t.Fatalf("%d deliveries, want %d", len(got), keys*perKey)
	}
	var instances int
	if err := db.Pool.QueryRow(context.Background(),
		"SELECT count(DISTINCT attempted_by[1]) FROM river_job WHERE kind = 'scheduler_dispatch_loop'").Scan(&instances); err != nil {
		t.Fatal(err)
	}
	if instances < 2 {
		t.Fatalf("dispatch loops ran on %d instance(s); both should share the work", instances)
	}
	a.stop()
	b.stop()
}

// The operator statements of docs/design.md section 3.6 take effect without a
// restart, and a re-deferral carrying defer.seq returns to the head of its key.
func TestOperatorSQLAndRedeferral(t *testing.T) {
	brokers := broker(t)
	db := pgtest.NewDB(t)
	env := serviceEnv(db.URL, brokers, "e2e-ops")
	r := read(t, brokers, targetTopic)
	p := start(t, env)
	prod := producer(t, brokers)
	ctx := context.Background()
	send := func(key, value string, headers ...string) {
		t.Helper()
		if _, _, err := prod.SendMessage(deferRecord(key, value, append([]string{"defer.target", targetTopic}, headers...)...)); err != nil {
			t.Fatal(err)
		}
	}
	exec := func(sql string, args ...any) {
		t.Helper()
		if _, err := db.Pool.Exec(ctx, sql, args...); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	valueArrived := func(v string) func([]delivery) bool {
		return func(ds []delivery) bool {
			for _, d := range ds {
				if d.value == v {
					return true
				}
			}
			return false
		}
	}

	t.Run("expedite reaches the topic within 1s", func(t *testing.T) {
		send("order-42", "expedite-me", "defer.delay", "1h")
		waitRows(t, db.Pool, 10*time.Second, "SELECT count(*) FROM deferred_message WHERE business_key = 'order-42'", 1)
		start := time.Now()
		exec("UPDATE deferred_message SET next_run_at = now() WHERE business_key = 'order-42'")
		r.until(t, 5*time.Second, "expedited message", valueArrived("expedite-me"))
		if took := time.Since(start); took > time.Second {
			t.Fatalf("expedited message arrived after %v, want within 1s", took)
		}
	})

	t.Run("cancel releases the next message of the key", func(t *testing.T) {
		send("order-43", "cancel-me", "defer.delay", "1h")
		send("order-43", "held", "defer.delay", "0")
		waitRows(t, db.Pool, 10*time.Second, "SELECT count(*) FROM deferred_message WHERE business_key = 'order-43'", 2)
		time.Sleep(500 * time.Millisecond)
		if valueArrived("held")(r.all()) {
			t.Fatal("a message went out before the earlier message of its key")
		}
		var id int64
		if err := db.Pool.QueryRow(ctx, "SELECT id FROM deferred_message WHERE value = 'cancel-me'").Scan(&id); err != nil {
			t.Fatal(err)
		}
		exec("DELETE FROM deferred_message WHERE id = $1", id)
		r.until(t, 5*time.Second, "released message", valueArrived("held"))
		if valueArrived("cancel-me")(r.all()) {
			t.Fatal("the cancelled message was published")
		}
	})

	t.Run("replay of a parked row republishes it", func(t *testing.T) {
		send("order-44", "parked-one", "defer.delay", "1h")
		waitRows(t, db.Pool, 10*time.Second, "SELECT count(*) FROM deferred_message WHERE business_key = 'order-44'", 1)
		exec("UPDATE deferred_message SET state = 'parked', reason = 'operator' WHERE business_key = 'order-44'")
		exec("UPDATE deferred_message SET state = 'pending', next_run_at = now() WHERE state = 'parked' AND target_topic = $1", targetTopic)
		r.until(t, 5*time.Second, "replayed message", valueArrived("parked-one"))
	})

	t.Run("re-deferral with defer.seq goes back to the head of its key", func(t *testing.T) {
		send("order-45", "m1", "defer.delay", "0")
		send("order-45", "m2", "defer.delay", "1500ms")
		first := r.until(t, 5*time.Second, "m1", valueArrived("m1"))
		var out delivery
		for _, d := range first {
			if d.value == "m1" {
				out = d
			}
		}
		// The consumer fails again and forwards the record, with its headers,
		// back to the defer topic with a new delay.
		fwd := []string{"defer.delay", "2500ms"}
		for _, h := range []string{"defer.id", "defer.seq", "defer.attempt", "defer.error.class"} {
			if v, ok := out.headers[h]; ok {
				fwd = append(fwd, h, v)
			}
		}
		send("order-45", "m1", fwd...)
		ds := r.until(t, 10*time.Second, "m2 after the re-deferred m1", func(ds []delivery) bool {
			return valueArrived("m2")(ds)
		})
		var values []string
		for _, d := range ds {
			if d.key == "order-45" {
				values = append(values, d.value+"@"+d.headers["defer.attempt"])
			}
		}
		if strings.Join(values, ",") != "m1@1,m1@2,m2@1" {
			t.Fatalf("order-45 deliveries %v, want m1@1,m1@2,m2@1: the re-deferred m1 keeps its place ahead of m2", values)
		}
		if ds[len(ds)-2].headers["defer.seq"] != out.headers["defer.seq"] {
			t.Fatalf("re-deferral lost its seq: %q then %q", out.headers["defer.seq"], ds[len(ds)-2].headers["defer.seq"])
		}
	})
	p.stop()
}

// /readyz reports which check fails.
func TestReadyzReportsFailingCheck(t *testing.T) {
	brokers := broker(t)
	db := pgtest.NewDB(t)
	p := start(t, serviceEnv(db.URL, brokers, "e2e-ready"))
	code, body := p.Get("/readyz")
	if code != 200 || readyzBody(t, body)["status"] != "ready" {
		t.Fatalf("/readyz = %d %s", code, body)
	}
	// A migration the binary does not have: not ready, says why.
	if _, err := db.Pool.Exec(context.Background(), "INSERT INTO scheduler_migration (version, name) VALUES (9999, 'future')"); err != nil {
		t.Fatal(err)
	}
	code, body = p.Get("/readyz")
	failing, _ := readyzBody(t, body)["failing"].(map[string]any)
	if code != 503 || failing["migrations"] == nil {
		t.Fatalf("/readyz = %d %s, want 503 naming migrations", code, body)
	}
	if _, err := db.Pool.Exec(context.Background(), "DELETE FROM scheduler_migration WHERE version = 9999"); err != nil {
		t.Fatal(err)
	}
	if code, body = p.Get("/readyz"); code != 200 {
		t.Fatalf("/readyz did not recover: %d %s", code, body)
	}
	// A migration missing (pending) is as bad as one too new.
	var name string
	if err := db.Pool.QueryRow(context.Background(),
		"DELETE FROM scheduler_migration WHERE version = 1 RETURNING name").Scan(&name); err != nil {
		t.Fatal(err)
	}
	code, body = p.Get("/readyz")
	failing, _ = readyzBody(t, body)["failing"].(map[string]any)
	if code != 503 || !strings.Contains(fmt.Sprint(failing["migrations"]), "pending") {
		t.Fatalf("/readyz = %d %s, want 503 naming pending migrations", code, body)
	}
	if _, err := db.Pool.Exec(context.Background(), "INSERT INTO scheduler_migration (version, name) VALUES (1, $1)", name); err != nil {
		t.Fatal(err)
	}
	if code, body = p.Get("/readyz"); code != 200 {
		t.Fatalf("/readyz did not recover: %d %s", code, body)
	}
	p.stop()
}
