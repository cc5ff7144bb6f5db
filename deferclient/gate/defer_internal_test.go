package gate

import (
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/deferq/scheduler/internal/defer/protocol"
	"github.com/deferq/scheduler/internal/kafkatest"
)

// consumed is a record as a consumer got it, for Defer to forward.
func consumed(key, value string, headers ...string) Record {
	r := Record{Topic: "orders", Partition: 1, Offset: 7, Key: []byte(key), Value: []byte(value)}
	for i := 0; i+1 < len(headers); i += 2 {
		r.Headers = append(r.Headers, Header{Key: headers[i], Value: []byte(headers[i+1])})
	}
	return r
}

// TestDefer: what Defer writes to the defer topic, read back from a real
// broker: the record's key, value and headers byte for byte and in order,
// the control headers set or replaced in place, stale one-shot headers
// dropped, the partition the business key's, and a signature the
// scheduler's check accepts. The adapters' tests check that they hand
// their client's records over as they came.
func TestDefer(t *testing.T) {
	addr := kafkatest.Start(t, kafkatest.Broker{Topics: []string{"scheduler.defer"}, Partitions: 8})
	key := []byte("0123456789abcdef0123456789abcdef")
	g, err := New(Config{Group: "payment-service", Source: "payments", SourceKey: key}, newTestProducer(t, addr))
	if err != nil {
		t.Fatal(err)
	}
	col := kafkatest.Collect(t, addr, "scheduler.defer")

	tests := []struct {
		name string
		rec  Record
		d    Deferral
		want []string // headers, in order, without the signature
		bkey string
	}{
		{
			name: "first failure of a main-topic record",
			rec:  consumed("rec-1", "charge", "trace", "abc", "original.topic", "orders"),
			d:    Deferral{Target: "orders.retry", BusinessKey: "order-42", Delay: 1500 * time.Millisecond, ErrorClass: "ProviderTimeout", ErrorMessage: "no answer"},
			want: []string{"trace=abc", "original.topic=orders", "defer.target=orders.retry", "defer.key=order-42",
				"defer.group=payment-service", "defer.source=payments", "defer.error.class=ProviderTimeout",
				"defer.error.message=no answer", "defer.delay=1500"},
			bkey: "order-42",
		},
		{
			name: "a republished record fails again: keeps its place and attempt, replaces the one-shot and error headers in place",
			rec: consumed("rec-2", "refund", "defer.target", "orders.retry", "defer.key", "order-42", "defer.id", "17",
				"defer.seq", "9", "defer.attempt", "2", "defer.scheduled-at", "2026-11-25T10:00:00Z",
				"defer.error.class", "Old", "defer.source", "payments", "defer.signature", strings.Repeat("0", 64),
				"defer.group", "payment-service"),
			d: Deferral{At: time.Date(2026, 11, 25, 11, 0, 0, 0, time.UTC), ErrorClass: "ProviderTimeout"},
			want: []string{"defer.target=orders.retry", "defer.key=order-42", "defer.id=17", "defer.seq=9", "defer.attempt=2",
				"defer.scheduled-at=2026-11-25T10:00:00Z", "defer.error.class=ProviderTimeout", "defer.source=payments",
				"defer.group=payment-service", "defer.at=2026-11-25T11:00:00Z"},
			bkey: "order-42",
		},
		{
			name: "the record key is the business key when nothing names one",
			rec:  consumed("order-7", "ship"),
			d:    Deferral{Target: "orders.retry"},
			want: []string{"defer.target=orders.retry", "defer.key=order-7", "defer.group=payment-service", "defer.source=payments"},
			bkey: "order-7",
		},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if err := g.Defer(t.Context(), tt.rec, tt.d); err != nil {
				t.Fatal(err)
			}
			got := col.Wait(t, i+1, 10*time.Second)[i]
			if string(got.Key) != string(tt.rec.Key) || string(got.Value) != string(tt.rec.Value) {
				t.Errorf("key/value %q/%q, want %q/%q", got.Key, got.Value, tt.rec.Key, tt.rec.Value)
			}
			if want := Partition(tt.bkey, 8); got.Partition != want {
				t.Errorf("partition %d, want %d (the business key %q's)", got.Partition, want, tt.bkey)
			}
			var rec protocol.Record
			rec.Key, rec.Value = got.Key, got.Value
			var headers []string
			for _, h := range got.Headers {
				rec.Headers = append(rec.Headers, protocol.Header{Key: h.Key, Value: h.Value})
				if string(h.Key) != protocol.HeaderSignature {
					headers = append(headers, string(h.Key)+"="+string(h.Value))
				}
			}
			if !slices.Equal(headers, tt.want) {
				t.Errorf("headers\n  %q\nwant\n  %q", headers, tt.want)
			}
			if err := protocol.Verify(key, rec); err != nil {
				t.Errorf("the scheduler would refuse the signature: %v", err)
			}
		})
	}
	if st := g.Stats(); st.Deferred != int64(len(tests)) {
		t.Errorf("stats %+v, want %d deferred", st, len(tests))
	}
}

// TestDeferRefuses: deferrals that cannot be right fail before anything is
// produced, saying why.
func TestDeferRefuses(t *testing.T) {
	addr := kafkatest.Start(t, kafkatest.Broker{Topics: []string{"scheduler.defer"}})
	g, err := New(Config{}, newTestProducer(t, addr))
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name string
		d    Deferral
		want string
	}{
		{"no target", Deferral{}, "no target"},
		{"delay and at", Deferral{Target: "t", Delay: time.Second, At: time.Now()}, "not both"},
		{"negative delay", Deferral{Target: "t", Delay: -time.Second}, "negative delay"},
		{"key too long", Deferral{Target: "t", BusinessKey: strings.Repeat("k", 1025)}, "business key of 1025 bytes"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := g.Defer(t.Context(), consumed("k", "v"), tt.d)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("Defer = %v, want an error containing %q", err, tt.want)
			}
		})
	}
	if st := g.Stats(); st.Deferred != 0 {
		t.Errorf("stats %+v after refusals, want nothing deferred", st)
	}
}

// TestNewRefuses: a configuration that cannot work is refused at once.
func TestNewRefuses(t *testing.T) {
	tests := []struct {
		name string
		cfg  Config
		want string
	}{
		{"bad source", Config{Source: "bad source"}, "source"},
		{"short key", Config{Source: "s", SourceKey: []byte("short")}, "at least"},
		{"key without source", Config{SourceKey: []byte(strings.Repeat("k", 32))}, "needs a source name"},
		{"long group", Config{Group: strings.Repeat("g", 256)}, "group of 256 bytes"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := New(tt.cfg, &testProducer{})
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("New = %v, want an error containing %q", err, tt.want)
			}
		})
	}
}
