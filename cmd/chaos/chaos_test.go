package main

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"
)

// TestChaosShort is the short chaos run `make test` includes: three
// schedulers, at least two kills, one PostgreSQL restart and broker faults,
// and every guarantee checked.
func TestChaosShort(t *testing.T) {
	if testing.Short() {
		t.Skip("chaos run skipped with -short")
	}
	cfg := modes["short"]
	cfg.Seed = uint64(time.Now().UnixNano())
	var logs bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	res, err := run(ctx, cfg, &logs)
	if err != nil {
		t.Fatalf("chaos run (seed %d): %v\n%s", cfg.Seed, err, logs.String())
	}
	var report bytes.Buffer
	res.print(&report)
	t.Logf("seed %d:\n%s", cfg.Seed, report.String())
	if res.Kills < 2 {
		t.Errorf("%d kills, want at least 2", res.Kills)
	}
	if res.PGRestarts != 1 {
		t.Errorf("%d PostgreSQL restarts, want 1", res.PGRestarts)
	}
	if res.Rewinds != 1 {
		t.Errorf("%d rewinds to an older backup, want 1", res.Rewinds)
	}
	if res.Sent != cfg.Messages {
		t.Errorf("sent %d messages, want %d", res.Sent, cfg.Messages)
	}
	if res.Lost != 0 || res.OrderViolations != 0 || res.Pending != 0 || res.Duplicates > res.DupBound {
		t.Errorf("lost %d (want 0), order violations %d (want 0), pending %d (want 0), duplicates %d (bound %d)",
			res.Lost, res.OrderViolations, res.Pending, res.Duplicates, res.DupBound)
	}
	if !res.ok() {
		t.Errorf("guarantees broken: %s", strings.Join(res.broken(), "; "))
	}
	if t.Failed() {
		t.Logf("run log:\n%s", logs.String())
	}
	last := strings.TrimSpace(report.String())
	last = last[strings.LastIndexByte(last, '\n')+1:]
	if !strings.HasPrefix(last, "RESULT status=") {
		t.Errorf("last line of the report is %q, want the RESULT line", last)
	}
}

// rec is a delivery of message m with defer.id id and defer.attempt attempt,
// at offset off of partition 0.
func rec(m message, id string, attempt int, off int64) delivery {
	return delivery{offset: off, key: m.Key, value: m.value(), id: id, attempt: attempt}
}

func TestCheck(t *testing.T) {
	a0 := message{Key: "a", N: 0}
	a1 := message{Key: "a", N: 1, Redefers: 1}
	a2 := message{Key: "a", N: 2}
	b0 := message{Key: "b", N: 0, Redefers: 2}
	sent := []message{a0, a1, a2, b0}
	tests := []struct {
		name    string
		rewinds int
		ds      []delivery
		want    result // only the counted fields
	}{
		{
			name: "all delivered in order, re-deferrals at their final attempt",
			ds: []delivery{rec(a0, "1", 1, 0), rec(a1, "2", 1, 1), rec(b0, "3", 1, 2), rec(a2, "4", 1, 3),
				rec(a1, "5", 2, 4), rec(b0, "6", 2, 5), rec(b0, "7", 3, 6)},
			want: result{Delivered: 4},
		},
		{
			name: "a re-deferral that never came back is lost",
			ds:   []delivery{rec(a0, "1", 1, 0), rec(a1, "2", 1, 1), rec(a2, "4", 1, 3), rec(b0, "3", 1, 2), rec(b0, "6", 2, 5)},
			want: result{Delivered: 2, Lost: 2},
		},
		{
			name: "duplicates of one defer.id count once each",
			ds: []delivery{rec(a0, "1", 1, 0), rec(a0, "1", 1, 1), rec(a1, "2", 1, 2), rec(a2, "4", 1, 3),
				rec(a1, "5", 2, 4), rec(a1, "5", 2, 5), rec(b0, "3", 1, 6), rec(b0, "6", 2, 7), rec(b0, "7", 3, 8)},
			want: result{Delivered: 4, Duplicates: 2},
		},
		{
			name: "a later message first delivered before an earlier one",
			ds: []delivery{rec(a0, "1", 1, 0), rec(a2, "4", 1, 1), rec(a1, "2", 1, 2), rec(a1, "5", 2, 3),
				rec(b0, "3", 1, 4), rec(b0, "6", 2, 5), rec(b0, "7", 3, 6)},
			want: result{Delivered: 4, OrderViolations: 1},
		},
		{
			name: "a re-deferral delivered after later messages is not a violation",
			ds: []delivery{rec(a0, "1", 1, 0), rec(a1, "2", 1, 1), rec(a2, "4", 1, 2), rec(a1, "5", 2, 3),
				rec(b0, "3", 1, 4), rec(b0, "6", 2, 5), rec(b0, "7", 3, 6)},
			want: result{Delivered: 4},
		},
		{
			name: "one defer.id on two messages, an attempt out of plan, a value nobody sent",
			ds: []delivery{rec(a0, "1", 1, 0), rec(a2, "1", 1, 1), rec(a1, "2", 3, 2),
				{offset: 3, key: "c", value: "c|0|0", id: "9", attempt: 1}},
			want: result{Delivered: 1, Lost: 3, Duplicates: 1, Unexpected: 3, OrderViolations: 1},
		},
		{
			name:    "after a rewind, a final attempt again under a new defer.id is a redelivery; a defer.id on two messages is still wrong",
			rewinds: 1,
			ds: []delivery{rec(a0, "1", 1, 0), rec(a1, "2", 1, 1), rec(a2, "4", 1, 2), rec(a1, "5", 2, 3),
				rec(b0, "3", 1, 4), rec(b0, "6", 2, 5), rec(b0, "7", 3, 6), rec(a2, "8", 1, 7), rec(a0, "8", 1, 8)},
			want: result{Delivered: 4, Redelivered: 1, Duplicates: 1, Unexpected: 1},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := result{Rewinds: tt.rewinds, RewoundFrom: time.Unix(100, 0), RewoundTo: time.Unix(200, 0)}
			check(sent, tt.ds, &got)
			type counts struct{ Delivered, Lost, Duplicates, OrderViolations, Unexpected, Redelivered int }
			g := counts{got.Delivered, got.Lost, got.Duplicates, got.OrderViolations, got.Unexpected, got.Redelivered}
			w := counts{tt.want.Delivered, tt.want.Lost, tt.want.Duplicates, tt.want.OrderViolations, tt.want.Unexpected, tt.want.Redelivered}
			if g != w {
				t.Errorf("got %+v, want %+v (problems: %q)", g, w, got.Examples)
			}
		})
	}
}

// The duplicates of a record first read between the backup and the rewind
// are the rewind's, at most two per record (the rewind's republish, and a
// kill cutting the catch-up round that republished it); every other
// duplicate counts against the 5% bound.
func TestCheckRewindDuplicates(t *testing.T) {
	a0 := message{Key: "a", N: 0}
	a1 := message{Key: "a", N: 1}
	sent := []message{a0, a1}
	from, to := time.Unix(100, 0), time.Unix(200, 0)
	at := func(d delivery, sec int64) delivery { d.at = time.Unix(sec, 0); return d }
	tests := []struct {
		name          string
		rewinds       int
		ds            []delivery
		dups, rewound int
	}{
		{
			name:    "read in the window, duplicated twice after it",
			rewinds: 1,
			ds:      []delivery{at(rec(a0, "1", 1, 0), 150), at(rec(a0, "1", 1, 1), 210), at(rec(a0, "1", 1, 2), 220), at(rec(a1, "2", 1, 3), 230)},
			dups:    2, rewound: 2,
		},
		{
			name:    "a third copy is no longer the rewind's",
			rewinds: 1,
			ds: []delivery{at(rec(a0, "1", 1, 0), 150), at(rec(a0, "1", 1, 1), 210), at(rec(a0, "1", 1, 2), 220),
				at(rec(a0, "1", 1, 3), 225), at(rec(a1, "2", 1, 4), 230)},
			dups: 3, rewound: 2,
		},
		{
			name:    "read before the backup or after the rewind: not the rewind's",
			rewinds: 1,
			ds:      []delivery{at(rec(a0, "1", 1, 0), 50), at(rec(a0, "1", 1, 1), 150), at(rec(a1, "2", 1, 2), 250), at(rec(a1, "2", 1, 3), 260)},
			dups:    2, rewound: 0,
		},
		{
			name: "no rewind: none are",
			ds:   []delivery{at(rec(a0, "1", 1, 0), 150), at(rec(a0, "1", 1, 1), 210), at(rec(a1, "2", 1, 2), 230)},
			dups: 1, rewound: 0,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := result{Rewinds: tt.rewinds, RewoundFrom: from, RewoundTo: to}
			check(sent, tt.ds, &got)
			if got.Duplicates != tt.dups || got.RewindDuplicates != tt.rewound {
				t.Errorf("duplicates %d, of them the rewind's %d; want %d and %d", got.Duplicates, got.RewindDuplicates, tt.dups, tt.rewound)
			}
			if want := dupBound(len(sent), 0) + tt.rewound; got.DupBound != want {
				t.Errorf("bound %d, want %d: 5%% of sent (at least 20, and 50 a kill) plus the rewind's", got.DupBound, want)
			}
		})
	}
}

// The bound besides the rewind's: 5% of the messages sent, at least 20,
// and at least 50 per kill.
func TestDupBound(t *testing.T) {
	for _, tt := range []struct{ sent, kills, want int }{
		{sent: 100, kills: 0, want: 20},
		{sent: 2000, kills: 0, want: 100},
		{sent: 2000, kills: 4, want: 200},
		{sent: 30000, kills: 21, want: 1500},
	} {
		if got := dupBound(tt.sent, tt.kills); got != tt.want {
			t.Errorf("dupBound(%d sent, %d kills) = %d, want %d", tt.sent, tt.kills, got, tt.want)
		}
	}
}

// Per-key order is judged in each partition's offset order, whatever order
// the consumer's goroutines appended the records in.
func TestCheckSortsByOffset(t *testing.T) {
	m0, m1 := message{Key: "a", N: 0}, message{Key: "a", N: 1}
	var r result
	check([]message{m0, m1}, []delivery{rec(m1, "2", 1, 8), rec(m0, "1", 1, 7)}, &r)
	if r.OrderViolations != 0 || r.Delivered != 2 {
		t.Errorf("order violations %d, delivered %d; want 0 and 2", r.OrderViolations, r.Delivered)
	}
}

func TestPlan(t *testing.T) {
	msgs := plan(rand.New(rand.NewPCG(1, 2)), 5000, 50)
	next := map[string]int{}
	redefers := 0
	for _, m := range msgs {
		if m.N != next[m.Key] {
			t.Fatalf("%s: message %d, want %d: numbers must follow send order", m.Key, m.N, next[m.Key])
		}
		next[m.Key]++
		if m.Redefers < 0 || m.Redefers > maxRedefers {
			t.Fatalf("%+v: re-deferrals outside 0..%d", m, maxRedefers)
		}
		redefers += m.Redefers
		back, err := parseValue(m.value())
		if err != nil || back != m {
			t.Fatalf("value %q parses to %+v, %v", m.value(), back, err)
		}
	}
	if len(next) != 50 {
		t.Errorf("%d keys used, want 50", len(next))
	}
	// 10% once and 5% twice: 1,000 expected.
	if redefers < 800 || redefers > 1200 {
		t.Errorf("%d re-deferrals planned, want about 1,000", redefers)
	}
}

func TestConfigFromEnv(t *testing.T) {
	tests := []struct {
		env     []string
		want    func(config) error
		wantErr string
	}{
		{env: nil, want: func(c config) error {
			if c.Mode != "full" || c.Messages != 30_000 || c.Keys != 300 || c.KafkaTimeout != 300*time.Millisecond ||
				!c.ProduceFaults || !c.FetchFaults {
				return fmt.Errorf("%+v", c)
			}
			return nil
		}},
		{env: []string{"CHAOS_SHORT=1", "CHAOS_SEED=42", "CHAOS_MESSAGES=500"}, want: func(c config) error {
			if c.Mode != "short" || c.Seed != 42 || c.Messages != 500 || c.Keys != modes["short"].Keys {
				return fmt.Errorf("%+v", c)
			}
			return nil
		}},
		{env: []string{"CHAOS_FAULTS=fetch"}, want: func(c config) error {
			if c.ProduceFaults || !c.FetchFaults {
				return fmt.Errorf("produce faults %v, fetch faults %v; want false, true", c.ProduceFaults, c.FetchFaults)
			}
			return nil
		}},
		{env: []string{"CHAOS_FAULTS=all"}, wantErr: "CHAOS_FAULTS"},
		{env: []string{"CHAOS_DURATION=2s"}, wantErr: "CHAOS_DURATION"},
		{env: []string{"CHAOS_MESSAGES=many"}, wantErr: "CHAOS_MESSAGES"},
		{env: []string{"CHAOS_SHORT=maybe"}, wantErr: "CHAOS_SHORT"},
		{env: []string{"CHAOS_KAFKA_TIMEOUT=2m"}, wantErr: "CHAOS_KAFKA_TIMEOUT"},
	}
	for _, tt := range tests {
		t.Run(strings.Join(tt.env, ","), func(t *testing.T) {
			c, err := configFromEnv(tt.env)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("error %v, want one naming %s", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if err := tt.want(c); err != nil {
				t.Errorf("config: %v", err)
			}
		})
	}
}
