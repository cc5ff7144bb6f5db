package gate

import (
	"context"
	"errors"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/deferq/scheduler/internal/defer/protocol"
	"github.com/deferq/scheduler/internal/kafkatest"
)

// TestBlocks: which records a key's state keeps from the handler, and how
// a deferral in the batch changes the state.
func TestBlocks(t *testing.T) {
	tests := []struct {
		name          string
		st            KeyState
		fromScheduler bool
		seq           int64
		want          bool
	}{
		{"free key", KeyState{}, false, 0, false},
		{"main-topic record of a pending key", KeyState{Blocked: true, Reason: ReasonPending, HeadSeq: 5}, false, 0, true},
		{"main-topic record of an in-flight key", KeyState{Blocked: true, Reason: ReasonInFlight}, false, 0, true},
		{"republished record ahead of the head", KeyState{Blocked: true, Reason: ReasonPending, HeadSeq: 5}, true, 3, false},
		{"republished record behind the head", KeyState{Blocked: true, Reason: ReasonPending, HeadSeq: 5}, true, 7, true},
		{"republished record, in flight, nothing waiting", KeyState{Blocked: true, Reason: ReasonInFlight}, true, 7, false},
		{"republished record, unknown state", KeyState{Blocked: true, Reason: ReasonUnknown}, true, 3, true},
	}
	for _, tt := range tests {
		if got := blocks(tt.st, tt.fromScheduler, tt.seq); got != tt.want {
			t.Errorf("%s: blocks = %v, want %v", tt.name, got, tt.want)
		}
	}
	if st := block(KeyState{}, 0); !st.Blocked || st.Reason != ReasonLocal || st.HeadSeq != 0 {
		t.Errorf("a free key after a main-topic deferral: %+v, want blocked locally", st)
	}
	if st := block(KeyState{Blocked: true, Reason: ReasonPending, HeadSeq: 9}, 4); st.HeadSeq != 4 || st.Reason != ReasonPending {
		t.Errorf("a pending key after re-deferring seq 4: %+v, want its head at 4", st)
	}
	if st := block(KeyState{Blocked: true, Reason: ReasonPending, HeadSeq: 4}, 9); st.HeadSeq != 4 {
		t.Errorf("a pending key after re-deferring seq 9: %+v, want its head kept at 4", st)
	}
}

// batch is a Consumer over a slice of records, as an adapter would be,
// noting what the gate asked of it.
type batch struct {
	recs    []Record
	handle  func(ctx context.Context, r Record) error
	handled []string
	marked  []int
	commits int
}

func (b *batch) BusinessKey(i int) string { return BusinessKey(b.recs[i]) }
func (b *batch) Handle(ctx context.Context, i int) error {
	b.handled = append(b.handled, string(b.recs[i].Value))
	return b.handle(ctx, b.recs[i])
}
func (b *batch) Mark(i int)             { b.marked = append(b.marked, i) }
func (b *batch) Commit(context.Context) { b.commits++ }

func records(values ...string) []Record {
	var recs []Record
	for i, v := range values {
		r := Record{Topic: "orders", Offset: int64(i), Key: []byte("order-1"), Value: []byte(v)}
		if strings.HasPrefix(v, "retried") {
			// Republished by the scheduler.
			r.Headers = []Header{{Key: protocol.HeaderID, Value: []byte("1")}, {Key: protocol.HeaderSeq, Value: []byte(strconv.Itoa(i + 1))}}
		}
		recs = append(recs, r)
	}
	return recs
}

// TestHandleBatch: records are marked in order once handled or durably
// deferred, a failed record is deferred to the retry topic, a batch with
// republished records is committed, and a deferral that fails stops the
// batch with the record and those after it unmarked. The gate is off (no
// scheduler); the deferrals go to a real broker.
func TestHandleBatch(t *testing.T) {
	addr := kafkatest.Start(t, kafkatest.Broker{Topics: []string{DefaultDeferTopic}, Partitions: 2})
	g, err := New(Config{Group: "payments"}, newTestProducer(t, addr))
	if err != nil {
		t.Fatal(err)
	}
	failOn := func(value string) func(context.Context, Record) error {
		return func(_ context.Context, r Record) error {
			if string(r.Value) == value {
				return errors.New("provider timeout")
			}
			return nil
		}
	}
	ctx := t.Context()
	var claim ClaimState

	b := &batch{recs: records("a", "fail", "retried-c"), handle: failOn("fail")}
	if err := g.HandleBatch(ctx, &claim, b.recs, BatchConfig{NoGate: true}, b); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(b.marked, []int{0, 1, 2}) || b.commits != 1 {
		t.Errorf("marked %v with %d commits, want 0, 1, 2 and one commit (a republished record)", b.marked, b.commits)
	}
	col := kafkatest.Collect(t, addr, DefaultDeferTopic)
	got := col.Wait(t, 1, 10*time.Second)
	if d := got[0]; string(d.Value) != "fail" || kafkatest.Header(d, protocol.HeaderTarget) != "orders.retry" ||
		kafkatest.Header(d, protocol.HeaderGroup) != "payments" || kafkatest.Header(d, protocol.HeaderErrorClass) != "*errors.errorString" {
		t.Errorf("deferred %q with headers %v, want fail to orders.retry for payments, classified", d.Value, d.Headers)
	}
	if st := g.Stats(); st.Handled != 2 || st.Deferred != 1 || st.Queries != 0 {
		t.Errorf("stats %+v, want 2 handled, 1 deferred, no query", st)
	}

	// No target for the failed record: it cannot be deferred.
	b = &batch{recs: records("a", "fail", "b"), handle: failOn("fail")}
	err = g.HandleBatch(ctx, &claim, b.recs, BatchConfig{NoGate: true, RetryTopic: func(string) string { return "" }}, b)
	if err == nil || !strings.Contains(err.Error(), "no target") {
		t.Errorf("HandleBatch = %v, want the deferral refused for want of a target", err)
	}
	if !slices.Equal(b.marked, []int{0}) || !slices.Equal(b.handled, []string{"a", "fail"}) {
		t.Errorf("handled %q and marked %v, want a and fail handled, a alone marked", b.handled, b.marked)
	}

	// The handler stops for its ctx: what came before is settled, the
	// rest is left to be read again, without an error.
	cctx, cancel := context.WithCancel(ctx)
	b = &batch{recs: records("a", "stop", "b"), handle: func(ctx context.Context, r Record) error {
		if string(r.Value) == "stop" {
			cancel()
			return ctx.Err()
		}
		return nil
	}}
	if err := g.HandleBatch(cctx, &claim, b.recs, BatchConfig{NoGate: true}, b); err != nil {
		t.Errorf("HandleBatch stopped by its ctx = %v, want nil", err)
	}
	if !slices.Equal(b.marked, []int{0}) {
		t.Errorf("marked %v, want a alone", b.marked)
	}
}
