package gate

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/deferq/scheduler/internal/kafkatest"
	"github.com/deferq/scheduler/internal/keystate"
	"github.com/deferq/scheduler/internal/pgtest"
	"github.com/deferq/scheduler/internal/schedproc"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// A consumer that had an answer which waited for the whole defer topic
// asks later questions without a wait (keyStates with all false). Its own
// deferral, which the scheduler's ingest still holds (a record due in an
// hour lingers up to INGEST_FUTURE_LINGER), is then missing from the
// scheduler's answer: the client keeps the key blocked itself until an
// answer's Stored covers the deferral, and forgets it after. A real
// scheduler answers.
func TestOwnDeferralBlocksUntilStored(t *testing.T) {
	db, _, c := startScheduler(t, "10s")
	ctx := context.Background()

	// The answer that waited for all, as a consumer's first after it got
	// its partitions.
	if _, err := c.keyStates(ctx, []string{"order-1"}, true); err != nil {
		t.Fatal(err)
	}
	msg := Record{Topic: "orders", Key: []byte("order-1"), Value: []byte("charge")}
	if err := c.Defer(ctx, msg, Deferral{Target: "orders.retry", BusinessKey: "order-1", Delay: time.Hour}); err != nil {
		t.Fatal(err)
	}
	states, err := c.keyStates(ctx, []string{"order-1", "order-2"}, false)
	if err != nil {
		t.Fatal(err)
	}
	if st := states["order-1"]; !st.Blocked {
		t.Fatalf("order-1, deferred by this client, asked without a wait: %+v, want blocked", st)
	}
	if st := states["order-2"]; st.Blocked {
		t.Errorf("order-2: %+v, want free", st)
	}
	var stored int
	if err := db.Pool.QueryRow(ctx, "SELECT count(*) FROM deferred_message WHERE business_key = 'order-1'").Scan(&stored); err != nil {
		t.Fatal(err)
	}
	if st := states["order-1"]; stored == 0 && st.Reason != ReasonLocal {
		t.Errorf("order-1 not stored yet: %+v, want blocked by this client's own deferral (%s)", st, ReasonLocal)
	}

	// A question that waits for all has ingest write what it holds: the
	// scheduler's answer covers the deferral, which the client forgets.
	states, err = c.keyStates(ctx, []string{"order-1"}, true)
	if err != nil {
		t.Fatal(err)
	}
	if st := states["order-1"]; !st.Blocked || st.Reason != ReasonPending {
		t.Fatalf("order-1 after a question that waited for all: %+v, want blocked pending", st)
	}
	c.pendingMu.Lock()
	_, kept := c.pending["order-1"]
	c.pendingMu.Unlock()
	if kept {
		t.Error("the client still holds order-1's deferral after an answer that covers it")
	}
	// Without a wait now, the scheduler's own answer keeps it blocked.
	states, err = c.keyStates(ctx, []string{"order-1"}, false)
	if err != nil {
		t.Fatal(err)
	}
	if st := states["order-1"]; !st.Blocked || st.Reason != ReasonPending {
		t.Errorf("order-1 asked again without a wait: %+v, want blocked pending", st)
	}
}

// A scheduler of the release before the wait field refuses it, as its
// strict decoding does with any unknown field; the client then asks as it
// understands, waiting for the whole topic, and forgets its deferrals as
// it did with such answers. The older scheduler is stood in for by its
// request decoding and its refusal, word for word.
func TestOlderSchedulerWaitsForAll(t *testing.T) {
	type olderRequest struct {
		Group      string   `json:"group"`
		Keys       []string `json:"keys"`
		WaitMillis int      `json:"wait_ms,omitempty"`
	}
	var mu sync.Mutex
	var bodies []string
	older := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		mu.Lock()
		bodies = append(bodies, string(body))
		mu.Unlock()
		var req olderRequest
		dec := json.NewDecoder(bytes.NewReader(body))
		dec.DisallowUnknownFields()
		w.Header().Set("Content-Type", "application/json")
		if err := dec.Decode(&req); err != nil {
			w.WriteHeader(http.StatusBadRequest)
			_ = json.NewEncoder(w).Encode(keystate.ErrorResponse{Error: "the body is not a key-state request: " + err.Error()})
			return
		}
		resp := keystate.Response{}
		for _, k := range req.Keys {
			resp.Keys = append(resp.Keys, keystate.State{Key: k})
		}
		_ = json.NewEncoder(w).Encode(resp)
	}))
	defer older.Close()
	addr := kafkatest.Start(t, kafkatest.Broker{Topics: []string{"scheduler.defer"}})
	c, err := New(Config{Group: "payments", SchedulerURL: older.URL}, newTestProducer(t, addr))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	msg := Record{Topic: "orders", Key: []byte("order-1"), Value: []byte("charge")}
	if err := c.Defer(ctx, msg, Deferral{Target: "orders.retry", BusinessKey: "order-1", Delay: time.Hour}); err != nil {
		t.Fatal(err)
	}
	for i := range 2 {
		states, err := c.keyStates(ctx, []string{"order-1"}, false)
		if err != nil {
			t.Fatalf("question %d: %v", i+1, err)
		}
		// The older scheduler says free: the answer waited for all, so it
		// covers the deferral made before it, which the client forgets.
		if st := states["order-1"]; st.Blocked {
			t.Errorf("question %d: %+v, want the scheduler's answer, free", i+1, st)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if len(bodies) != 3 || !strings.Contains(bodies[0], `"wait":"positions"`) ||
		strings.Contains(bodies[1], `"wait"`) || strings.Contains(bodies[2], `"wait"`) {
		t.Errorf("requests %q: want one with a wait, refused, then two without", bodies)
	}
}

// testProducer is a real Producer for the gate's own tests, over a kgo
// client: the gate imports no Kafka client, its tests need one.
type testProducer struct{ cl *kgo.Client }

func newTestProducer(t *testing.T, addr string) *testProducer {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(addr), kgo.RequiredAcks(kgo.AllISRAcks()),
		kgo.RecordPartitioner(kgo.ManualPartitioner()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cl.Close)
	return &testProducer{cl: cl}
}

func (p *testProducer) Partitions(ctx context.Context, topic string) (int32, error) {
	req := kmsg.NewPtrMetadataRequest()
	rt := kmsg.NewMetadataRequestTopic()
	rt.Topic = kmsg.StringPtr(topic)
	req.Topics = append(req.Topics, rt)
	resp, err := req.RequestWith(ctx, p.cl)
	if err != nil {
		return 0, err
	}
	if len(resp.Topics) != 1 {
		return 0, fmt.Errorf("metadata of %s: %d topics", topic, len(resp.Topics))
	}
	return int32(len(resp.Topics[0].Partitions)), kerr.ErrorForCode(resp.Topics[0].ErrorCode)
}

func (p *testProducer) Produce(ctx context.Context, outs []Out) ([]Position, error) {
	var pos []Position
	for _, o := range outs {
		r := &kgo.Record{Topic: o.Topic, Partition: o.Partition, Key: o.Key, Value: o.Value}
		for _, h := range o.Headers {
			r.Headers = append(r.Headers, kgo.RecordHeader{Key: h.Key, Value: h.Value})
		}
		if err := p.cl.ProduceSync(ctx, r).FirstErr(); err != nil {
			return nil, err
		}
		pos = append(pos, Position{Partition: r.Partition, Offset: r.Offset})
	}
	return pos, nil
}

// startScheduler runs a real scheduler, with INGEST_FUTURE_LINGER linger, on
// a fresh database and broker, and returns them with a Gate of group
// payments that asks it.
func startScheduler(t *testing.T, linger string) (pgtest.DB, *schedproc.Process, *Gate) {
	t.Helper()
	db := pgtest.NewDB(t)
	addr := kafkatest.Start(t, kafkatest.Broker{Topics: []string{"scheduler.defer", "orders.retry"}, Partitions: 3})
	bin, err := schedproc.Build(t.Context(), t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	p, err := schedproc.StartReady(t.Context(), schedproc.Options{Bin: bin, Env: append(os.Environ(),
		"DATABASE_URL="+db.URL, "KAFKA_BROKERS="+addr, "TARGET_TOPICS=orders.*", "INGEST_FUTURE_LINGER="+linger,
		"LOG_LEVEL=warn")}, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Kill)
	g, err := New(Config{Group: "payments", SchedulerURL: "http://" + p.HTTPAddr, KeyStateWait: 10 * time.Second},
		newTestProducer(t, addr))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(g.Close)
	return db, p, g
}
