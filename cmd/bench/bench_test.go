package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/deferq/scheduler/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// The benchmark in its smallest mode, so that it cannot rot: it must run to
// the end against the real service, and report every RESULT key as a number
// with every message delivered in per-key order. Speed is not checked: make
// test must not depend on the machine.
func TestSmokeRun(t *testing.T) {
	cfg := modes["smoke"]
	cfg.DatabaseURL = pgtest.AdminURL(t)
	// Profiling on too, so that it cannot rot either.
	cfg.ProfileDir, cfg.ServiceProfile = t.TempDir(), time.Second
	var out, progress bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	if err := run(ctx, cfg, &out, &progress); err != nil {
		t.Fatalf("bench: %v\nprogress:\n%s", err, progress.String())
	}
	report := strings.TrimRight(out.String(), "\n")
	lines := strings.Split(report, "\n")
	last := lines[len(lines)-1]
	if !strings.HasPrefix(last, "RESULT ") {
		t.Fatalf("last line is not the RESULT line: %q\nreport:\n%s", last, report)
	}
	vals, err := parseResult(last)
	if err != nil {
		t.Fatalf("RESULT line %q: %v", last, err)
	}
	for _, k := range requiredKeys {
		if _, ok := vals[k]; !ok {
			t.Errorf("RESULT lacks %s: %s", k, last)
		}
	}
	if vals["expected"] == 0 || vals["delivered"] != vals["expected"] {
		t.Errorf("delivered %v of %v messages", vals["delivered"], vals["expected"])
	}
	if vals["out_of_order"] != 0 {
		t.Errorf("%v messages out of per-key order", vals["out_of_order"])
	}
	for _, k := range []string{"e2e_msgs_per_s", "dispatch_msgs_per_s", "ingest_msgs_per_s", "ceiling_msgs_per_s",
		"river_msgs_per_s", "hotkey_msgs_per_s", "backlog1m_dispatch_msgs_per_s", "rss_mb", "large_rss_mb", "large_ingest_mb_per_s",
		// Not e2e_svc_cpu_us_per_msg: the smoke phase lasts about 50 ms,
		// and /proc counts the service's CPU in 10 ms ticks, so it can read
		// 0 (it did, once, on a fast machine); the whole, with Postgres's
		// part, cannot.
		"e2e_cpu_us_per_msg", "cpu_speed_start", "cpu_speed_end",
		"gate_sarama_noop_off_msgs_per_s", "gate_sarama_noop_on_msgs_per_s", "gate_sarama_noop_blocked1_msgs_per_s",
		"gate_sarama_work25_busy_msgs_per_s", "gate_franz_noop_off_msgs_per_s", "gate_franz_noop_on_msgs_per_s",
		"gate_franz_noop_blocked1_msgs_per_s", "gate_franz_work25_busy_msgs_per_s", "gate_sarama_noop_on_first_ms",
		"gate_franz_noop_on_first_ms", "gate_sarama_noop_on_load_ms", "gate_franz_noop_on_load_ms", "gate_p99_ms", "gate_busy_p99_ms", "release_p99_ms",
		"bare_msgs_per_s", "e2e_vs_bare", "ordered_msgs_per_s", "ordered_vs_bare", "e2e_p64_msgs_per_s", "ingest_p64_msgs_per_s", "dispatch_p64_msgs_per_s"} {
		if vals[k] <= 0 {
			t.Errorf("%s = %v, want a positive measurement", k, vals[k])
		}
	}
	// The gate held back every blocked key's record, and no key read free
	// before its record was committed.
	if vals["gate_blocked_keys"] == 0 || vals["gate_gated"] < vals["gate_blocked_keys"] {
		t.Errorf("%v records gated for %v blocked keys", vals["gate_gated"], vals["gate_blocked_keys"])
	}
	if vals["release_early"] != 0 || vals["release_keys"] != float64(cfg.GateRelease) {
		t.Errorf("release: %v of %v keys timed, %v free before their commit", vals["release_keys"], cfg.GateRelease, vals["release_early"])
	}
	if vals["console_rows"] != float64(cfg.ConsoleRows) || vals["console_worst_p95_ms"] <= 0 {
		t.Errorf("console: %v rows, worst p95 %v ms; want %d rows and a measurement", vals["console_rows"], vals["console_worst_p95_ms"], cfg.ConsoleRows)
	}
	if vals["backlog_rows"] != float64(cfg.Backlog) {
		t.Errorf("backlog_rows = %v, want %d", vals["backlog_rows"], cfg.Backlog)
	}
	for _, section := range []string{"THROUGHPUT", "LATENESS", "MEMORY", "COMPARED WITH THE TARGETS", "CPU PER MESSAGE",
		"KEY GATE", "KEY-STATE QUERY", "RELEASE AFTER COMMIT", "CONSOLE PAGES", "machine:", "speed:", "database: PostgreSQL",
		"PARTITIONS", "BARE DURABLE QUEUE", "end to end / bare durable queue", "Ordered bare queue / bare queue",
		"end to end, 64 partitions / 4"} {
		if !strings.Contains(report, section) {
			t.Errorf("report lacks %q:\n%s", section, report)
		}
	}
	for _, name := range []string{"ceiling.cpu.pprof", "bare.cpu.pprof", "ordered.cpu.pprof", "service_svc_own_0_p64_e2e.cpu.pprof", "service_svc_own_0_ingest.cpu.pprof",
		"service_svc_own_0_dispatch.cpu.pprof", "service_svc_own_0_e2e.cpu.pprof"} {
		if fi, err := os.Stat(filepath.Join(cfg.ProfileDir, name)); err != nil || fi.Size() == 0 {
			t.Errorf("profile %s: %v (empty: %v)", name, err, err == nil)
		}
	}
	if t.Failed() {
		t.Logf("report:\n%s", report)
	}
}

// The console scenario alone (BENCH_ONLY=console) at 20,000 messages: the
// seed runs, every page answers 200 for a logged-in viewer (the next-page
// link included), and the report has the table and a p95 per page. The
// figures are not checked against the budget: make test must not depend on
// the machine's speed (make bench reports them).
func TestSmokeConsole(t *testing.T) {
	cfg, report, vals := runSmoke(t, onlyConsole)
	if vals["console_rows"] != float64(cfg.ConsoleRows) {
		t.Errorf("console_rows = %v, want %d", vals["console_rows"], cfg.ConsoleRows)
	}
	pages := []string{"overview", "overview_json", "messages", "messages_due", "messages_due_page2", "messages_newest",
		"messages_target", "messages_state", "messages_reason", "messages_key", "messages_error_class", "messages_since",
		"message", "key", "parked", "rejected", "targets"}
	for _, p := range pages {
		if v, ok := vals["console_"+p+"_p95_ms"]; !ok || v <= 0 {
			t.Errorf("console_%s_p95_ms = %v (present %v), want a measurement", p, v, ok)
		}
		if !strings.Contains(report, "\n"+p+" ") {
			t.Errorf("the report's table has no row for %s", p)
		}
	}
	for _, k := range []string{"console_seed_s", "console_worst_p95_ms", "cpu_speed_start"} {
		if vals[k] <= 0 {
			t.Errorf("%s = %v, want a positive measurement", k, vals[k])
		}
	}
	// The seed has the production shape it claims: 5% parked, 1% rejected,
	// keys with several messages, history beyond the live rows (each live
	// message's events and two for each delivered one: its deferral, folded
	// into its delivery's row, and the delivery).
	rows := vals["console_rows"]
	if p := vals["console_parked"]; p < 0.04*rows || p > 0.06*rows {
		t.Errorf("console_parked = %v of %v rows, want about 5%%", p, rows)
	}
	if r := vals["console_rejected"]; r < 0.005*rows || r > 0.015*rows {
		t.Errorf("console_rejected = %v of %v rows, want about 1%%", r, rows)
	}
	if k := vals["console_keys"]; k <= 0 || k > 0.5*rows {
		t.Errorf("console_keys = %v for %v rows, want several messages a key", k, rows)
	}
	if h := vals["console_history"]; h < 3*rows {
		t.Errorf("console_history = %v for %v rows, want at least three events a message", h, rows)
	}
	for _, want := range []string{"CONSOLE PAGES", "machine:", "speed:", "history events", "COMPARED WITH THE TARGETS"} {
		if !strings.Contains(report, want) {
			t.Errorf("report lacks %q", want)
		}
	}
	if t.Failed() {
		t.Logf("report:\n%s", report)
	}
}

// BENCH_ONLY=bare, BENCH_ONLY=partitions and BENCH_ONLY=lateness in the
// smallest mode: each runs the service's own-key scenario and its own part,
// and reports their figures, with every message of the service delivered
// in per-key order.
func TestSmokeOnlyDurability(t *testing.T) {
	for _, tc := range []struct {
		only    string
		keys    []string
		section string
		// target is a row the targets table must have.
		target string
	}{
		{onlyBare, []string{"e2e_msgs_per_s", "bare_msgs_per_s", "e2e_vs_bare", "ordered_msgs_per_s", "ordered_vs_bare", "e2e_vs_ordered"},
			"Ordered bare queue / bare queue", "end to end / bare durable queue"},
		{onlyPartitions, []string{"e2e_msgs_per_s", "e2e_p64_msgs_per_s", "ingest_p64_msgs_per_s", "e2e_p64_vs_p4", "ingest_p64_vs_p4"}, "PARTITIONS",
			"ingest, 64 partitions / 4"},
		{onlyLateness, []string{"e2e_msgs_per_s", "p99_lateness_ms", "p99_lateness_vacuumed_ms", "max_lateness_vacuumed_ms"}, "after a VACUUM",
			"the same after a VACUUM emptied the queue"},
	} {
		t.Run(tc.only, func(t *testing.T) {
			_, report, vals := runSmoke(t, tc.only)
			for _, k := range tc.keys {
				if vals[k] <= 0 {
					t.Errorf("%s = %v, want a positive measurement", k, vals[k])
				}
			}
			if vals["expected"] == 0 || vals["delivered"] != vals["expected"] || vals["out_of_order"] != 0 {
				t.Errorf("delivered %v of %v messages, %v out of order", vals["delivered"], vals["expected"], vals["out_of_order"])
			}
			if !strings.Contains(report, tc.section) {
				t.Errorf("report lacks %q", tc.section)
			}
			if _, table, _ := strings.Cut(report, "COMPARED WITH THE TARGETS"); !strings.Contains(table, tc.target) {
				t.Errorf("the report's targets table lacks %q", tc.target)
			}
			// The second lateness phase runs on what autovacuum leaves
			// after a drain: the table truncated to no pages.
			if pages, ok := vals["vacuumed_pages"]; tc.only == onlyLateness && (!ok || pages != 0) {
				t.Errorf("vacuumed_pages = %v (reported: %v), want 0: the VACUUM did not truncate deferred_message", pages, ok)
			}
			// Both lateness phases are split by autovacuum: every record
			// falls on one side, so one side has a p99.
			if tc.only == onlyLateness {
				for _, phase := range []string{"lateness", "lateness_vacuumed"} {
					_, counted := vals[phase+"_autovacuum_msgs"]
					if !counted || vals["p99_"+phase+"_autovacuum_ms"]+vals["p99_"+phase+"_no_autovacuum_ms"] <= 0 {
						t.Errorf("%s: no split by autovacuum in RESULT (%s_autovacuum_msgs reported: %v)", phase, phase, counted)
					}
				}
				if !strings.Contains(report, "Autovacuum in these phases") {
					t.Errorf("report lacks the lateness phases' autovacuum lines")
				}
			}
			if t.Failed() {
				t.Logf("report:\n%s", report)
			}
		})
	}
}

// parseResult reads a RESULT line's key=value pairs, all numeric.
func parseResult(line string) (map[string]float64, error) {
	vals := map[string]float64{}
	for _, kv := range strings.Fields(strings.TrimPrefix(line, "RESULT ")) {
		k, v, ok := strings.Cut(kv, "=")
		if !ok {
			return nil, &strconv.NumError{Func: "pair", Num: kv, Err: strconv.ErrSyntax}
		}
		f, err := strconv.ParseFloat(v, 64)
		if err != nil {
			return nil, err
		}
		if _, dup := vals[k]; dup {
			return nil, &strconv.NumError{Func: "duplicate key", Num: k, Err: strconv.ErrSyntax}
		}
		vals[k] = f
	}
	return vals, nil
}

func TestPercentile(t *testing.T) {
	ms := func(ns ...int) []time.Duration {
		out := make([]time.Duration, len(ns))
		for i, n := range ns {
			out[i] = time.Duration(n) * time.Millisecond
		}
		return out
	}
	hundred := make([]int, 100)
	for i := range hundred {
		hundred[i] = 100 - i // descending: percentile must sort
	}
	for _, tc := range []struct {
		name string
		in   []time.Duration
		q    float64
		want time.Duration
	}{
		{"empty", nil, 0.99, 0},
		{"one", ms(7), 0.5, 7 * time.Millisecond},
		{"median of odd", ms(3, 1, 2), 0.5, 2 * time.Millisecond},
		{"p99 of 100", ms(hundred...), 0.99, 99 * time.Millisecond},
		{"max", ms(hundred...), 1, 100 * time.Millisecond},
		{"p50 of 100", ms(hundred...), 0.5, 50 * time.Millisecond},
		{"negative values", ms(-2, 5, 1), 0.5, time.Millisecond},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := percentile(tc.in, tc.q); got != tc.want {
				t.Errorf("percentile(%v, %v) = %v, want %v", tc.in, tc.q, got, tc.want)
			}
		})
	}
}

func TestVerify(t *testing.T) {
	d := func(key string, i int) delivery { return delivery{key: key, index: i} }
	for _, tc := range []struct {
		name string
		in   []delivery
		n    int
		want check
	}{
		{"all in order", []delivery{d("a", 0), d("b", 1), d("a", 2)}, 3, check{expected: 3, delivered: 3}},
		{"missing", []delivery{d("a", 0), d("a", 2)}, 3, check{expected: 3, delivered: 2}},
		{"duplicate", []delivery{d("a", 0), d("a", 0), d("a", 1)}, 2, check{expected: 2, delivered: 2, duplicates: 1}},
		{"out of order within a key", []delivery{d("a", 2), d("b", 0), d("a", 1)}, 3, check{expected: 3, delivered: 3, outOfOrder: 1}},
		{"other keys may interleave", []delivery{d("a", 1), d("b", 0)}, 2, check{expected: 2, delivered: 2}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := verify(tc.in, tc.n); got != tc.want {
				t.Errorf("verify = %+v, want %+v", got, tc.want)
			}
			if err := tc.want.err("x"); (err == nil) != (tc.want.delivered == tc.n && tc.want.outOfOrder == 0) {
				t.Errorf("err() = %v for %+v", err, tc.want)
			}
		})
	}
}

func TestResultLine(t *testing.T) {
	s := &summary{vals: map[string]float64{}}
	s.set("e2e_msgs_per_s", 12345.6)
	s.set("p99_lateness_ms", 12.345)
	s.set("e2e_vs_ceiling", 0.41234)
	s.set("e2e_msgs_per_s", 20000) // a second set replaces, keeping the order
	want := "RESULT e2e_msgs_per_s=20000 p99_lateness_ms=12.3 e2e_vs_ceiling=0.412"
	if got := s.resultLine(); got != want {
		t.Errorf("resultLine() = %q, want %q", got, want)
	}
	vals, err := parseResult(want)
	if err != nil || len(vals) != 3 || vals["e2e_vs_ceiling"] != 0.412 {
		t.Errorf("parseResult(%q) = %v, %v", want, vals, err)
	}
}

func TestPayloadIndex(t *testing.T) {
	for _, i := range []int{0, 1, 999_999_999} {
		p := payload(i)
		if len(p) != 128 {
			t.Errorf("payload(%d) is %d bytes, want 128", i, len(p))
		}
		if got, ok := index(p); !ok || got != i {
			t.Errorf("index(payload(%d)) = %d, %v", i, got, ok)
		}
	}
	if _, ok := index([]byte("not a payload")); ok {
		t.Error("index accepted a foreign value")
	}
}

func TestConfigFromEnv(t *testing.T) {
	for _, tc := range []struct {
		name    string
		environ []string
		mode    string
		n       int
		wantErr string
	}{
		{"default is full", nil, "full", 100_000, ""},
		{"quick", []string{"BENCH_QUICK=1"}, "quick", 20_000, ""},
		{"smoke wins over quick", []string{"BENCH_QUICK=true", "BENCH_SMOKE=1"}, "smoke", 300, ""},
		{"off", []string{"BENCH_QUICK=0"}, "full", 100_000, ""},
		{"N overrides", []string{"BENCH_QUICK=1", "BENCH_N=5000"}, "quick", 5000, ""},
		{"bad switch", []string{"BENCH_QUICK=yes please"}, "", 0, "BENCH_QUICK"},
		{"N too small", []string{"BENCH_N=10"}, "", 0, "BENCH_N"},
		{"lateness rate", []string{"BENCH_QUICK=1", "BENCH_LATE_RATE=200"}, "quick", 20_000, ""},
		{"lateness rate too low", []string{"BENCH_LATE_RATE=5"}, "", 0, "BENCH_LATE_RATE"},
		{"lateness rate not a number", []string{"BENCH_LATE_RATE=5k"}, "", 0, "BENCH_LATE_RATE"},
		{"only the gate", []string{"BENCH_QUICK=1", "BENCH_ONLY=gate"}, "quick", 20_000, ""},
		{"only the console", []string{"BENCH_ONLY=console", "BENCH_CONSOLE_ROWS=5000"}, "full", 100_000, ""},
		{"only the bare queue", []string{"BENCH_QUICK=1", "BENCH_ONLY=bare"}, "quick", 20_000, ""},
		{"only the partitions", []string{"BENCH_SMOKE=1", "BENCH_ONLY=partitions"}, "smoke", 300, ""},
		{"only the lateness", []string{"BENCH_QUICK=1", "BENCH_ONLY=lateness"}, "quick", 20_000, ""},
		{"only what", []string{"BENCH_ONLY=river"}, "", 0, "BENCH_ONLY"},
		{"console rows too few", []string{"BENCH_CONSOLE_ROWS=10"}, "", 0, "BENCH_CONSOLE_ROWS"},
		{"service settings", []string{"BENCH_SERVICE_ENV=DISPATCH_BATCH_KEYS=250  INGEST_BATCH_LINGER=5ms"}, "full", 100_000, ""},
		{"service setting without a value", []string{"BENCH_SERVICE_ENV=DISPATCH_BATCH_KEYS"}, "", 0, "BENCH_SERVICE_ENV"},
		{"service setting without a name", []string{"BENCH_SERVICE_ENV==5"}, "", 0, "BENCH_SERVICE_ENV"},
		{"database locale", []string{"BENCH_DB_LOCALE=en_US.UTF-8"}, "full", 100_000, ""},
		{"database locale with a quote", []string{"BENCH_DB_LOCALE=en_US'; DROP DATABASE x; --"}, "", 0, "BENCH_DB_LOCALE"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg, err := configFromEnv(tc.environ)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("configFromEnv(%q) error = %v, want one naming %s", tc.environ, err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatalf("configFromEnv(%q): %v", tc.environ, err)
			}
			if cfg.Mode != tc.mode || cfg.N != tc.n {
				t.Errorf("configFromEnv(%q) = mode %s, N %d; want %s, %d", tc.environ, cfg.Mode, cfg.N, tc.mode, tc.n)
			}
			if want := 5_000; tc.name == "quick" && cfg.LateRate != want {
				t.Errorf("LateRate = %d on the quick size's default, want %d", cfg.LateRate, want)
			}
			if want := 200; tc.name == "lateness rate" && cfg.LateRate != want {
				t.Errorf("LateRate = %d, want %d (BENCH_LATE_RATE)", cfg.LateRate, want)
			}
			if tc.name == "database locale" && cfg.DBLocale != "en_US.UTF-8" {
				t.Errorf("DBLocale = %q, want en_US.UTF-8", cfg.DBLocale)
			}
			if tc.name == "service settings" {
				if want := []string{"DISPATCH_BATCH_KEYS=250", "INGEST_BATCH_LINGER=5ms"}; !slices.Equal(cfg.ServiceEnv, want) {
					t.Errorf("ServiceEnv = %q, want %q", cfg.ServiceEnv, want)
				}
			}
		})
	}
}

// runSmoke runs one scenario alone (BENCH_ONLY=only) in the smoke size
// against the test server, and returns its configuration, its report and
// the values of its RESULT line.
func runSmoke(t *testing.T, only string) (config, string, map[string]float64) {
	t.Helper()
	cfg := modes["smoke"]
	cfg.Only = only
	cfg.DatabaseURL = pgtest.AdminURL(t)
	var out, progress bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	if err := run(ctx, cfg, &out, &progress); err != nil {
		t.Fatalf("bench: %v\nprogress:\n%s", err, progress.String())
	}
	report := strings.TrimRight(out.String(), "\n")
	lines := strings.Split(report, "\n")
	vals, err := parseResult(lines[len(lines)-1])
	if err != nil {
		t.Fatalf("RESULT line %q: %v\nreport:\n%s", lines[len(lines)-1], err, report)
	}
	return cfg, report, vals
}

// BENCH_DB_LOCALE: the bench's databases, the template and its clones, are
// in that locale, and the report's database line names it; a locale the
// server lacks stops the run with an error that names the variable. The
// locale asked for is whichever of C and C.UTF-8 (every Debian machine has
// both) the server's default is not, so that a bench ignoring the setting
// fails.
func TestDatabaseLocale(t *testing.T) {
	ctx := t.Context()
	admin, err := pgx.Connect(ctx, pgtest.AdminURL(t))
	if err != nil {
		t.Fatal(err)
	}
	var serverDefault string
	err = admin.QueryRow(ctx, `SELECT datcollate FROM pg_database WHERE datname = 'template1'`).Scan(&serverDefault)
	admin.Close(ctx)
	if err != nil {
		t.Fatal(err)
	}
	locale := "C.UTF-8"
	if serverDefault == locale {
		locale = "C"
	}

	say := func(string, ...any) {}
	p, err := startPostgres(ctx, pgtest.AdminURL(t), locale, false, say)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.close(context.Background(), "") })
	db, err := p.fresh(ctx, "locale")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.drop(context.Background(), db) })
	var collate string
	if err := db.pool.QueryRow(ctx, `SELECT datcollate FROM pg_database WHERE datname = current_database()`).Scan(&collate); err != nil {
		t.Fatal(err)
	}
	if collate != locale {
		t.Errorf("a clone of the bench's template collates %q, want %q (the server's default is %q)", collate, locale, serverDefault)
	}
	if info := p.serverInfo(ctx); !strings.HasSuffix(info, "databases collate "+locale) {
		t.Errorf("serverInfo = %q, want it to name the databases' collation %s", info, locale)
	}

	_, err = startPostgres(ctx, pgtest.AdminURL(t), "xx_NOWHERE.UTF-8", false, say)
	if err == nil || !strings.Contains(err.Error(), "BENCH_DB_LOCALE") {
		t.Errorf("startPostgres in a locale the server lacks: %v, want an error naming BENCH_DB_LOCALE", err)
	}
}
