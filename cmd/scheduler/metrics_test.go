package main

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/deferq/scheduler/internal/config"
	"github.com/deferq/scheduler/internal/metrics"
	"github.com/deferq/scheduler/internal/pgtest"
)

// metricsSnapshot is one scrape of /metrics, parsed.
type metricsSnapshot map[string]*dto.MetricFamily

func scrapeMetrics(t *testing.T, p *proc) metricsSnapshot {
	t.Helper()
	resp, err := http.Get("http://" + p.HTTPAddr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("/metrics: %s", resp.Status)
	}
	parser := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := parser.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatalf("parse /metrics: %v", err)
	}
	return fams
}

// series returns the sample of name whose labels include the given
// name=value pairs, if any.
func (s metricsSnapshot) series(name string, labels ...string) (*dto.Metric, bool) {
	fam := s[name]
	if fam == nil {
		return nil, false
	}
next:
	for _, m := range fam.GetMetric() {
		for i := 0; i+1 < len(labels); i += 2 {
			found := false
			for _, lp := range m.GetLabel() {
				if lp.GetName() == labels[i] && lp.GetValue() == labels[i+1] {
					found = true
				}
			}
			if !found {
				continue next
			}
		}
		return m, true
	}
	return nil, false
}

// value is the value of a counter or gauge series, and whether it exists.
func (s metricsSnapshot) value(name string, labels ...string) (float64, bool) {
	m, ok := s.series(name, labels...)
	if !ok {
		return 0, false
	}
	switch {
	case m.GetCounter() != nil:
		return m.GetCounter().GetValue(), true
	case m.GetGauge() != nil:
		return m.GetGauge().GetValue(), true
	}
	return m.GetUntyped().GetValue(), true
}

// histogram is the count and sum of a histogram without labels.
func (s metricsSnapshot) histogram(name string) (uint64, float64) {
	m, ok := s.series(name)
	if !ok || m.GetHistogram() == nil {
		return 0, 0
	}
	return m.GetHistogram().GetSampleCount(), m.GetHistogram().GetSampleSum()
}

func (s metricsSnapshot) count(name string) int {
	if s[name] == nil {
		return 0
	}
	return len(s[name].GetMetric())
}

// eventually scrapes until cond holds and returns that scrape.
func waitMetrics(t *testing.T, p *proc, within time.Duration, what string, cond func(metricsSnapshot) bool) metricsSnapshot {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		s := scrapeMetrics(t, p)
		if cond(s) {
			return s
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %v", what, within)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// is reports whether a counter or gauge has value want.
func (s metricsSnapshot) is(want float64, name string, labels ...string) bool {
	v, ok := s.value(name, labels...)
	return ok && v == want
}

// Every metric changes as expected across a scripted run: ingest valid and
// rejected records, dispatch, park on an unknown topic, fail retriably on a
// topic whose produces the broker refuses, then recover.
func TestMetricsFollowAScriptedRun(t *testing.T) {
	const (
		missingTopic = "orders.nosuch" // allowed by TARGET_TOPICS, absent from the broker: parked
		flakyTopic   = "orders.flaky"  // exists, but the broker refuses produces retriably
	)
	kc, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(4, deferTopic, targetTopic, flakyTopic))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(kc.Close)
	brokers := kc.ListenAddrs()[0]
	fault := kc.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: flakyTopic, Err: kerr.NotEnoughReplicas, Count: -1})
	defer fault.Remove()

	db := pgtest.NewDB(t)
	p := start(t, append(serviceEnv(db.URL, brokers, "e2e-metrics"), "METRICS_INTERVAL=200ms"))

	// Before anything: the static series are there, counters at zero.
	s := scrapeMetrics(t, p)
	for _, name := range []string{metrics.IngestRecords, metrics.BuildInfo, metrics.Ready, metrics.DBPoolConnections, metrics.DBPoolAcquireWait} {
		if s[name] == nil {
			t.Errorf("%s missing before any traffic", name)
		}
	}
	for _, result := range []string{"stored", "duplicate", "rejected"} {
		if !s.is(0, metrics.IngestRecords, "result", result) {
			t.Errorf("%s{result=%s} should start at 0", metrics.IngestRecords, result)
		}
	}
	// The collector's settings (internal/service: memoryLimit, gcPercent),
	// as Go's runtime reports them: the soft limit of the defaults, and
	// GOGC=200 under it.
	limit, _ := s.value("go_gc_gomemlimit_bytes")
	gogc, _ := s.value("go_gc_gogc_percent")
	if limit != 160<<20 || gogc != 200 {
		t.Errorf("go_gc_gomemlimit_bytes %v, go_gc_gogc_percent %v; want the defaults' %d and 200", limit, gogc, 160<<20)
	}
	if !s.is(1, metrics.BuildInfo, "version", "dev") {
		t.Errorf("%s{version=dev} = 1 missing", metrics.BuildInfo)
	}
	if !s.is(1, metrics.Ready) {
		t.Errorf("%s should be 1 once /readyz passed", metrics.Ready)
	}
	if !s.is(20, metrics.DBPoolConnections, "state", "max") {
		t.Errorf("%s{state=max} should be DB_MAX_CONNS (20)", metrics.DBPoolConnections)
	}
	if n, _ := s.value(metrics.DBPoolConnections, "state", "total"); n < 1 {
		t.Errorf("%s{state=total} = %v, want >= 1", metrics.DBPoolConnections, n)
	}

	out := read(t, brokers, targetTopic)
	prod := producer(t, brokers)
	for _, m := range []struct {
		key, target, delay string
	}{
		{"order-1", targetTopic, "0"}, {"order-1", targetTopic, "0"}, {"order-1", targetTopic, "0"},
		{"order-2", missingTopic, "0"},
		{"order-3", flakyTopic, "0"},
		{"order-4", "", "0"},             // missing_target
		{"order-5", targetTopic, "soon"}, // invalid_delay
	} {
		var headers []string
		if m.target != "" {
			headers = append(headers, "defer.target", m.target)
		}
		headers = append(headers, "defer.delay", m.delay)
		if _, _, err := prod.SendMessage(deferRecord(m.key, "v", headers...)); err != nil {
			t.Fatal(err)
		}
	}
	out.until(t, 15*time.Second, "three deliveries to "+targetTopic, atLeast(3))
	waitRows(t, db.Pool, 15*time.Second, "SELECT count(*) FROM deferred_message WHERE state = 'parked'", 1)

	s = waitMetrics(t, p, 15*time.Second, "metrics after the run", func(s metricsSnapshot) bool {
		n, _ := s.value(metrics.DispatchPublishErrors, "target", flakyTopic, "kind", "retriable")
		loops, _ := s.value(metrics.RiverJobs, "kind", "scheduler_dispatch_loop", "outcome", "completed")
		// Maintenance runs on start, once this process is River's leader.
		maint, _ := s.value(metrics.RiverJobs, "kind", "scheduler_maintenance", "outcome", "completed")
		return n >= 1 && loops >= 1 && maint >= 1 &&
			s.is(3, metrics.DispatchPublished, "target", targetTopic) &&
			// The backlog query has run since the run settled.
			s.is(1, metrics.Messages, "target", missingTopic, "state", "parked") &&
			s.is(1, metrics.HeldKeys)
	})

	t.Run("ingest", func(t *testing.T) {
		for _, c := range []struct {
			result string
			want   float64
		}{{"stored", 5}, {"rejected", 2}, {"duplicate", 0}} {
			if v, _ := s.value(metrics.IngestRecords, "result", c.result); v != c.want {
				t.Errorf("%s{result=%s} = %v, want %v", metrics.IngestRecords, c.result, v, c.want)
			}
		}
		for _, reason := range []string{"missing_target", "invalid_delay"} {
			if !s.is(1, metrics.IngestRejected, "reason", reason) {
				t.Errorf("%s{reason=%s} != 1", metrics.IngestRejected, reason)
			}
		}
		if n := s.count(metrics.IngestRejected); n != 2 {
			t.Errorf("%d %s series, want 2 (reason codes only)", n, metrics.IngestRejected)
		}
		batches, records := s.histogram(metrics.IngestBatchRecords)
		if batches == 0 || records != 7 {
			t.Errorf("%s: %d batches of %v records in all, want >= 1 batch, 7 records", metrics.IngestBatchRecords, batches, records)
		}
		if n, _ := s.histogram(metrics.IngestBatchDuration); n != batches {
			t.Errorf("%s counted %d batches, %s %d", metrics.IngestBatchDuration, n, metrics.IngestBatchRecords, batches)
		}
		if s.count(metrics.IngestLag) == 0 {
			t.Errorf("no %s series", metrics.IngestLag)
		}
		for _, m := range s[metrics.IngestLag].GetMetric() {
			if m.GetGauge().GetValue() != 0 {
				t.Errorf("%s %v = %v, want 0 once everything is stored", metrics.IngestLag, m.GetLabel(), m.GetGauge().GetValue())
			}
		}
	})

	t.Run("dispatch", func(t *testing.T) {
		if n, _ := s.histogram(metrics.DispatchLateness); n != 3 {
			t.Errorf("%s counted %d messages, want the 3 published", metrics.DispatchLateness, n)
		}
		rounds, _ := s.histogram(metrics.DispatchRoundDuration)
		if rounds == 0 {
			t.Errorf("%s counted no round", metrics.DispatchRoundDuration)
		}
		// On the defaults (DISPATCH_CLAIMS=1) every claim, empty ones too,
		// waits for a turn first: the turns are wired into the service.
		if waits, _ := s.histogram(metrics.DispatchClaimWait); waits < rounds {
			t.Errorf("%s counted %d waits for a turn, fewer than the %d rounds that claimed keys",
				metrics.DispatchClaimWait, waits, rounds)
		}
		if !s.is(1, metrics.DispatchPublishErrors, "target", missingTopic, "kind", "unknown_topic") {
			t.Errorf("%s{target=%s,kind=unknown_topic} != 1", metrics.DispatchPublishErrors, missingTopic)
		}
		if !s.is(1, metrics.DispatchParked, "target", missingTopic, "reason", "unknown_topic") {
			t.Errorf("%s{target=%s,reason=unknown_topic} != 1", metrics.DispatchParked, missingTopic)
		}
		if _, ok := s.value(metrics.DispatchPublished, "target", flakyTopic); ok {
			t.Errorf("%s counts %s, whose produces all failed", metrics.DispatchPublished, flakyTopic)
		}
	})

	t.Run("backlog", func(t *testing.T) {
		for _, c := range []struct {
			target, state string
			want          float64
		}{
			{targetTopic, "pending", 0}, {targetTopic, "rejected", 1}, {targetTopic, "parked", 0},
			{missingTopic, "parked", 1},
			{flakyTopic, "pending", 1},
			{metrics.OtherTarget, "rejected", 1}, // no target
		} {
			if v, ok := s.value(metrics.Messages, "target", c.target, "state", c.state); !ok || v != c.want {
				t.Errorf("%s{target=%s,state=%s} = %v (present %v), want %v", metrics.Messages, c.target, c.state, v, ok, c.want)
			}
		}
		if !s.is(1, metrics.MessagesDue, "target", flakyTopic) || !s.is(0, metrics.MessagesDue, "target", targetTopic) {
			t.Errorf("%s: want 1 for %s, 0 for %s", metrics.MessagesDue, flakyTopic, targetTopic)
		}
		if v, _ := s.value(metrics.OldestDue); v <= 0 {
			t.Errorf("%s = %v, want > 0 while %s's head waits", metrics.OldestDue, v, flakyTopic)
		}
	})

	t.Run("runtime", func(t *testing.T) {
		for _, kind := range []string{"scheduler_maintenance", "scheduler_dispatch_loop"} {
			if v, _ := s.value(metrics.RiverJobs, "kind", kind, "outcome", "completed"); v < 1 {
				t.Errorf("%s{kind=%s,outcome=completed} = %v, want >= 1", metrics.RiverJobs, kind, v)
			}
		}
		if _, ok := s.value(metrics.DBPoolAcquireWait); !ok {
			t.Errorf("%s missing", metrics.DBPoolAcquireWait)
		}
		if !s.is(1, metrics.Ready) {
			t.Errorf("%s != 1", metrics.Ready)
		}
	})

	// The broker takes produces again: the held key goes out, and the
	// flaky target's series disappear with its last message.
	fault.Remove()
	s = waitMetrics(t, p, 15*time.Second, "recovery in the metrics", func(s metricsSnapshot) bool {
		_, due := s.value(metrics.MessagesDue, "target", flakyTopic)
		_, pending := s.value(metrics.Messages, "target", flakyTopic, "state", "pending")
		return s.is(1, metrics.DispatchPublished, "target", flakyTopic) && !due && !pending &&
			s.is(0, metrics.HeldKeys) && s.is(0, metrics.OldestDue)
	})
	if n, _ := s.histogram(metrics.DispatchLateness); n != 4 {
		t.Errorf("%s counted %d messages, want 4", metrics.DispatchLateness, n)
	}
	for _, name := range metrics.Names() {
		if s[name] == nil {
			t.Errorf("%s is not exported", name)
		}
	}
	for name := range s {
		if strings.HasPrefix(name, "scheduler_") && !slices.Contains(metrics.Names(), name) {
			t.Errorf("%s is exported but not in metrics.Names()", name)
		}
	}

	// A forgotten transaction holding a snapshot shows its age; once it ends,
	// the gauge falls back.
	conn, err := db.Pool.Acquire(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	tx, err := conn.BeginTx(context.Background(), pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(context.Background(), "SELECT count(*) FROM deferred_message"); err != nil {
		t.Fatal(err)
	}
	waitMetrics(t, p, 10*time.Second, "the open transaction's age", func(s metricsSnapshot) bool {
		v, _ := s.value(metrics.DBOldestTransaction)
		return v >= 1
	})
	tx.Rollback(context.Background())
	conn.Release()
	waitMetrics(t, p, 10*time.Second, "the oldest transaction gauge to fall back", func(s metricsSnapshot) bool {
		v, ok := s.value(metrics.DBOldestTransaction)
		return ok && v < 1
	})

	if t.Failed() {
		t.Log(dumpMetrics(s))
	}
	p.stop()
}

// dump renders the scheduler's own series of a scrape, for failure messages.
func dumpMetrics(s metricsSnapshot) string {
	var b strings.Builder
	for name, fam := range s {
		if !strings.HasPrefix(name, "scheduler_") {
			continue
		}
		for _, m := range fam.GetMetric() {
			fmt.Fprintf(&b, "%s %v %v\n", name, m.GetLabel(), m)
		}
	}
	return b.String()
}

// METRICS_INTERVAL is validated like the other variables: the backlog query
// counts the whole table, so it may not run in a busy loop.
func TestMetricsIntervalValidated(t *testing.T) {
	for _, c := range []struct {
		value string
		ok    bool
	}{
		{"", true}, {"15s", true}, {"100ms", true}, {"1h", true},
		{"99ms", false}, {"0", false}, {"2h", false}, {"soon", false},
	} {
		environ := []string{"TARGET_TOPICS=orders.*"}
		if c.value != "" {
			environ = append(environ, "METRICS_INTERVAL="+c.value)
		}
		cfg, err := config.Load(environ)
		switch {
		case c.ok && err != nil:
			t.Errorf("METRICS_INTERVAL=%q: %v", c.value, err)
		case !c.ok && (err == nil || !strings.Contains(err.Error(), "METRICS_INTERVAL=")):
			t.Errorf("METRICS_INTERVAL=%q: error %v, want one naming the variable", c.value, err)
		case c.value == "" && cfg.MetricsInterval != 15*time.Second:
			t.Errorf("default METRICS_INTERVAL = %v, want 15s", cfg.MetricsInterval)
		}
	}
}
