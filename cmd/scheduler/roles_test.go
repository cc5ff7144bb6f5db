package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/deferq/scheduler/internal/fixture"
	"github.com/deferq/scheduler/internal/opscli/opsjson"
	"github.com/deferq/scheduler/internal/pgtest"
	"github.com/deferq/scheduler/migrations"
	"github.com/deferq/scheduler/sql/runbook"
)

// rolesDir holds the role setup scripts, relative to this package.
const rolesDir = repoRoot + "/sql/roles"

// pgRoles are the owner, service and operator roles of one test.
type pgRoles struct {
	owner, service, operator string
	password                 string
}

// newRoles picks role names that no other test or process on the server
// uses, and drops the roles when the test ends. Call it before emptyDB:
// cleanups run last in, first out, and a role can be dropped only once the
// database holding its objects and grants is gone.
func newRoles(t *testing.T) pgRoles {
	t.Helper()
	suffix := fmt.Sprintf("%08x", rand.Uint32())
	r := pgRoles{owner: "sched_owner_" + suffix, service: "sched_service_" + suffix,
		operator: "sched_operator_" + suffix, password: "pw-" + suffix}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		admin, err := pgx.Connect(ctx, pgtest.AdminURL(t))
		if err != nil {
			t.Errorf("drop roles: %v", err)
			return
		}
		defer admin.Close(ctx)
		for _, role := range []string{r.owner, r.service, r.operator} {
			if _, err := admin.Exec(ctx, "DROP ROLE IF EXISTS "+pgx.Identifier{role}.Sanitize()); err != nil {
				t.Errorf("drop role %s: %v", role, err)
			}
		}
	})
	return r
}

// vars are the psql variables of roles.sql and grants.sql.
func (r pgRoles) vars(schema string) map[string]string {
	return map[string]string{
		"owner": r.owner, "service": r.service, "operator": r.operator, "schema": schema,
		"owner_password": r.password, "service_password": r.password, "operator_password": r.password,
	}
}

// url returns dbURL logged in as role.
func (r pgRoles) url(t *testing.T, dbURL, role string) string {
	t.Helper()
	u, err := url.Parse(dbURL)
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.UserPassword(role, r.password)
	return u.String()
}

// psqlScript runs a file of sql/roles with the real psql, as an operator
// would, and returns what it printed.
func psqlScript(t *testing.T, dbURL, file string, vars map[string]string) (string, error) {
	t.Helper()
	psql, err := exec.LookPath("psql")
	if err != nil {
		t.Fatal("psql is not installed (Debian package postgresql-client); the role scripts are meant for it")
	}
	args := []string{"-X", "-d", dbURL}
	for _, name := range slices.Sorted(func(yield func(string) bool) {
		for k := range vars {
			if !yield(k) {
				return
			}
		}
	}) {
		args = append(args, "-v", name+"="+vars[name])
	}
	args = append(args, "-f", filepath.Join(rolesDir, file))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, psql, args...)
	cmd.Env = append(os.Environ(), "PGCONNECT_TIMEOUT=5")
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// setupRoles does what docs/security.md tells an administrator to do, on a
// fresh database: roles.sql as the administrator, `scheduler migrate` as the
// owner, grants.sql as the owner. Each script runs twice, to show that
// running it again is harmless. It then checks that the owner owns every
// object the migrations made: nothing needed a superuser.
func setupRoles(t *testing.T, dbURL string, admin *pgxpool.Pool, r pgRoles, schema string) {
	t.Helper()
	for range 2 {
		out, err := psqlScript(t, dbURL, "roles.sql", r.vars(schema))
		if err != nil || !strings.Contains(out, "roles ready: owner "+r.owner) {
			t.Fatalf("roles.sql as the administrator: %v\n%s", err, out)
		}
	}
	all, err := migrations.All()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(binary(t), "migrate")
	cmd.Env = []string{"DATABASE_URL=" + r.url(t, dbURL, r.owner), "PATH=" + os.Getenv("PATH")}
	out, err := cmd.CombinedOutput()
	if want := fmt.Sprintf("migrations applied: %d of the scheduler's", len(all)); err != nil || !strings.Contains(string(out), want) {
		t.Fatalf("scheduler migrate as the owner role: %v, want %q\n%s", err, want, out)
	}
	for range 2 {
		out, err := psqlScript(t, r.url(t, dbURL, r.owner), "grants.sql", r.vars(schema))
		if err != nil || !strings.Contains(out, "grants ready") {
			t.Fatalf("grants.sql as the owner role: %v\n%s", err, out)
		}
	}

	ctx := context.Background()
	var foreign string
	err = admin.QueryRow(ctx, `
		SELECT coalesce(string_agg(what, ', '), '')
		FROM (SELECT 'relation ' || c.oid::regclass::text AS what FROM pg_class c
		      WHERE c.relnamespace = $1::text::regnamespace AND c.relowner <> $2::text::regrole
		      UNION ALL
		      SELECT 'function ' || p.oid::regprocedure::text FROM pg_proc p
		      WHERE p.pronamespace = $1::text::regnamespace AND p.proowner <> $2::text::regrole
		      UNION ALL
		      SELECT 'type ' || y.oid::regtype::text FROM pg_type y
		      WHERE y.typnamespace = $1::text::regnamespace AND y.typowner <> $2::text::regrole) o`,
		schema, r.owner).Scan(&foreign)
	if err != nil {
		t.Fatal(err)
	}
	if foreign != "" {
		t.Errorf("objects in schema %s not owned by the owner role: %s", schema, foreign)
	}
	var found []string
	rows, _ := admin.Query(ctx, `SELECT c.relname FROM pg_class c WHERE c.relnamespace = $1::text::regnamespace
		AND c.relname IN ('deferred_message', 'deferred_key', 'river_job', 'scheduler_migration') ORDER BY 1`, schema)
	if found, err = pgx.CollectRows(rows, pgx.RowTo[string]); err != nil {
		t.Fatal(err)
	}
	if len(found) != 4 {
		t.Errorf("schema %s holds %v, want the scheduler's and River's tables", schema, found)
	}
}

// opsAs returns a function that runs an operator command with DATABASE_URL
// set to dbURL and fails the test unless it succeeds without a word on
// stderr.
func opsAs(t *testing.T, dbURL string) func(args ...string) string {
	return func(args ...string) string {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		var stdout, stderr bytes.Buffer
		if code := run(ctx, args, []string{"DATABASE_URL=" + dbURL}, &stdout, &stderr); code != 0 || stderr.Len() > 0 {
			t.Fatalf("scheduler %s: exit %d\nstdout:\n%s\nstderr:\n%s", strings.Join(args, " "), code, stdout.String(), stderr.String())
		}
		return stdout.String()
	}
}

// TestLeastPrivilegeRoles sets up the roles of sql/roles on a fresh database,
// migrates as the owner, runs the service end to end as the service role and
// every operator command and runbook file as the operator role, and shows
// what each role is refused.
func TestLeastPrivilegeRoles(t *testing.T) {
	roles := newRoles(t)
	brokers := broker(t)
	dbURL, admin := emptyDB(t)
	setupRoles(t, dbURL, admin, roles, "public")
	ctx := context.Background()

	// The functions the service calls that run as the owner have their
	// search_path pinned by grants.sql, as the trigger functions have.
	for _, fn := range []string{"deferred_queue_analyze", "deferred_sequences_advance"} {
		var config []string
		if err := admin.QueryRow(ctx, `SELECT coalesce(proconfig, '{}') FROM pg_proc
			WHERE proname = $1 AND prosecdef`, fn).Scan(&config); err != nil {
			t.Fatalf("%s, SECURITY DEFINER: %v", fn, err)
		}
		if !slices.Contains(config, "search_path=public, pg_temp") {
			t.Errorf("%s settings %q lack search_path=public, pg_temp", fn, config)
		}
	}

	p := start(t, append(serviceEnv(roles.url(t, dbURL, roles.service), brokers, "roles"), "METRICS_INTERVAL=200ms"))
	got := read(t, brokers, targetTopic)
	prod := producer(t, brokers)
	for _, m := range []*sarama.ProducerMessage{
		deferRecord("order-1", "now", "defer.target", targetTopic, "defer.delay", "0"),
		deferRecord("order-2", "later", "defer.target", targetTopic, "defer.delay", "1h"),
		// Parked at ingest, holding its key: "behind" waits for it.
		deferRecord("order-3", "poison", "defer.target", targetTopic, "defer.delay", "0", "defer.error.class", "permanent"),
		deferRecord("order-3", "behind", "defer.target", targetTopic, "defer.delay", "0"),
		deferRecord("order-4", "doomed", "defer.target", targetTopic, "defer.delay", "1h"),
	} {
		if _, _, err := prod.SendMessage(m); err != nil {
			t.Fatal(err)
		}
	}
	valueIs := func(v string) func([]delivery) bool {
		return func(ds []delivery) bool {
			return slices.ContainsFunc(ds, func(d delivery) bool { return d.value == v })
		}
	}
	got.until(t, 15*time.Second, "the due record republished by the service role", valueIs("now"))
	waitRows(t, admin, 15*time.Second, "SELECT count(*) FROM deferred_message WHERE value = ANY ($1)", 4,
		[][]byte{[]byte("later"), []byte("poison"), []byte("behind"), []byte("doomed")})
	id := func(value string) string {
		t.Helper()
		var id int64
		if err := admin.QueryRow(ctx, "SELECT id FROM deferred_message WHERE value = $1", []byte(value)).Scan(&id); err != nil {
			t.Fatalf("id of %q: %v", value, err)
		}
		return strconv.FormatInt(id, 10)
	}
	poison, doomed := id("poison"), id("doomed")
	// Every metric comes from queries the service role runs.
	waitMetrics(t, p, 10*time.Second, "backlog gauges", func(s metricsSnapshot) bool {
		return s.is(1, "scheduler_messages", "target", targetTopic, "state", "parked")
	})

	// The operator commands, as the operator role.
	opURL := roles.url(t, dbURL, roles.operator)
	ops := opsAs(t, opURL)
	if s := opsjson.Decode[opsjson.Status](t, ops("status", "--json")); s.ParkedKeys != 1 || len(s.Backlog) != 2 {
		t.Errorf("status: %+v", s)
	}
	opsjson.SameIDs(t, "ls --state parked", opsjson.IDs(opsjson.Decode[[]opsjson.Message](t, ops("ls", "--state", "parked", "--json"))), mustInt(t, poison))
	if m := opsjson.Decode[opsjson.Story](t, ops("show", poison, "--json")).Message; m.State != "parked" || !m.HoldsKey {
		t.Errorf("show %s: %+v", poison, m)
	}
	if h := opsjson.Decode[[]opsjson.Held](t, ops("held", "--json")); len(h) != 1 || h[0].Kind != "parked" || strconv.FormatInt(h[0].HeadID, 10) != poison {
		t.Errorf("held: %+v", h)
	}
	if c := opsjson.Decode[opsjson.Change](t, ops("expedite", "--key", "order-2", "--json")); c.Expedited == nil || *c.Expedited != 1 {
		t.Errorf("expedite: %+v", c)
	}
	got.until(t, 15*time.Second, "the expedited record", valueIs("later"))
	if c := opsjson.Decode[opsjson.Change](t, ops("park", doomed, "--why", "ops test", "--json")); c.Parked == nil || *c.Parked != 1 {
		t.Errorf("park: %+v", c)
	}
	if c := opsjson.Decode[opsjson.Change](t, ops("cancel", doomed, "--json")); c.Cancelled == nil || *c.Cancelled != 1 {
		t.Errorf("cancel: %+v", c)
	}
	waitRows(t, admin, time.Second, "SELECT count(*) FROM deferred_message WHERE id = $1", 0, mustInt(t, doomed))
	if out := ops("replay", "--id", poison, "--yes"); !strings.Contains(out, "replayed 1 message") {
		t.Errorf("replay:\n%s", out)
	}
	ds := got.until(t, 15*time.Second, "the replayed record and the one behind it", valueIs("behind"))
	// The replayed head first, then the message that waited behind it.
	if !slices.ContainsFunc(ds, func(d delivery) bool { return d.value == "poison" }) || ds[len(ds)-1].value != "behind" {
		t.Errorf("want poison, then behind, last; got %+v", ds)
	}
	ops("pause", targetTopic, "--note", "roles test")
	ops("resume", targetTopic)
	ops("limit", targetTopic, "100")
	ops("limit", targetTopic, "off")
	if ts := opsjson.Decode[[]opsjson.Target](t, ops("targets", "--json")); len(ts) != 1 || ts[0].Paused || ts[0].RateLimit != nil {
		t.Errorf("targets after pause, resume, limit, limit off: %+v", ts)
	}
	opsjson.Decode[[]opsjson.Inflight](t, ops("inflight", "--json"))
	if r := opsjson.Decode[opsjson.Release](t, ops("release", "--group", "no-such-group", "--dry-run", "--json")); r.Matched != 0 {
		t.Errorf("release --dry-run: %+v", r)
	}
	if r := opsjson.Decode[opsjson.Release](t, ops("release", "--group", "no-such-group", "--json")); r.Released != 0 {
		t.Errorf("release: %+v", r)
	}

	// The runbook, as the operator role with psql. Files that change rows
	// are pointed at ids and names that match nothing, or undo each other
	// (pause then resume, limit then unlimit: names sort that way), so the
	// database is left as it was but for the target's weight of 2, which
	// must change for the privileges to be checked; they are all the same.
	runbookVars := map[string]map[string]string{
		"backlog.sql":         nil,
		"cancel_id.sql":       {"ids": "0"},
		"expedite_id.sql":     {"ids": "0"},
		"expedite_key.sql":    {"key": "no-such-key"},
		"expedite_target.sql": {"target": "no.such.retry"},
		"held_keys.sql":       {"limit": ""},
		"history.sql":         {"id": poison},
		"inflight.sql":        {"group": "", "key": "", "limit": "10"},
		"limit_target.sql":    {"target": targetTopic, "rate": "50"},
		"list.sql":            {"target": "", "state": "", "key": "", "reason": "", "limit": "50"},
		"next_due.sql":        {"limit": "10"},
		"oldest_due.sql":      nil,
		"park_id.sql":         {"ids": "0", "why": "roles test", "release": "false"},
		"parked_summary.sql":  nil,
		"pause_target.sql":    {"target": targetTopic, "note": "roles test"},
		"rejected_recent.sql": {"window": "1 hour"},
		"replay.sql":          fixture.ReplayVars(map[string]string{"ids": "0", "rate": "", "reset_attempts": "false"}),
		"replay_parked.sql":   {"target": "no.such.retry"},
		"replay_preview.sql":  fixture.ReplayVars(map[string]string{"ids": "0"}),
		"resume_target.sql":   {"target": targetTopic},
		"show_message.sql":    {"id": poison},
		"targets.sql":         nil,
		"unlimit_target.sql":  {"target": targetTopic},
		"weight_target.sql":   {"target": targetTopic, "weight": "2"},
	}
	// Their names would realign the table above.
	runbookVars["release_inflight.sql"] = map[string]string{"group": "no-such-group", "key": ""}
	runbookVars["console_overview.sql"] = map[string]string{"window": "5 minutes"}
	runbookVars["console_messages.sql"] = map[string]string{"state": "", "target": "", "reason": "", "error_class": "",
		"since": "", "until": "", "sort": "due", "after_at": "", "after_id": "", "limit": "50"}
	runbookVars["key_messages.sql"] = map[string]string{"key": "no-such-key", "after_seq": "", "after_id": "", "limit": "50"}
	runbookVars["key_state.sql"] = map[string]string{"key": "no-such-key"}
	runbookVars["ingest_progress.sql"] = map[string]string{"topic": "scheduler.defer"}
	runbookVars["fix_rejected.sql"] = map[string]string{"ids": "0", "target": targetTopic, "due": ""}
	for _, name := range runbook.Names() {
		vars, ok := runbookVars[name]
		if !ok {
			t.Errorf("runbook file %s is not run as the operator role here: add it to runbookVars", name)
			continue
		}
		if out, err := fixture.Psql(t, opURL, name, vars); err != nil {
			t.Errorf("psql -f %s as the operator role: %v\n%s", name, err, out)
		}
	}
	var paused bool
	var limit *float64
	if err := admin.QueryRow(ctx, "SELECT paused, rate_limit FROM target_control WHERE target_topic = $1", targetTopic).Scan(&paused, &limit); err != nil || paused || limit != nil {
		t.Errorf("after the runbook, %s: paused %v, rate limit %v (%v); want neither", targetTopic, paused, limit, err)
	}

	// What each role is refused, and that the refusal names what it is
	// about.
	refused := []struct {
		role, what, sql, want string
	}{
		{roles.operator, "alter a table", "ALTER TABLE deferred_message ADD COLUMN note text", "must be owner of table deferred_message"},
		{roles.operator, "drop a table", "DROP TABLE deferred_key", "must be owner of table deferred_key"},
		{roles.operator, "truncate", "TRUNCATE deferred_message", "permission denied for table deferred_message"},
		{roles.operator, "create a table", "CREATE TABLE mine (x int)", "permission denied for schema public"},
		{roles.operator, "update the derived heads", "UPDATE deferred_key SET failures = 0", "permission denied for table deferred_key"},
		{roles.operator, "write history", "INSERT INTO deferred_attempt (lineage_id, message_id, event, attempt) VALUES (1, 1, 'deferred', 0)",
			"permission denied for table deferred_attempt"},
		{roles.operator, "recompute heads by hand", "SELECT deferred_key_refresh('{order-1}', '{}')", "permission denied for table deferred_key"},
		{roles.operator, "insert a message", "INSERT INTO deferred_message (target_topic, next_run_at) VALUES ('orders.retry', now())",
			"permission denied for table deferred_message"},
		{roles.operator, "change River's jobs", "UPDATE river_job SET priority = 1", "permission denied for table river_job"},
		{roles.operator, "hold a key in flight", "INSERT INTO deferred_inflight (group_id, business_key, target_topic, partition, record_offset, message_id, seq) VALUES ('g', 'k', 't', 0, 0, 1, 1)",
			"permission denied for table deferred_inflight"},
		{roles.operator, "delete River's leader", "DELETE FROM river_leader", "permission denied for table river_leader"},
		{roles.service, "alter a table", "ALTER TABLE deferred_message ADD COLUMN note text", "must be owner of table deferred_message"},
		{roles.service, "drop a table", "DROP TABLE deferred_message", "must be owner of table deferred_message"},
		{roles.service, "drop River's table", "DROP TABLE river_job", "must be owner of table river_job"},
		{roles.service, "truncate", "TRUNCATE deferred_key", "permission denied for table deferred_key"},
		{roles.service, "create a table", "CREATE TABLE mine (x int)", "permission denied for schema public"},
		{roles.service, "rewrite the migration record", "DELETE FROM scheduler_migration", "permission denied for table scheduler_migration"},
		{roles.service, "rewrite River's migration record", "DELETE FROM river_migration", "permission denied for table river_migration"},
		// River's reindexer (a daily maintenance job of every River client)
		// does this; as the service role it cannot.
		{roles.service, "reindex River's jobs", "REINDEX INDEX river_job_kind", "must be owner of index river_job_kind"},
	}
	conns := map[string]*pgx.Conn{}
	for _, role := range []string{roles.operator, roles.service} {
		c, err := pgx.Connect(ctx, roles.url(t, dbURL, role))
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close(ctx)
		conns[role] = c
	}
	for _, tt := range refused {
		who := map[string]string{roles.operator: "operator", roles.service: "service"}[tt.role]
		_, err := conns[tt.role].Exec(ctx, tt.sql)
		var pe *pgconn.PgError
		if !errors.As(err, &pe) || pe.Code != pgerrcode.InsufficientPrivilege || !strings.Contains(pe.Message, tt.want) {
			t.Errorf("the %s role may %s (%s): got %v, want SQLSTATE %s (insufficient_privilege) %q", who, tt.what, tt.sql, err, pgerrcode.InsufficientPrivilege, tt.want)
		}
	}

	// The oldest-transaction gauge sees the transactions of other roles
	// (here the operator's) only once the service role has
	// pg_read_all_stats, the optional grant of docs/security.md.
	tx, err := conns[roles.operator].Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "SELECT txid_current()"); err != nil {
		t.Fatal(err)
	}
	time.Sleep(1500 * time.Millisecond)
	if v, _ := scrapeMetrics(t, p).value("scheduler_db_oldest_transaction_seconds"); v >= 1 {
		t.Errorf("without pg_read_all_stats the service saw the operator's transaction (%vs)", v)
	}
	if _, err := admin.Exec(ctx, "GRANT pg_read_all_stats TO "+pgx.Identifier{roles.service}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	waitMetrics(t, p, 5*time.Second, "the operator's transaction seen with pg_read_all_stats", func(s metricsSnapshot) bool {
		v, _ := s.value("scheduler_db_oldest_transaction_seconds")
		return v >= 1
	})
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}

	p.stop()
	for _, bad := range []string{"permission denied", "must be owner"} {
		if strings.Contains(p.Logs(), bad) {
			t.Errorf("the service, as the service role, logged %q:\n%s", bad, p.Logs())
		}
	}
}

func mustInt(t *testing.T, s string) int64 {
	t.Helper()
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// TestRolesInOwnSchema runs roles.sql with a schema of its own: the owner
// owns it, the three roles find everything there through their search_path,
// and nothing lands in public.
func TestRolesInOwnSchema(t *testing.T) {
	roles := newRoles(t)
	brokers := broker(t)
	dbURL, admin := emptyDB(t)
	const schema = "scheduler"
	setupRoles(t, dbURL, admin, roles, schema)
	var inPublic int
	if err := admin.QueryRow(context.Background(), "SELECT count(*) FROM pg_class WHERE relnamespace = 'public'::regnamespace").Scan(&inPublic); err != nil || inPublic != 0 {
		t.Errorf("public holds %d relations (%v), want none", inPublic, err)
	}

	p := start(t, serviceEnv(roles.url(t, dbURL, roles.service), brokers, "roles-schema"))
	got := read(t, brokers, targetTopic)
	if _, _, err := producer(t, brokers).SendMessage(deferRecord("order-1", "in its own schema", "defer.target", targetTopic, "defer.delay", "0")); err != nil {
		t.Fatal(err)
	}
	got.until(t, 15*time.Second, "the record republished", atLeast(1))
	ops := opsAs(t, roles.url(t, dbURL, roles.operator))
	ops("pause", targetTopic)
	if ts := opsjson.Decode[[]opsjson.Target](t, ops("targets", "--json")); len(ts) != 1 || !ts[0].Paused {
		t.Errorf("targets: %+v", ts)
	}
	p.stop()
}

// TestRolesScriptRefuses checks that roles.sql stops, changing nothing, when
// asked to use one role twice or a role with more power than it grants.
func TestRolesScriptRefuses(t *testing.T) {
	roles := newRoles(t)
	dbURL, admin := emptyDB(t)
	ctx := context.Background()
	exists := func(role string) bool {
		t.Helper()
		var ok bool
		if err := admin.QueryRow(ctx, "SELECT EXISTS (SELECT FROM pg_roles WHERE rolname = $1)", role).Scan(&ok); err != nil {
			t.Fatal(err)
		}
		return ok
	}

	vars := roles.vars("public")
	vars["operator"] = roles.owner
	out, err := psqlScript(t, dbURL, "roles.sql", vars)
	if err == nil || !strings.Contains(out, "owner, service and operator must be three different roles") {
		t.Errorf("roles.sql with the same owner and operator: %v\n%s", err, out)
	}
	if exists(roles.owner) || exists(roles.service) {
		t.Error("roles.sql created roles although it failed")
	}

	if _, err := admin.Exec(ctx, "CREATE ROLE "+pgx.Identifier{roles.service}.Sanitize()+" CREATEDB"); err != nil {
		t.Fatal(err)
	}
	out, err = psqlScript(t, dbURL, "roles.sql", roles.vars("public"))
	if err == nil || !strings.Contains(out, roles.service+" already exist with SUPERUSER, BYPASSRLS, CREATEROLE, CREATEDB or REPLICATION") {
		t.Errorf("roles.sql with a service role that may create databases: %v\n%s", err, out)
	}
	if exists(roles.owner) || exists(roles.operator) {
		t.Error("roles.sql created roles although it failed")
	}
}

// TestLogsAndMetricsCarryNoPayloads runs the service on records whose keys,
// values, business keys, header values and error messages carry a marker,
// through every path that logs about a record (stored and republished,
// rejected, parked by the retry policy, parked by the dispatcher), once at
// LOG_LEVEL=debug in JSON and once at info in text, and checks that the
// marker is in the database (so the records were seen) and never in the logs
// or /metrics.
func TestLogsAndMetricsCarryNoPayloads(t *testing.T) {
	brokers := broker(t)
	db := pgtest.NewDB(t)
	ctx := context.Background()
	marker := fmt.Sprintf("mk%08x", rand.Uint32())
	got := read(t, brokers, targetTopic)
	prod := producer(t, brokers)

	for _, run := range []struct{ level, format string }{{"debug", "json"}, {"info", "text"}} {
		t.Run(run.level, func(t *testing.T) {
			m := func(what string) string { return marker + "-" + run.level + "-" + what }
			p := start(t, append(serviceEnv(db.URL, brokers, "privacy"),
				"LOG_LEVEL="+run.level, "LOG_FORMAT="+run.format, "METRICS_INTERVAL=200ms"))
			records := []*sarama.ProducerMessage{
				// Stored, then republished.
				deferRecord(m("key-1"), m("value-1"), "defer.target", targetTopic, "defer.delay", "0", "defer.key", m("bkey-1"),
					"trace", m("header-1"), "defer.error.class", m("ErrorClass"), "defer.error.message", m("error-1")),
				// Rejected: the reasons quote the bad header and the key.
				deferRecord(m("key-2"), m("value-2"), "defer.target", targetTopic, "defer.delay", m("delay")),
				deferRecord(m("key-3"), m("value-3"), "defer.target", targetTopic, "defer.delay", "0",
					"defer.key", m("bkey-3")+strings.Repeat("x", 1100)),
				// Parked at ingest by the retry rules: permanent, exhausted.
				deferRecord(m("key-4"), m("value-4"), "defer.target", targetTopic, "defer.delay", "0", "defer.key", m("bkey-4"),
					"defer.error.class", "permanent", "defer.error.message", m("error-4")),
				deferRecord(m("key-5"), m("value-5"), "defer.target", targetTopic, "defer.key", m("bkey-5"), "defer.attempt", "50"),
				// Parked by the dispatcher, once an operator points it at a
				// topic TARGET_TOPICS does not allow.
				deferRecord(m("key-6"), m("value-6"), "defer.target", targetTopic, "defer.delay", "1h", "defer.key", m("bkey-6")),
			}
			if err := prod.SendMessages(records); err != nil {
				t.Fatal(err)
			}
			got.until(t, 15*time.Second, "the stored record republished", func(ds []delivery) bool {
				return slices.ContainsFunc(ds, func(d delivery) bool { return d.value == m("value-1") })
			})
			waitRows(t, db.Pool, 15*time.Second, "SELECT count(*) FROM deferred_message WHERE state = 'rejected' AND strpos(reason, $1) > 0", 2, m(""))
			waitRows(t, db.Pool, 15*time.Second, "SELECT count(*) FROM deferred_message WHERE state = 'parked' AND business_key = ANY ($1)", 2,
				[]string{m("bkey-4"), m("bkey-5")})
			waitRows(t, db.Pool, 15*time.Second, "SELECT count(*) FROM deferred_message WHERE business_key = $1", 1, m("bkey-6"))
			if _, err := db.Pool.Exec(ctx, "UPDATE deferred_message SET target_topic = 'payments.retry', next_run_at = now() WHERE business_key = $1",
				m("bkey-6")); err != nil {
				t.Fatal(err)
			}
			waitRows(t, db.Pool, 15*time.Second,
				"SELECT count(*) FROM deferred_message WHERE business_key = $1 AND state = 'parked' AND reason LIKE 'target_not_allowed:%'", 1, m("bkey-6"))

			// The log lines about those records are written, and the metrics
			// count them.
			deadline := time.Now().Add(10 * time.Second)
			for _, want := range []string{"parking message whose target may not be published to",
				"rejected_by_reason", "invalid_delay", "key_too_long", "parked_by_reason", "exhausted"} {
				for !strings.Contains(p.Logs(), want) {
					if time.Now().After(deadline) {
						t.Fatalf("no log line mentions %q:\n%s", want, p.Logs())
					}
					time.Sleep(20 * time.Millisecond)
				}
			}
			waitMetrics(t, p, 10*time.Second, "the metrics of the run", func(s metricsSnapshot) bool {
				_, rejected := s.value("scheduler_ingest_rejected_total", "reason", "key_too_long")
				_, parked := s.value("scheduler_dispatch_parked_total", "reason", "target_not_allowed")
				return rejected && parked
			})
			_, metricsText := p.Get("/metrics")
			p.stop()

			logs := p.Logs()
			if run.level == "debug" && !strings.Contains(logs, `"level":"DEBUG"`) {
				t.Errorf("LOG_LEVEL=debug logged nothing at debug level:\n%s", logs)
			}
			for what, text := range map[string]string{"logs": logs, "/metrics": metricsText} {
				for line := range strings.Lines(text) {
					if strings.Contains(line, marker) {
						t.Errorf("%s at LOG_LEVEL=%s carry a key, business key, payload or header value:\n%s", what, run.level, line)
					}
				}
			}
		})
	}
}
