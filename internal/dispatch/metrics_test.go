package dispatch_test

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/deferq/scheduler/internal/defer/protocol"
	"github.com/deferq/scheduler/internal/dispatch"
	"github.com/deferq/scheduler/internal/dispatchtest"
	"github.com/deferq/scheduler/internal/fixture"
	"github.com/deferq/scheduler/internal/keylock"
	"github.com/deferq/scheduler/internal/metrics"
)

// One round counts what it did by target: published with their lateness,
// parked by reason code, publish errors by kind; refused targets are not
// named.
func TestRoundRecordsMetrics(t *testing.T) {
	e := dispatchtest.New(t)
	fault := e.Broker.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: dispatchtest.TopicB, Err: kerr.NotEnoughReplicas, Count: -1})
	defer fault.Remove()
	e.Insert(
		// Two seconds overdue: lateness at least that.
		fixture.Message{Key: fixture.Key("a"), Target: dispatchtest.TopicA, In: -2 * time.Second, RecordKey: []byte("a"), Value: []byte("1")},
		fixture.Message{Key: fixture.Key("a"), Target: dispatchtest.TopicA, In: -2 * time.Second, RecordKey: []byte("a"), Value: []byte("2")},
		fixture.Message{Key: fixture.Key("b"), Target: "orders.nosuch", RecordKey: []byte("b")},     // unknown topic: parked
		fixture.Message{Key: fixture.Key("c"), Target: "elsewhere", RecordKey: []byte("c")},         // not allowed: parked
		fixture.Message{Key: fixture.Key("d"), Target: dispatchtest.TopicB, RecordKey: []byte("d")}, // refused retriably
	)
	reg := prometheus.NewRegistry()
	m := metrics.New(reg, "test")
	l, err := keylock.New(e.Pool, keylock.Config{Owner: "metrics", Lease: time.Minute, PerKey: 100})
	if err != nil {
		t.Fatal(err)
	}
	d, err := dispatch.New(l, e.Producer, nil, dispatch.Config{BatchKeys: 100, PollInterval: 50 * time.Millisecond,
		Targets: protocol.TargetPatterns{"orders.*", "payments.*"}, Metrics: m}, dispatchtest.Logger())
	if err != nil {
		t.Fatal(err)
	}
	st, err := d.Round(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	dispatchtest.MustEqual(t, "published", st.Published, 2)
	dispatchtest.MustEqual(t, "parked", st.Parked, 2)
	dispatchtest.MustEqual(t, "retry", st.Retry, 1)

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
		{metrics.DispatchPublished, map[string]string{"target": dispatchtest.TopicA}, 2},
		{metrics.DispatchParked, map[string]string{"target": "orders.nosuch", "reason": "unknown_topic"}, 1},
		{metrics.DispatchParked, map[string]string{"target": metrics.OtherTarget, "reason": "target_not_allowed"}, 1},
		{metrics.DispatchPublishErrors, map[string]string{"target": "orders.nosuch", "kind": "unknown_topic"}, 1},
		{metrics.DispatchPublishErrors, map[string]string{"target": dispatchtest.TopicB, "kind": "retriable"}, 1},
	} {
		if v := dispatchtest.Counter(got[c.name], c.labels); v != c.want {
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
