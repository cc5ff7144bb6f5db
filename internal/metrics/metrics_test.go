package metrics

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// gathered is one Gather of a registry, by metric name.
type gathered map[string]*dto.MetricFamily

func gather(t *testing.T, reg *prometheus.Registry) gathered {
	t.Helper()
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := gathered{}
	for _, f := range fams {
		out[f.GetName()] = f
	}
	return out
}

// value returns the value of the counter or gauge series of name with
// exactly the given label pairs.
func (g gathered) value(name string, labels ...string) (float64, bool) {
	for _, m := range g[name].GetMetric() {
		if len(m.GetLabel())*2 != len(labels) {
			continue
		}
		match := true
		for _, lp := range m.GetLabel() {
			i := slices.Index(labels, lp.GetName())
			match = match && i >= 0 && i%2 == 0 && labels[i+1] == lp.GetValue()
		}
		if !match {
			continue
		}
		if m.GetCounter() != nil {
			return m.GetCounter().GetValue(), true
		}
		return m.GetGauge().GetValue(), true
	}
	return 0, false
}

// A pool that never connects: pgxpool.New is lazy, and Stat reads only
// what the pool knows, so the collector can be tested without a server.
func lazyPool(t *testing.T) *pgxpool.Pool {
	t.Helper()
	pool, err := pgxpool.New(context.Background(), "postgres://nobody@127.0.0.1:1/none?pool_max_conns=7")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

func TestNewExportsEveryName(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := New(reg, "v1.2.3")
	m.WatchPool(lazyPool(t))
	m.IngestBatch(3, 1, 1, map[string]int{"missing_target": 1}, time.Millisecond)
	m.IngestParked(map[string]int{"exhausted": 2, "non_retriable: defer.error.class \"x\"": 1, "permanent": 0})
	m.SetLag(0, 5)
	m.Published("orders.retry", 2)
	m.PublishError("orders.retry", "retriable")
	m.Parked("orders.retry", "unknown_topic: gone")
	m.ObserveLateness(time.Second)
	m.Round(time.Millisecond)
	m.SetBacklog(Backlog{Messages: map[string]map[string]int64{"orders.retry": {"pending": 1}}, KeysHeldParked: 4, DLQUnsent: 2})
	m.DLQPublished(3)
	m.DLQPublishError("unknown_topic")
	m.RiverJob("scheduler_maintenance", "completed")
	m.SetReady(true)

	g := gather(t, reg)
	for _, name := range Names() {
		if g[name] == nil {
			t.Errorf("%s is not exported", name)
		}
	}
	for name := range g {
		if !slices.Contains(Names(), name) {
			t.Errorf("%s is exported but not in Names()", name)
		}
	}
	for _, c := range []struct {
		name   string
		labels []string
		want   float64
	}{
		{BuildInfo, []string{"version", "v1.2.3"}, 1},
		{Ready, nil, 1},
		{IngestRecords, []string{"result", "stored"}, 3},
		{IngestRecords, []string{"result", "duplicate"}, 1},
		{IngestRecords, []string{"result", "rejected"}, 1},
		{IngestRejected, []string{"reason", "missing_target"}, 1},
		{IngestParked, []string{"reason", "exhausted"}, 2},
		{IngestParked, []string{"reason", "non_retriable"}, 1},
		{IngestLag, []string{"partition", "0"}, 5},
		{DispatchParked, []string{"target", "orders.retry", "reason", "unknown_topic"}, 1},
		{DBPoolConnections, []string{"state", "max"}, 7},
		{DBPoolConnections, []string{"state", "total"}, 0},
		{DBPoolAcquireWait, nil, 0},
		{KeysHeldParked, nil, 4},
		{DLQUnsent, nil, 2},
		{DLQPublished, nil, 3},
		{DLQPublishErrors, []string{"kind", "unknown_topic"}, 1},
		{DLQPublishErrors, []string{"kind", "retriable"}, 0},
	} {
		if v, ok := g.value(c.name, c.labels...); !ok || v != c.want {
			t.Errorf("%s%v = %v (present %v), want %v", c.name, c.labels, v, ok, c.want)
		}
	}
	// The codes of ingest are exported from the start, so that rate()
	// works from the first increment.
	if v, ok := g.value(IngestParked, "reason", "permanent"); !ok || v != 0 {
		t.Errorf("%s{reason=permanent} = %v (present %v), want 0", IngestParked, v, ok)
	}
}

// The pool metrics say nothing until a pool is given, rather than zeros
// that look like an empty pool.
func TestPoolMetricsNeedAPool(t *testing.T) {
	reg := prometheus.NewRegistry()
	New(reg, "dev")
	g := gather(t, reg)
	if g[DBPoolConnections] != nil || g[DBPoolAcquireWait] != nil {
		t.Error("pool metrics exported without a pool")
	}
}

// A nil *Metrics records nothing and does not panic, so components can be
// built without metrics.
func TestNilMetricsIsANoOp(t *testing.T) {
	var m *Metrics
	m.WatchPool(nil)
	m.IngestBatch(1, 1, 1, map[string]int{"x": 1}, time.Second)
	m.IngestParked(map[string]int{"x": 1})
	m.SetLag(1, 1)
	m.DeleteLag(1)
	m.Published("t", 1)
	m.PublishError("t", "retriable")
	m.Parked("t", "r")
	m.ObserveLateness(time.Second)
	m.Round(time.Second)
	m.RiverJob("k", "completed")
	m.DLQPublished(1)
	m.DLQPublishError("retriable")
	m.SetReady(true)
	m.SetBacklog(Backlog{})
}

func TestReasonCode(t *testing.T) {
	for _, c := range []struct{ reason, code string }{
		{"missing_target: no defer.target header", "missing_target"},
		{"unknown_topic: kafka server: ...", "unknown_topic"},
		{"operator: bad address", "operator"},
		{"operator", "operator"},
		{"target_not_allowed", "target_not_allowed"},
		{"", ""},
		{"invalid_at: value \"a: b\"", "invalid_at"},
	} {
		if got := ReasonCode(c.reason); got != c.code {
			t.Errorf("ReasonCode(%q) = %q, want %q", c.reason, got, c.code)
		}
	}
}

// Each target present gets every state and a due count, zeros included;
// a target that is gone loses its series.
func TestSetBacklog(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := New(reg, "dev")
	steps := []struct {
		name    string
		backlog Backlog
		// want lists target, state, value; state "due" means MessagesDue.
		want   [][3]any
		absent []string // targets with no series
	}{
		{
			name: "two targets",
			backlog: Backlog{
				Messages:  map[string]map[string]int64{"a": {"pending": 3, "parked": 1}, OtherTarget: {"rejected": 2}},
				Due:       map[string]int64{"a": 2},
				OldestDue: 1500 * time.Millisecond, HeldKeys: 1, KeysHeldParked: 5,
			},
			want: [][3]any{
				{"a", "pending", 3.0}, {"a", "parked", 1.0}, {"a", "rejected", 0.0}, {"a", "due", 2.0},
				{OtherTarget, "rejected", 2.0}, {OtherTarget, "pending", 0.0}, {OtherTarget, "due", 0.0},
			},
		},
		{
			name:    "a is gone",
			backlog: Backlog{Messages: map[string]map[string]int64{OtherTarget: {"rejected": 2}}},
			want:    [][3]any{{OtherTarget, "rejected", 2.0}},
			absent:  []string{"a"},
		},
		{
			name:    "empty",
			backlog: Backlog{},
			absent:  []string{"a", OtherTarget},
		},
	}
	for _, step := range steps {
		m.SetBacklog(step.backlog)
		g := gather(t, reg)
		for _, w := range step.want {
			target, state, want := w[0].(string), w[1].(string), w[2].(float64)
			var v float64
			var ok bool
			if state == "due" {
				v, ok = g.value(MessagesDue, "target", target)
			} else {
				v, ok = g.value(Messages, "target", target, "state", state)
			}
			if !ok || v != want {
				t.Errorf("%s: %s %s = %v (present %v), want %v", step.name, target, state, v, ok, want)
			}
		}
		for _, target := range step.absent {
			for _, s := range states() {
				if _, ok := g.value(Messages, "target", target, "state", s); ok {
					t.Errorf("%s: %s{target=%s,state=%s} still exported", step.name, Messages, target, s)
				}
			}
			if _, ok := g.value(MessagesDue, "target", target); ok {
				t.Errorf("%s: %s{target=%s} still exported", step.name, MessagesDue, target)
			}
		}
		oldest, _ := g.value(OldestDue)
		held, _ := g.value(HeldKeys)
		heldParked, _ := g.value(KeysHeldParked)
		if oldest != step.backlog.OldestDue.Seconds() || held != float64(step.backlog.HeldKeys) ||
			heldParked != float64(step.backlog.KeysHeldParked) {
			t.Errorf("%s: oldest due %v, held %v, held by parked %v; want %v, %v, %v", step.name, oldest, held, heldParked,
				step.backlog.OldestDue.Seconds(), step.backlog.HeldKeys, step.backlog.KeysHeldParked)
		}
	}
}

func TestLagIsNeverNegativeAndGoesWithTheClaim(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := New(reg, "dev")
	m.SetLag(3, -2) // high-water mark read before the batch's records
	if v, ok := gather(t, reg).value(IngestLag, "partition", "3"); !ok || v != 0 {
		t.Errorf("lag = %v (present %v), want 0", v, ok)
	}
	m.DeleteLag(3)
	if _, ok := gather(t, reg).value(IngestLag, "partition", "3"); ok {
		t.Error("lag of a released partition still exported")
	}
}

// Target labels are bounded: past MaxTargets distinct targets, the rest
// count as OtherTarget.
func TestTargetLabelsBounded(t *testing.T) {
	m := New(prometheus.NewRegistry(), "test")
	for i := range MaxTargets {
		if got := m.Target(fmt.Sprintf("orders.%d", i)); got != fmt.Sprintf("orders.%d", i) {
			t.Fatalf("target %d labelled %q", i, got)
		}
	}
	if got := m.Target("orders.one-too-many"); got != OtherTarget {
		t.Fatalf("target past the bound labelled %q, want %q", got, OtherTarget)
	}
	if got := m.Target("orders.0"); got != "orders.0" {
		t.Fatalf("a target seen before keeps its label, got %q", got)
	}
	var nilMetrics *Metrics
	if got := nilMetrics.Target("x"); got != "x" {
		t.Fatalf("nil Metrics: %q", got)
	}
}

// A scrape shows one backlog read whole, even while SetBacklog runs: every
// figure of a read here equals n, so a scrape mixing two reads (Prometheus
// gathers collectors concurrently) shows two values. With a gauge per figure
// this failed within the first few scrapes; the service's metrics test then
// saw a message pending but not due.
func TestScrapeShowsOneBacklogRead(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := New(reg, "dev")
	read := func(n int64) Backlog {
		targets := map[string]map[string]int64{}
		due := map[string]int64{}
		// A target appears with the first read that counts it, as a
		// message's target does.
		for i := range n % 4 {
			targets[fmt.Sprint("t", i)] = map[string]int64{"pending": n, "parked": n, "rejected": n}
			due[fmt.Sprint("t", i)] = n
		}
		return Backlog{Messages: targets, Due: due, OldestDue: time.Duration(n) * time.Second,
			HeldKeys: n, KeysHeldParked: n, DLQUnsent: n, OldestTransaction: time.Duration(n) * time.Second,
			InflightKeys: n, InflightOldest: time.Duration(n) * time.Second}
	}
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for n := int64(1); ; n++ {
			select {
			case <-stop:
				return
			default:
				m.SetBacklog(read(n))
			}
		}
	}()
	defer func() { close(stop); <-done }()
	for range 2000 {
		g := gather(t, reg)
		held, _ := g.value(HeldKeys)
		var series int
		for _, name := range []string{Messages, MessagesDue, OldestDue, HeldKeys, DBOldestTransaction, KeysHeldParked,
			DLQUnsent, InflightKeys, InflightOldest} {
			for _, s := range g[name].GetMetric() {
				series++
				if v := s.GetGauge().GetValue(); v != held {
					t.Fatalf("one scrape mixes backlog reads: %s%v = %v, %s = %v", name, s.GetLabel(), v, HeldKeys, held)
				}
			}
		}
		if want := 7 + 4*int(int64(held)%4); series != want {
			t.Fatalf("read %v: %d backlog series, want %d (a target per read mod 4, four series each)", held, series, want)
		}
	}
}
