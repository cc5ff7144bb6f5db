package ingest

import (
	"context"
	"fmt"
	"maps"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/deferq/scheduler/internal/defer/protocol"
	"github.com/deferq/scheduler/internal/metrics"
	"github.com/deferq/scheduler/internal/pgtest"
)

func TestRejectedByCode(t *testing.T) {
	rej := func(code string) Entry { return Entry{Reject: &protocol.RejectError{Code: code, Detail: "d"}} }
	ok := Entry{}
	for _, c := range []struct {
		name    string
		entries []Entry
		stored  int64
		want    map[string]int
	}{
		{"none stored", []Entry{rej("a"), ok}, 0, nil},
		{"all stored", []Entry{rej("a"), ok, rej("b"), rej("a")}, 3, map[string]int{"a": 2, "b": 1}},
		// A replay: the records stored before come first in the partition.
		{"replayed prefix", []Entry{rej("a"), rej("b"), ok, rej("c")}, 1, map[string]int{"c": 1}},
		{"replayed prefix, two new", []Entry{rej("a"), ok, rej("b"), rej("b")}, 2, map[string]int{"b": 2}},
	} {
		if got := rejectedByCode(c.entries, c.stored); !maps.Equal(got, c.want) {
			t.Errorf("%s: rejectedByCode = %v, want %v", c.name, got, c.want)
		}
	}
}

// With a short KAFKA_TIMEOUT a fetch must not outwait the read timeout.
func TestConsumerConfigFetchWaitsLessThanReadTimeout(t *testing.T) {
	for _, c := range []struct {
		read, want time.Duration
	}{
		{5 * time.Second, 500 * time.Millisecond}, // sarama's default stays
		{300 * time.Millisecond, 150 * time.Millisecond},
	} {
		base := sarama.NewConfig()
		base.Net.ReadTimeout = c.read
		if got := ConsumerConfig(base, nil).Consumer.MaxWaitTime; got != c.want {
			t.Errorf("read timeout %v: MaxWaitTime %v, want %v", c.read, got, c.want)
		}
	}
}

// Ingest counts records by result and rejections by code, per batch, and
// sets each consumed partition's lag; a replay counts duplicates only.
func TestIngestRecordsMetrics(t *testing.T) {
	db := pgtest.NewDB(t)
	k := newKafka(t)
	k.produce(t,
		validRec(0, "k-1", "v1"),
		validRec(0, "k-2", "v2"),
		rec(0, []byte("k-3"), []byte("bad"), protocol.HeaderDelay, "1h"),                                   // missing_target
		rec(1, []byte("k-4"), []byte("bad"), protocol.HeaderTarget, "secrets", protocol.HeaderDelay, "1h"), // target_not_allowed
		validRec(2, "k-5", "v5"),
	)
	reg := prometheus.NewRegistry()
	m := metrics.New(reg, "test")
	cfg := IngestConfig{BatchSize: 10, BatchLinger: 10 * time.Millisecond, Metrics: m}

	want := func(what string, pairs ...any) func() (bool, string) {
		return func() (bool, string) {
			g := gatherIngest(t, reg)
			for i := 0; i+1 < len(pairs); i += 2 {
				key, v := pairs[i].(string), float64(pairs[i+1].(int))
				if g[key] != v {
					return false, fmt.Sprintf("%s: %s = %v, want %v (all: %v)", what, key, g[key], v, g)
				}
			}
			return true, ""
		}
	}
	first := startIngester(t.Context(), t, k, db.Pool, "ingest-metrics-1", cfg, nil)
	waitFor(t, 30*time.Second, "first run's metrics", want("first run",
		`scheduler_ingest_records_total{result="stored"}`, 3,
		`scheduler_ingest_records_total{result="rejected"}`, 2,
		`scheduler_ingest_records_total{result="duplicate"}`, 0,
		`scheduler_ingest_rejected_total{reason="missing_target"}`, 1,
		`scheduler_ingest_rejected_total{reason="target_not_allowed"}`, 1,
		`scheduler_ingest_batch_records_sum`, 5,
		`scheduler_ingest_lag_records{partition="0"}`, 0,
		`scheduler_ingest_lag_records{partition="1"}`, 0,
		`scheduler_ingest_lag_records{partition="2"}`, 0,
	))
	// The "ingested batch" lines count as the metrics do: a rejected record
	// is not stored.
	logged := batchLogCounts(t, first.log.String())
	if logged["stored"] != 3 || logged["rejected"] != 2 || logged["duplicates"] != 0 || logged["records"] != 5 {
		t.Errorf("ingested batch lines add up to %v; want stored 3, rejected 2, duplicates 0 of 5 records, as the metrics say", logged)
	}
	g := gatherIngest(t, reg)
	if g["scheduler_ingest_batch_records_count"] != g["scheduler_ingest_batch_duration_seconds_count"] ||
		g["scheduler_ingest_batch_records_count"] < 3 {
		t.Errorf("batches: %v records observations, %v durations; want the same, at least one per partition",
			g["scheduler_ingest_batch_records_count"], g["scheduler_ingest_batch_duration_seconds_count"])
	}
	first.stop(t)
	if _, ok := gatherIngest(t, reg)[`scheduler_ingest_lag_records{partition="0"}`]; ok {
		t.Error("the lag of a partition no longer consumed is still exported")
	}

	// Forget the stored positions so that a new group reads everything again.
	if _, err := db.Pool.Exec(context.Background(), "DELETE FROM ingest_offset"); err != nil {
		t.Fatal(err)
	}
	startIngester(t.Context(), t, k, db.Pool, "ingest-metrics-2", cfg, nil)
	waitFor(t, 30*time.Second, "replay's metrics", want("replay",
		`scheduler_ingest_records_total{result="stored"}`, 3,
		`scheduler_ingest_records_total{result="rejected"}`, 2,
		`scheduler_ingest_records_total{result="duplicate"}`, 5,
		`scheduler_ingest_rejected_total{reason="missing_target"}`, 1,
		`scheduler_ingest_rejected_total{reason="target_not_allowed"}`, 1,
	))
}

// gatherIngest flattens the ingest metrics of reg into `name{labels}` and,
// for histograms, `name_count` and `name_sum`.
func gatherIngest(t *testing.T, reg *prometheus.Registry) map[string]float64 {
	t.Helper()
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, f := range fams {
		for _, m := range f.GetMetric() {
			name := f.GetName()
			if h := m.GetHistogram(); h != nil {
				out[name+"_count"] = float64(h.GetSampleCount())
				out[name+"_sum"] = h.GetSampleSum()
				continue
			}
			if len(m.GetLabel()) > 0 {
				name += labelString(m.GetLabel())
			}
			switch {
			case m.GetCounter() != nil:
				out[name] = m.GetCounter().GetValue()
			case m.GetGauge() != nil:
				out[name] = m.GetGauge().GetValue()
			}
		}
	}
	return out
}

func labelString(lps []*dto.LabelPair) string {
	s := "{"
	for i, lp := range lps {
		if i > 0 {
			s += ","
		}
		s += fmt.Sprintf("%s=%q", lp.GetName(), lp.GetValue())
	}
	return s + "}"
}

func TestParkedByCode(t *testing.T) {
	park := func(code string) Entry {
		return Entry{Decision: protocol.Decision{Park: &protocol.ParkReason{Code: code, Detail: "d"}}}
	}
	rej := Entry{Reject: &protocol.RejectError{Code: "missing_target"}, Decision: protocol.Decision{Park: &protocol.ParkReason{Code: "ignored"}}}
	ok := Entry{}
	tests := []struct {
		name    string
		entries []Entry
		stored  int64
		want    map[string]int
	}{
		{"none stored", []Entry{park("exhausted"), ok}, 0, nil},
		{"all stored; a rejected entry's decision does not count", []Entry{park("exhausted"), rej, ok, park("permanent"), park("exhausted")}, 3,
			map[string]int{"exhausted": 2, "permanent": 1}},
		{"replayed prefix", []Entry{park("exhausted"), ok, park("non_retriable")}, 1, map[string]int{"non_retriable": 1}},
	}
	for _, tt := range tests {
		got := parkedByCode(tt.entries, tt.stored)
		if len(got) != len(tt.want) {
			t.Errorf("%s: parkedByCode = %v, want %v", tt.name, got, tt.want)
			continue
		}
		for k, v := range tt.want {
			if got[k] != v {
				t.Errorf("%s: parkedByCode = %v, want %v", tt.name, got, tt.want)
			}
		}
	}
}

// batchLogCounts adds up the counts of the "ingested batch" lines in logs.
func batchLogCounts(t *testing.T, logs string) map[string]int {
	t.Helper()
	sum := map[string]int{}
	for _, line := range strings.Split(logs, "\n") {
		if !strings.Contains(line, `msg="ingested batch"`) {
			continue
		}
		for _, field := range strings.Fields(line) {
			k, v, ok := strings.Cut(field, "=")
			if !ok {
				continue
			}
			switch k {
			case "records", "stored", "rejected", "parked", "duplicates":
				n, err := strconv.Atoi(v)
				if err != nil {
					t.Fatalf("%s=%q in %s", k, v, line)
				}
				sum[k] += n
			}
		}
	}
	return sum
}
