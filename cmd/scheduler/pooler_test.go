package main

import (
	"bytes"
	"context"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/cookiejar"
	"net/url"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/deferq/scheduler/internal/keystate"
	"github.com/deferq/scheduler/internal/opscli/opsjson"
	"github.com/deferq/scheduler/internal/pgbouncertest"
	"github.com/deferq/scheduler/internal/pgtest"
	"github.com/deferq/scheduler/internal/schedproc"
	"github.com/deferq/scheduler/migrations"
)

// The scheduler behind PgBouncer (Debian's 1.18, which passes on few
// startup parameters and, in transaction mode, hands a client's
// transactions to whichever server session is free): DATABASE_URL points
// at the pooler, DIRECT_DATABASE_URL (optional) at the server itself, for
// what needs a session of its own (migrations' advisory lock, LISTEN).

// pausedTopic is a target the transaction-mode test pauses and resumes.
const pausedTopic = "orders.paused"

// poolerTestEnv is serviceEnv with a pool small enough for several
// replicas, a session-mode pooler and parallel tests on one server, and
// the dispatch loops spread: no replica runs more than 2 of the 4.
func poolerTestEnv(dbURL, brokers, group string, more ...string) []string {
	return append(append(serviceEnv(dbURL, brokers, group), "DB_MAX_CONNS=8", "DISPATCH_LOOP_DURATION=1s",
		"DISPATCH_LOOPS=4", "DISPATCH_WORKERS=2"), more...)
}

// schedulerCmd runs the scheduler binary with args and exactly env (PATH
// added), and returns its exit code, stdout and stderr.
func schedulerCmd(t *testing.T, env []string, args ...string) (int, string, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, binary(t), args...)
	cmd.Env = append(slices.Clone(env), "PATH="+os.Getenv("PATH"))
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	if _, exited := err.(*exec.ExitError); err != nil && !exited {
		// Errorf, not Fatalf: callers may run it on goroutines of their own.
		t.Errorf("scheduler %s: %v", strings.Join(args, " "), err)
		return -1, stdout.String(), stderr.String()
	}
	return cmd.ProcessState.ExitCode(), stdout.String(), stderr.String()
}

// poolerServerPIDs returns the process ids of the server sessions the
// pooler holds (SHOW SERVERS on its admin console: adminUser must be in its
// admin_users).
func poolerServerPIDs(t *testing.T, b *pgbouncertest.Bouncer, serverURL, adminUser string) map[int]bool {
	t.Helper()
	u, err := url.Parse(b.URL(t, serverURL))
	if err != nil {
		t.Fatal(err)
	}
	u.Path = "/pgbouncer"
	u.User = url.User(adminUser)
	q := u.Query()
	q.Set("default_query_exec_mode", "simple_protocol")
	u.RawQuery = q.Encode()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, u.String())
	if err != nil {
		t.Fatalf("pgbouncer admin console: %v\n%s", err, b.Log())
	}
	defer conn.Close(ctx)
	rows, err := conn.Query(ctx, "SHOW SERVERS")
	if err != nil {
		t.Fatalf("SHOW SERVERS: %v", err)
	}
	defer rows.Close()
	col := -1
	for i, f := range rows.FieldDescriptions() {
		if f.Name == "remote_pid" {
			col = i
		}
	}
	if col < 0 {
		t.Fatalf("SHOW SERVERS has no column remote_pid: %v", rows.FieldDescriptions())
	}
	pids := map[int]bool{}
	for rows.Next() {
		pid, err := strconv.Atoi(string(rows.RawValues()[col]))
		if err != nil {
			t.Fatalf("SHOW SERVERS remote_pid %q: %v", rows.RawValues()[col], err)
		}
		pids[pid] = true
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return pids
}

// listenSession is a server session whose last statement was a LISTEN.
type listenSession struct{ user, app string }

// listenSessions returns the sessions on database dbName whose last
// statement was a LISTEN, by process id.
func listenSessions(t *testing.T, admin *pgxpool.Pool, dbName string) map[int]listenSession {
	t.Helper()
	rows, err := admin.Query(t.Context(), `SELECT pid, usename, application_name FROM pg_stat_activity
		WHERE datname = $1 AND query ILIKE 'LISTEN %'`, dbName)
	if err != nil {
		t.Fatal(err)
	}
	out := map[int]listenSession{}
	for rows.Next() {
		var pid int
		var s listenSession
		if err := rows.Scan(&pid, &s.user, &s.app); err != nil {
			t.Fatal(err)
		}
		out[pid] = s
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

func dbName(t *testing.T, dbURL string) string {
	t.Helper()
	return strings.TrimPrefix(mustURL(t, dbURL).Path, "/")
}

// firstsInOrder fails the test unless every value of values was delivered
// at least once, and per key the first deliveries came in the order of
// the value's number ("key:n").
func firstsInOrder(t *testing.T, got []delivery, values []string) {
	t.Helper()
	want := map[string]bool{}
	for _, v := range values {
		want[v] = true
	}
	seen := map[string]bool{}
	next := map[string]int{}
	for _, d := range got {
		if !want[d.value] || seen[d.value] {
			continue
		}
		seen[d.value] = true
		i := strings.LastIndexByte(d.value, ':')
		n, err := strconv.Atoi(d.value[i+1:])
		if err != nil {
			t.Fatalf("unexpected delivery %q", d.value)
		}
		if n != next[d.key] {
			t.Fatalf("key %s: first delivery of message %d while %d was expected next (per-key order)", d.key, n, next[d.key])
		}
		next[d.key]++
	}
	if len(seen) != len(values) {
		t.Fatalf("%d of %d records delivered", len(seen), len(values))
	}
}

// orderedBatch is keys x perKey records to targetTopic, keyed prefix-k,
// valued prefix-k:i, the later ones of a key due first.
func orderedBatch(prefix string, keys, perKey int) ([]*sarama.ProducerMessage, []string) {
	var msgs []*sarama.ProducerMessage
	var values []string
	for i := range perKey {
		for k := range keys {
			key := fmt.Sprintf("%s-%d", prefix, k)
			v := fmt.Sprintf("%s:%d", key, i)
			values = append(values, v)
			msgs = append(msgs, deferRecord(key, v, "defer.target", targetTopic,
				"defer.delay", fmt.Sprintf("%dms", (perKey-i)*30)))
		}
	}
	return msgs, values
}

func valueDelivered(v string) func([]delivery) bool {
	return func(ds []delivery) bool {
		return slices.ContainsFunc(ds, func(d delivery) bool { return d.value == v })
	}
}

// askKeyState sends the key-state query (POST /v1/key-state) to a
// replica's HTTP_ADDR and returns its answer by key.
func askKeyState(t *testing.T, addr, group string, keys ...string) map[string]keystate.State {
	t.Helper()
	body, err := json.Marshal(keystate.Request{Group: group, Keys: keys, WaitMillis: 5000})
	if err != nil {
		t.Fatal(err)
	}
	client := &http.Client{Timeout: 30 * time.Second}
	resp, err := client.Post("http://"+addr+keystate.Path, "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatalf("POST %s: %v", keystate.Path, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("POST %s to %s: %d %s", keystate.Path, addr, resp.StatusCode, b)
	}
	var r keystate.Response
	if err := json.Unmarshal(b, &r); err != nil {
		t.Fatalf("key-state answer %s: %v", b, err)
	}
	out := map[string]keystate.State{}
	for _, s := range r.Keys {
		out[s.Key] = s
	}
	return out
}

// consoleClient is a person's browser without the browser: a cookie jar
// that does not follow redirects.
type consoleClient struct {
	t    *testing.T
	base string
	http *http.Client
	csrf string
}

func (c *consoleClient) do(method, path string, form url.Values) (int, string) {
	c.t.Helper()
	var body io.Reader
	if form != nil {
		body = strings.NewReader(form.Encode())
	}
	req, err := http.NewRequestWithContext(c.t.Context(), method, c.base+path, body)
	if err != nil {
		c.t.Fatal(err)
	}
	if form != nil {
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	}
	resp, err := c.http.Do(req)
	if err != nil {
		c.t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// consoleLogin logs in to the console at base and reads the CSRF token off
// the overview.
func consoleLogin(t *testing.T, base, user, password string) *consoleClient {
	t.Helper()
	jar, err := cookiejar.New(nil)
	if err != nil {
		t.Fatal(err)
	}
	c := &consoleClient{t: t, base: base, http: &http.Client{Jar: jar, Timeout: 60 * time.Second,
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}}
	if code, body := c.do(http.MethodPost, "/login", url.Values{"user": {user}, "password": {password}}); code != http.StatusSeeOther {
		t.Fatalf("console login as %s: %d\n%.2000s", user, code, body)
	}
	code, body := c.do(http.MethodGet, "/", nil)
	m := regexp.MustCompile(`name="csrf" value="([0-9a-f]+)"`).FindStringSubmatch(body)
	if code != http.StatusOK || m == nil {
		t.Fatalf("console overview after login: %d, no CSRF token:\n%.2000s", code, body)
	}
	c.csrf = m[1]
	return c
}

// warmPooler has the transaction pooler at pooledURL open n server
// sessions, n transactions at once, and leaves them idle in its pool.
func warmPooler(t *testing.T, pooledURL string, n int) {
	t.Helper()
	u := mustURL(t, pooledURL)
	q := u.Query()
	q.Set("default_query_exec_mode", "simple_protocol")
	u.RawQuery = q.Encode()
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	var txs []pgx.Tx
	pids := map[int32]bool{}
	for range n {
		conn, err := pgx.Connect(ctx, u.String())
		if err != nil {
			t.Fatalf("warm the pooler: %v", err)
		}
		defer conn.Close(ctx)
		tx, err := conn.Begin(ctx)
		if err != nil {
			t.Fatalf("warm the pooler: %v", err)
		}
		var pid int32
		if err := tx.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
			t.Fatalf("warm the pooler: %v", err)
		}
		pids[pid] = true
		txs = append(txs, tx)
	}
	for _, tx := range txs {
		if err := tx.Commit(ctx); err != nil {
			t.Fatalf("warm the pooler: %v", err)
		}
	}
	if len(pids) != n {
		t.Fatalf("warm the pooler: %d transactions at once ran on %d server sessions, want %d", n, len(pids), n)
	}
}

// keepBusy runs n clients of the transaction pooler at pooledURL until the
// test ends, each running short transactions one after another, as the
// replicas already running keep a production pooler busy.
func keepBusy(t *testing.T, pooledURL string, n int) {
	t.Helper()
	u := mustURL(t, pooledURL)
	q := u.Query()
	q.Set("default_query_exec_mode", "simple_protocol")
	u.RawQuery = q.Encode()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	var conns []*pgx.Conn
	for range n {
		conn, err := pgx.Connect(t.Context(), u.String())
		if err != nil {
			t.Fatalf("a busy client of the pooler: %v", err)
		}
		conns = append(conns, conn)
	}
	for _, conn := range conns {
		go func() {
			defer func() { done <- struct{}{} }()
			for ctx.Err() == nil {
				_ = pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
					_, err := tx.Exec(ctx, "SELECT pg_backend_pid()")
					return err
				})
			}
		}()
	}
	t.Cleanup(func() {
		cancel()
		for range conns {
			<-done
		}
		for _, conn := range conns {
			conn.Close(context.Background())
		}
	})
}

// TestBehindPgBouncerTransactionMode runs everything that talks to the
// database behind PgBouncer in transaction mode, as the least-privilege
// roles of sql/roles: migrate (directly as the owner, then again with
// DATABASE_URL through the pooler and DIRECT_DATABASE_URL), three replicas
// of run as the service role through the pooler (two with LISTEN through
// DIRECT_DATABASE_URL, one with LISTEN_NOTIFY=false and no direct URL),
// delivery in per-key order, the key-state query, every operator command
// as the operator role through the pooler, and the console as its own
// process, as the operator role through the pooler.
func TestBehindPgBouncerTransactionMode(t *testing.T) {
	t.Parallel()
	began := time.Now()
	roles := newRoles(t)
	kc, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(4, deferTopic, targetTopic, pausedTopic))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(kc.Close)
	brokers := kc.ListenAddrs()[0]
	dbURL, admin := emptyDB(t)
	// roles.sql, then migrate as the owner straight to the server, then
	// grants.sql.
	setupRoles(t, dbURL, admin, roles, "public")
	b := pgbouncertest.Start(t, dbURL, pgbouncertest.Options{Mode: pgbouncertest.Transaction,
		Users:    []string{roles.owner, roles.service, roles.operator},
		Settings: []string{"admin_users = " + mustURL(t, dbURL).User.Username()}})
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("pgbouncer log:\n%s", b.Log())
		}
	})
	ctx := context.Background()
	direct := func(role string) string { return roles.url(t, dbURL, role) }
	pooled := func(role string) string { return b.URL(t, roles.url(t, dbURL, role)) }

	// migrate with DATABASE_URL through the pooler migrates through
	// DIRECT_DATABASE_URL: here there is nothing left to do.
	code, stdout, stderr := schedulerCmd(t, []string{"DATABASE_URL=" + pooled(roles.owner), "DIRECT_DATABASE_URL=" + direct(roles.owner)}, "migrate")
	if code != 0 || !strings.Contains(stdout+stderr, "migrations applied: 0 of the scheduler's") {
		t.Fatalf("scheduler migrate, DATABASE_URL through the pooler, DIRECT_DATABASE_URL to the server (owner role): exit %d, want 0 and nothing applied\nstdout:\n%s\nstderr:\n%s",
			code, stdout, stderr)
	}

	// Three replicas as the service role through the pooler: two listen
	// through DIRECT_DATABASE_URL, one polls with no direct URL at all.
	const group = "pooler-tx"
	// Each listening replica names its direct sessions (application_name
	// in its DIRECT_DATABASE_URL), so that its LISTEN session can be found.
	listening := func(name string) []string {
		u := mustURL(t, direct(roles.service))
		q := u.Query()
		q.Set("application_name", name)
		u.RawQuery = q.Encode()
		return poolerTestEnv(pooled(roles.service), brokers, group, "DIRECT_DATABASE_URL="+u.String())
	}
	polling := poolerTestEnv(pooled(roles.service), brokers, group, "LISTEN_NOTIFY=false")
	out := read(t, brokers, targetTopic)
	pausedOut := read(t, brokers, pausedTopic)
	a, c := start(t, listening("pooler-test-a")), start(t, listening("pooler-test-c"))
	p := start(t, polling)
	t.Logf("three replicas ready after %v", time.Since(began).Round(time.Millisecond))

	// Each listening replica has a LISTEN session of the service role on
	// the server, not through the pooler; nothing LISTENs through the
	// pooler (a server session of the pooler whose last statement is a
	// LISTEN got it from a client of the pooler).
	waitUntil(t, 30*time.Second, "a LISTEN session of each listening replica, straight to the server", func() (bool, string) {
		through := poolerServerPIDs(t, b, dbURL, mustURL(t, dbURL).User.Username())
		sessions := listenSessions(t, admin, dbName(t, dbURL))
		found := map[string]bool{}
		for pid, s := range sessions {
			if through[pid] {
				t.Fatalf("server session %d (%+v) of the transaction pooler LISTENed", pid, s)
			}
			if s.user == roles.service {
				found[s.app] = true
			}
		}
		return found["pooler-test-a"] && found["pooler-test-c"], fmt.Sprintf("LISTEN sessions %+v, pooler's server sessions %v", sessions, through)
	})

	// A few hundred records over a few dozen keys, later ones of a key due
	// first: every one delivered, first deliveries in per-key order.
	prod := producer(t, brokers)
	msgs, values := orderedBatch("acct", 30, 10)
	if err := prod.SendMessages(msgs); err != nil {
		t.Fatal(err)
	}
	got := out.until(t, 90*time.Second, "every record delivered", deliveredAll(values))
	firstsInOrder(t, got, values)
	waitRows(t, admin, 30*time.Second, "SELECT count(*) FROM deferred_message", 0)
	// The replicas shared the dispatch loops (River jobs, fetched through
	// the pooler): each runs at most DISPATCH_WORKERS=2 of the 4.
	waitUntil(t, 30*time.Second, "dispatch loops run on more than one replica", func() (bool, string) {
		var instances int
		if err := admin.QueryRow(ctx, `SELECT count(DISTINCT by) FROM river_job, unnest(attempted_by) AS by
			WHERE kind = 'scheduler_dispatch_loop'`).Scan(&instances); err != nil {
			t.Fatal(err)
		}
		return instances >= 2, fmt.Sprintf("%d instance(s)", instances)
	})

	t.Logf("%d records delivered in order (%d duplicates) after %v", len(values), duplicates(out.all()), time.Since(began).Round(time.Millisecond))

	send := func(key, value, target, delay string, headers ...string) {
		t.Helper()
		if _, _, err := prod.SendMessage(deferRecord(key, value, append([]string{"defer.target", target, "defer.delay", delay}, headers...)...)); err != nil {
			t.Fatal(err)
		}
	}
	idOf := func(value string) int64 {
		t.Helper()
		var id int64
		waitUntil(t, 30*time.Second, "message "+value+" stored", func() (bool, string) {
			err := admin.QueryRow(ctx, "SELECT id FROM deferred_message WHERE value = $1", []byte(value)).Scan(&id)
			return err == nil, fmt.Sprint(err)
		})
		return id
	}

	// The operator commands, as the operator role through the pooler.
	ops := opsAs(t, pooled(roles.operator))

	// expedite --key makes a far-future record due: it is delivered.
	send("exp-1", "far-future", targetTopic, "1h")
	farID := idOf("far-future")
	if ch := opsjson.Decode[opsjson.Change](t, ops("expedite", "--key", "exp-1", "--json")); ch.Expedited == nil || *ch.Expedited != 1 {
		t.Errorf("expedite --key exp-1: %+v", ch)
	}
	out.until(t, 30*time.Second, "the expedited record", valueDelivered("far-future"))
	waitRows(t, admin, 30*time.Second, "SELECT count(*) FROM deferred_message WHERE id = $1", 0, farID)

	// pause: a due record to the paused target stays pending while a record
	// to another target, due after it, goes out; resume: it goes out.
	if ch := opsjson.Decode[opsjson.TargetChange](t, ops("pause", pausedTopic, "--note", "pooler test", "--json")); !ch.Target.Paused {
		t.Errorf("pause %s: %+v", pausedTopic, ch)
	}
	send("pause-1", "while-paused", pausedTopic, "0")
	pausedID := idOf("while-paused")
	waitRows(t, admin, 10*time.Second, "SELECT count(*) FROM deferred_message WHERE id = $1 AND next_run_at <= now()", 1, pausedID)
	for i := range 3 {
		probe := fmt.Sprintf("probe-%d", i)
		send("probe", probe, targetTopic, "0")
		out.until(t, 30*time.Second, "a record to an unpaused target, due after the paused one", valueDelivered(probe))
	}
	waitRows(t, admin, time.Second, "SELECT count(*) FROM deferred_message WHERE id = $1 AND state = 'pending'", 1, pausedID)
	if n := len(pausedOut.all()); n != 0 {
		t.Fatalf("%d record(s) published to %s while it was paused", n, pausedTopic)
	}
	if ts := opsjson.Decode[[]opsjson.Target](t, ops("targets", "--json")); !slices.ContainsFunc(ts, func(x opsjson.Target) bool { return x.TargetTopic == pausedTopic && x.Paused }) {
		t.Errorf("targets: %+v, want %s paused", ts, pausedTopic)
	}
	ops("resume", pausedTopic)
	pausedOut.until(t, 30*time.Second, "the record to the resumed target", valueDelivered("while-paused"))
	waitRows(t, admin, 30*time.Second, "SELECT count(*) FROM deferred_message WHERE id = $1", 0, pausedID)

	// The key gate's query, against each kind of replica: a key with a
	// record its group deferred waiting is blocked, another is free.
	const consumers = "pooler-consumers"
	send("gate-1", "gated", targetTopic, "1h", "defer.group", consumers)
	gatedID := idOf("gated")
	for _, r := range []*proc{a, p} {
		st := askKeyState(t, r.HTTPAddr, consumers, "gate-1", "gate-free")
		if s := st["gate-1"]; !s.Blocked || s.Reason != keystate.ReasonPending || s.HeadID != gatedID {
			t.Errorf("key-state of gate-1 from %s: %+v, want blocked, pending, head %d", r.HTTPAddr, s, gatedID)
		}
		if s := st["gate-free"]; s.Blocked {
			t.Errorf("key-state of gate-free from %s: %+v, want free", r.HTTPAddr, s)
		}
	}

	// status, ls, show, held, inflight, park, replay, limit, release,
	// cancel.
	send("hold-1", "to-park", targetTopic, "1h")
	send("hold-1", "behind-parked", targetTopic, "0")
	parkID := idOf("to-park")
	idOf("behind-parked")
	if s := opsjson.Decode[opsjson.Status](t, ops("status", "--json")); len(s.Backlog) == 0 {
		t.Errorf("status: %+v, want a backlog", s)
	}
	ls := opsjson.Decode[[]opsjson.Message](t, ops("ls", "--state", "pending", "--json"))
	if !slices.Contains(opsjson.IDs(ls), gatedID) || !slices.Contains(opsjson.IDs(ls), parkID) {
		t.Errorf("ls --state pending: %v, want %d and %d among them", opsjson.IDs(ls), gatedID, parkID)
	}
	if m := opsjson.Decode[opsjson.Story](t, ops("show", strconv.FormatInt(gatedID, 10), "--json")).Message; m.ID != gatedID || m.State != "pending" {
		t.Errorf("show %d: %+v", gatedID, m)
	}
	if ch := opsjson.Decode[opsjson.Change](t, ops("park", strconv.FormatInt(parkID, 10), "--why", "pooler test", "--json")); ch.Parked == nil || *ch.Parked != 1 {
		t.Errorf("park %d: %+v", parkID, ch)
	}
	if h := opsjson.Decode[[]opsjson.Held](t, ops("held", "--json")); !slices.ContainsFunc(h, func(x opsjson.Held) bool { return x.HeadID == parkID && x.Kind == "parked" }) {
		t.Errorf("held: %+v, want key hold-1 held by parked %d", h, parkID)
	}
	opsjson.Decode[[]opsjson.Inflight](t, ops("inflight", "--json"))
	if r := opsjson.Decode[opsjson.Release](t, ops("release", "--group", "no-such-group", "--dry-run", "--json")); r.Matched != 0 {
		t.Errorf("release --dry-run: %+v", r)
	}
	ops("limit", targetTopic, "1000")
	ops("limit", targetTopic, "off")
	if o := ops("replay", "--id", strconv.FormatInt(parkID, 10), "--yes"); !strings.Contains(o, "replayed 1 message") {
		t.Errorf("replay --id %d:\n%s", parkID, o)
	}
	ds := out.until(t, 30*time.Second, "the replayed record and the one behind it", valueDelivered("behind-parked"))
	head := slices.IndexFunc(ds, func(d delivery) bool { return d.value == "to-park" })
	if behind := slices.IndexFunc(ds, func(d delivery) bool { return d.value == "behind-parked" }); head < 0 || head > behind {
		t.Errorf("behind-parked went out before the replayed head of its key (to-park)")
	}
	if ch := opsjson.Decode[opsjson.Change](t, ops("cancel", strconv.FormatInt(gatedID, 10), "--json")); ch.Cancelled == nil || *ch.Cancelled != 1 {
		t.Errorf("cancel %d: %+v", gatedID, ch)
	}
	waitRows(t, admin, 10*time.Second, "SELECT count(*) FROM deferred_message WHERE id = $1", 0, gatedID)
	if s := askKeyState(t, c.HTTPAddr, consumers, "gate-1")["gate-1"]; s.Blocked {
		t.Errorf("key-state of gate-1 after its record was cancelled: %+v, want free", s)
	}

	// The console alone, as the operator role through the pooler.
	consoleAddr := freeAddr(t)
	key := make([]byte, 32)
	for i := range key {
		key[i] = byte(i * 7)
	}
	con, err := schedproc.Start(schedproc.Options{Bin: binary(t), Args: []string{"console", "--addr", consoleAddr}, Env: []string{
		"CONSOLE_DATABASE_URL=" + pooled(roles.operator), "KAFKA_BROKERS=" + brokers,
		"CONSOLE_USERS=olga:operator:" + hashPassword(t, "olga-secret"), "CONSOLE_SESSION_KEY=" + hex.EncodeToString(key),
		"TARGET_TOPICS=orders.*", "PATH=" + os.Getenv("PATH")}})
	if err != nil {
		t.Fatal(err)
	}
	own(t, con)
	base := "http://" + consoleAddr
	waitUntil(t, 30*time.Second, "the console to answer", func() (bool, string) {
		if con.Exited() {
			t.Fatalf("scheduler console exited (code %d):\n%s", con.Cmd.ProcessState.ExitCode(), con.Logs())
		}
		resp, err := http.Get(base + "/login")
		if err != nil {
			return false, err.Error()
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK, resp.Status
	})
	send("console-1", "console-expedite", targetTopic, "1h")
	consoleID := idOf("console-expedite")
	cc := consoleLogin(t, base, "olga", "olga-secret")
	id := strconv.FormatInt(consoleID, 10)
	for _, page := range []struct{ path, want string }{
		{"/", targetTopic},
		{"/api/overview", targetTopic},
		{"/messages", "/messages/" + id},
		{"/messages?state=pending&sort=due", "/messages/" + id},
		{"/messages/" + id, "console-expedite"},
		{"/keys?key=console-1", "/messages/" + id},
		{"/parked", ""},
		{"/rejected", ""},
		{"/targets", pausedTopic},
	} {
		code, body := cc.do(http.MethodGet, page.path, nil)
		if code != http.StatusOK || !strings.Contains(body, page.want) {
			t.Errorf("console GET %s: %d, want 200 with %q:\n%.3000s", page.path, code, page.want, body)
		}
	}
	form := url.Values{"scope": {"id"}, "ids": {id}, "csrf": {cc.csrf}}
	code, body := cc.do(http.MethodPost, "/actions/expedite", form)
	if code != http.StatusOK || !strings.Contains(body, `id="preview-count">1<`) {
		t.Fatalf("console expedite preview: %d, want 200 counting 1:\n%.3000s", code, body)
	}
	waitRows(t, admin, time.Second, "SELECT count(*) FROM deferred_message WHERE id = $1 AND next_run_at > now() + interval '30 minutes'", 1, consoleID)
	form.Set("confirm", "1")
	code, body = cc.do(http.MethodPost, "/actions/expedite", form)
	if code != http.StatusOK || !strings.Contains(body, `id="result-count">1<`) {
		t.Fatalf("console expedite: %d, want 200 counting 1:\n%.3000s", code, body)
	}
	out.until(t, 30*time.Second, "the record expedited in the console", valueDelivered("console-expedite"))
	waitRows(t, admin, 30*time.Second, "SELECT count(*) FROM deferred_message WHERE id = $1", 0, consoleID)
	if err := con.Stop(30 * time.Second); err != nil {
		t.Fatal(err)
	}

	// With the listening replicas gone, the polling one (no direct URL)
	// delivers alone.
	a.stop()
	c.stop()
	msgs, values = orderedBatch("solo", 5, 4)
	if err := prod.SendMessages(msgs); err != nil {
		t.Fatal(err)
	}
	firstsInOrder(t, out.until(t, 60*time.Second, "every record, by the polling replica alone", deliveredAll(values)), values)
	p.stop()

	for _, r := range []*proc{a, c, p} {
		for _, bad := range []string{"08P01", "unsupported startup parameter", "prepared statement", "notification listener lost its connection"} {
			if strings.Contains(r.Logs(), bad) {
				t.Errorf("replica pid %d logged %q:\n%s", r.Pid(), bad, r.Logs())
			}
		}
	}
	t.Logf("done after %v", time.Since(began).Round(time.Millisecond))
}

// TestBehindPgBouncerSessionMode runs `scheduler run --migrate` with
// LISTEN_NOTIFY=true (the default) and DATABASE_URL through PgBouncer in
// session mode, no DIRECT_DATABASE_URL: it migrates, delivers in per-key
// order, and listens through the pooler.
func TestBehindPgBouncerSessionMode(t *testing.T) {
	t.Parallel()
	began := time.Now()
	brokers := broker(t)
	dbURL, admin := emptyDB(t)
	adminUser := mustURL(t, dbURL).User.Username()
	b := pgbouncertest.Start(t, dbURL, pgbouncertest.Options{Mode: pgbouncertest.Session,
		Settings: []string{"admin_users = " + adminUser}})
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("pgbouncer log:\n%s", b.Log())
		}
	})
	out := read(t, brokers, targetTopic)
	p := start(t, poolerTestEnv(b.URL(t, dbURL), brokers, "pooler-session"), "--migrate")
	all, err := migrations.All()
	if err != nil {
		t.Fatal(err)
	}
	waitRows(t, admin, 10*time.Second, "SELECT count(*) FROM scheduler_migration", len(all))

	msgs, values := orderedBatch("sess", 10, 5)
	if err := producer(t, brokers).SendMessages(msgs); err != nil {
		t.Fatal(err)
	}
	firstsInOrder(t, out.until(t, 60*time.Second, "every record delivered", deliveredAll(values)), values)

	// The service's LISTEN session is on the server, and it is one of the
	// pooler's server sessions.
	waitUntil(t, 30*time.Second, "a LISTEN session through the pooler", func() (bool, string) {
		through := poolerServerPIDs(t, b, dbURL, adminUser)
		sessions := listenSessions(t, admin, dbName(t, dbURL))
		for pid := range sessions {
			if through[pid] {
				return true, ""
			}
		}
		return false, fmt.Sprintf("LISTEN sessions %v, pooler's server sessions %v", sessions, through)
	})
	p.stop()
	for _, bad := range []string{"08P01", "unsupported startup parameter", "notification listener lost its connection", "DIRECT_DATABASE_URL"} {
		if strings.Contains(p.Logs(), bad) {
			t.Errorf("the service logged %q:\n%s", bad, p.Logs())
		}
	}
	t.Logf("done after %v", time.Since(began).Round(time.Millisecond))
}

// TestMigrateBehindPgBouncer: with DATABASE_URL through a transaction-mode
// pooler and DIRECT_DATABASE_URL to the server, two `scheduler migrate` at
// once on an empty database both succeed and apply each migration once
// (the advisory lock held on the direct session), and `run --migrate`
// starts.
func TestMigrateBehindPgBouncer(t *testing.T) {
	t.Parallel()
	dbURL, admin := emptyDB(t)
	b := pgbouncertest.Start(t, dbURL, pgbouncertest.Options{Mode: pgbouncertest.Transaction})
	env := []string{"DATABASE_URL=" + b.URL(t, dbURL), "DIRECT_DATABASE_URL=" + dbURL}
	type result struct {
		code           int
		stdout, stderr string
	}
	results := make(chan result, 2)
	binary(t) // built here, not on the goroutines
	for range 2 {
		go func() {
			var r result
			r.code, r.stdout, r.stderr = schedulerCmd(t, env, "migrate")
			results <- r
		}()
	}
	all, err := migrations.All()
	if err != nil {
		t.Fatal(err)
	}
	var outs string
	for range 2 {
		r := <-results
		if r.code != 0 {
			t.Errorf("scheduler migrate: exit %d\nstdout:\n%s\nstderr:\n%s", r.code, r.stdout, r.stderr)
		}
		outs += r.stdout + r.stderr
	}
	if applied := fmt.Sprintf("%d of the scheduler's", len(all)); !strings.Contains(outs, applied) || !strings.Contains(outs, "0 of the scheduler's") {
		t.Fatalf("want one migrate to apply everything and the other to find nothing to do:\n%s", outs)
	}
	waitRows(t, admin, time.Second, "SELECT count(*) FROM scheduler_migration", len(all))
	p := start(t, append(poolerTestEnv(b.URL(t, dbURL), broker(t), "pooler-migrate"), "DIRECT_DATABASE_URL="+dbURL), "--migrate")
	p.stop()
}

// TestPoolerMisconfigured: what needs a session of its own, with
// DATABASE_URL through a transaction-mode pooler and no
// DIRECT_DATABASE_URL, is refused at start-up with a message naming the
// pooler and the fix.
func TestPoolerMisconfigured(t *testing.T) {
	t.Parallel()
	brokers := broker(t)
	for _, tc := range []struct {
		name  string
		empty bool // a database with nothing in it, else migrated
		warm  int  // server sessions the pooler holds idle before the command starts
		// busy clients run transactions through the pooler, one after
		// another, while the command runs repeat times (1 if 0).
		busy, repeat int
		query        string // added to DATABASE_URL's query string
		args         []string
		env          []string
		want         []string
	}{
		{name: "migrate", empty: true, args: []string{"migrate"},
			want: []string{"pooler in transaction mode", "DIRECT_DATABASE_URL"}},
		{name: "run with LISTEN_NOTIFY", args: []string{"run"},
			want: []string{"pooler in transaction mode", "DIRECT_DATABASE_URL", "LISTEN_NOTIFY=false"}},
		{name: "run with LISTEN_NOTIFY explicitly true", args: []string{"run"}, env: []string{"LISTEN_NOTIFY=true"},
			want: []string{"pooler in transaction mode", "DIRECT_DATABASE_URL", "LISTEN_NOTIFY=false"}},
		// A pooler that already holds idle server sessions, as in
		// production, is found as well.
		{name: "run with LISTEN_NOTIFY, warm pooler", args: []string{"run"}, warm: 6,
			want: []string{"pooler in transaction mode", "DIRECT_DATABASE_URL", "LISTEN_NOTIFY=false"}},
		{name: "migrate, warm pooler", empty: true, args: []string{"migrate"}, warm: 6,
			want: []string{"pooler in transaction mode", "DIRECT_DATABASE_URL"}},
		// A pooler other clients keep busy, as other replicas do during a
		// rolling deployment, is found every time.
		{name: "migrate, busy pooler", empty: true, args: []string{"migrate"}, busy: 6, repeat: 20,
			want: []string{"pooler in transaction mode", "DIRECT_DATABASE_URL"}},
		// The URL of a deployment set up as the README said before
		// DIRECT_DATABASE_URL: nothing prepared, so only the check stands
		// between migrate and a session lock on a shared server session.
		{name: "migrate, busy pooler, URL in exec mode", empty: true, args: []string{"migrate"}, busy: 6, repeat: 20,
			query: "default_query_exec_mode=exec",
			want:  []string{"pooler in transaction mode", "DIRECT_DATABASE_URL"}},
		{name: "run with LISTEN_NOTIFY, busy pooler, URL in exec mode", args: []string{"run"}, busy: 6, repeat: 10,
			query: "default_query_exec_mode=exec",
			want:  []string{"pooler in transaction mode", "DIRECT_DATABASE_URL", "LISTEN_NOTIFY=false"}},
		// Inferred from the contract (migrations hold a session advisory
		// lock): run --migrate needs the direct URL even without LISTEN.
		{name: "run --migrate without LISTEN_NOTIFY", empty: true, args: []string{"run", "--migrate"}, env: []string{"LISTEN_NOTIFY=false"},
			want: []string{"pooler in transaction mode", "DIRECT_DATABASE_URL"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var dbURL string
			if tc.empty {
				dbURL, _ = emptyDB(t)
			} else {
				dbURL = pgtest.NewDB(t).URL
			}
			b := pgbouncertest.Start(t, dbURL, pgbouncertest.Options{Mode: pgbouncertest.Transaction})
			if tc.warm > 0 {
				warmPooler(t, b.URL(t, dbURL), tc.warm)
			}
			if tc.busy > 0 {
				keepBusy(t, b.URL(t, dbURL), tc.busy)
			}
			pooled := b.URL(t, dbURL)
			if tc.query != "" {
				pooled += "&" + tc.query
			}
			env := append(poolerTestEnv(pooled, brokers, "pooler-refused", "HTTP_ADDR="+freeAddr(t)), tc.env...)
			what := "scheduler " + strings.Join(tc.args, " ")
			runs := max(tc.repeat, 1)
			failed := 0
			for i := range runs {
				ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
				defer cancel()
				cmd := exec.CommandContext(ctx, binary(t), tc.args...)
				cmd.Env = env
				var stdout, stderr bytes.Buffer
				cmd.Stdout, cmd.Stderr = &stdout, &stderr
				_ = cmd.Run() // the exit code is checked below
				if ctx.Err() != nil {
					t.Fatalf("%s (run %d) still ran after 30s, want it to refuse at start-up\nstdout:\n%s\nstderr:\n%s", what, i+1, stdout.String(), stderr.String())
				}
				code := cmd.ProcessState.ExitCode()
				if i == 0 {
					t.Logf("%s, exit %d, stderr:\n%s", what, code, stderr.String())
				}
				var lacks []string
				for _, w := range tc.want {
					if !strings.Contains(stderr.String(), w) {
						lacks = append(lacks, strconv.Quote(w))
					}
				}
				if code != 1 || len(lacks) > 0 {
					if failed++; failed <= 3 {
						t.Errorf("%s (run %d of %d): exit %d, want exit 1 and stderr naming %q (it lacks [%s])\nstdout:\n%s\nstderr:\n%s",
							what, i+1, runs, code, tc.want, strings.Join(lacks, ", "), stdout.String(), stderr.String())
					}
				}
			}
			if failed > 0 {
				t.Errorf("%s: %d of %d runs were not refused as they should be", what, failed, runs)
			}
		})
	}
}
