package dispatch

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	deferral "github.com/deferq/scheduler/internal/defer"
	"github.com/deferq/scheduler/internal/keylock"
	"github.com/deferq/scheduler/internal/metrics"
)

// One round counts what it did by target: published with their lateness,
// parked by reason code, publish errors by kind; refused targets are not
// named.
func TestRoundRecordsMetrics(t *testing.T) {
	e := newEnv(t)
	fault := e.broker.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: topicB, Err: kerr.NotEnoughReplicas, Count: -1})
	defer fault.Remove()
	e.insert(
		// Two seconds overdue: lateness at least that.
		msg{key: str("a"), target: topicA, in: -2 * time.Second, recKey: []byte("a"), value: []byte("1")},
		msg{key: str("a"), target: topicA, in: -2 * time.Second, recKey: []byte("a"), value: []byte("2")},
		msg{key: str("b"), target: "orders.nosuch", recKey: []byte("b")}, // unknown topic: parked
		msg{key: str("c"), target: "elsewhere", recKey: []byte("c")},     // not allowed: parked
		msg{key: str("d"), target: topicB, recKey: []byte("d")},          // refused retriably
	)
	reg := prometheus.NewRegistry()
	m := metrics.New(reg, "test")
	l, err := keylock.New(e.pool, keylock.Config{Owner: "metrics", Lease: time.Minute, PerKey: 100})
	if err != nil {
		t.Fatal(err)
	}
	d, err := New(l, e.producer, nil, Config{BatchKeys: 100, PollInterval: 50 * time.Millisecond,
		Targets: deferral.TargetPatterns{"orders.*", "payments.*"}, Metrics: m}, testLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	st, err := d.Round(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "published", st.Published, 2)
	mustEqual(t, "parked", st.Parked, 2)
	mustEqual(t, "retry", st.Retry, 1)

	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string][]*dto.Metric{}
	for _, f := range fams {
		got[f.GetName()] = f.GetMetric()
	}
	for _, c := range []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{metrics.DispatchPublished, map[string]string{"target": topicA}, 2},
		{metrics.DispatchParked, map[string]string{"target": "orders.nosuch", "reason": "unknown_topic"}, 1},
		{metrics.DispatchParked, map[string]string{"target": metrics.OtherTarget, "reason": "target_not_allowed"}, 1},
		{metrics.DispatchPublishErrors, map[string]string{"target": "orders.nosuch", "kind": "unknown_topic"}, 1},
		{metrics.DispatchPublishErrors, map[string]string{"target": topicB, "kind": "retriable"}, 1},
	} {
		if v := find(got[c.name], c.labels); v != c.want {
			t.Errorf("%s%v = %v, want %v", c.name, c.labels, v, c.want)
		}
	}
	for _, name := range []string{metrics.DispatchPublished, metrics.DispatchParked, metrics.DispatchPublishErrors} {
		for _, s := range got[name] {
			for _, lp := range s.GetLabel() {
				if lp.GetName() == "target" && lp.GetValue() == "elsewhere" {
					t.Errorf("%s names a target outside TARGET_TOPICS", name)
				}
			}
		}
	}
	late := got[metrics.DispatchLateness][0].GetHistogram()
	if late.GetSampleCount() != 2 || late.GetSampleSum() < 4 || late.GetSampleSum() > 60 {
		t.Errorf("lateness: %d samples summing %vs, want 2 of about 2s each", late.GetSampleCount(), late.GetSampleSum())
	}
	if n := got[metrics.DispatchRoundDuration][0].GetHistogram().GetSampleCount(); n != 1 {
		t.Errorf("round durations: %d, want 1", n)
	}
}

// find returns the value of the counter among ms whose labels are exactly
// labels, or -1.
func find(ms []*dto.Metric, labels map[string]string) float64 {
	for _, m := range ms {
		if len(m.GetLabel()) != len(labels) {
			continue
		}
		match := true
		for _, lp := range m.GetLabel() {
			match = match && labels[lp.GetName()] == lp.GetValue()
		}
		if match {
			return m.GetCounter().GetValue()
		}
	}
	return -1
}

func TestJobOutcome(t *testing.T) {
	for _, c := range []struct {
		kind  river.EventKind
		state rivertype.JobState
		want  string
	}{
		{river.EventKindJobCompleted, rivertype.JobStateCompleted, "completed"},
		{river.EventKindJobFailed, rivertype.JobStateRetryable, "failed"},
		{river.EventKindJobFailed, rivertype.JobStateDiscarded, "discarded"},
		{river.EventKindJobCancelled, rivertype.JobStateCancelled, "cancelled"},
		{river.EventKindJobSnoozed, rivertype.JobStateScheduled, "snoozed"},
		{river.EventKindJobInterrupted, rivertype.JobStateAvailable, "interrupted"},
	} {
		ev := &river.Event{Kind: c.kind, Job: &rivertype.JobRow{Kind: "k", State: c.state}}
		if got := jobOutcome(ev); got != c.want {
			t.Errorf("%s in state %s: %q, want %q", c.kind, c.state, got, c.want)
		}
	}
}
