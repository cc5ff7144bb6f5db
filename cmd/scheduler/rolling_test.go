package main

import (
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"

	"github.com/deferq/scheduler/internal/pgtest"
)

// A rolling restart of three instances under a steady stream (SIGTERM one
// at a time, each exiting cleanly, then started again) loses nothing, keeps
// every key's order, and duplicates at most the rounds in flight at a stop:
// a graceful stop finishes its rounds, so usually none.
func TestRollingRestart(t *testing.T) {
	if testing.Short() {
		t.Skip("a rolling restart takes about a minute")
	}
	db := pgtest.NewDB(t)
	brokers := broker(t)
	const (
		records  = 3000
		keys     = 150
		keyBatch = 5  // DISPATCH_KEY_BATCH
		batch    = 20 // DISPATCH_BATCH_KEYS
	)
	env := append(serviceEnv(db.URL, brokers, "e2e-rolling"),
		"DISPATCH_BATCH_KEYS="+strconv.Itoa(batch), "DISPATCH_KEY_BATCH="+strconv.Itoa(keyBatch))
	procs := []*proc{start(t, env), start(t, env), start(t, env)}
	out := read(t, brokers, targetTopic)
	prod := producer(t, brokers)

	// About 20 s of traffic, 30 records every 200 ms; a third are due a
	// little later, so that keys have a backlog while instances come and go.
	values := make([]string, records)
	var wg sync.WaitGroup
	produced := make(chan error, 1)
	wg.Go(func() {
		for start := 0; start < records; start += 30 {
			var msgs []*sarama.ProducerMessage
			for i := start; i < min(start+30, records); i++ {
				values[i] = fmt.Sprintf("v-%d", i)
				delay := "0"
				if i%3 == 0 {
					delay = "700ms"
				}
				msgs = append(msgs, deferRecord(fmt.Sprintf("k-%d", i%keys), values[i], "defer.target", targetTopic, "defer.delay", delay))
			}
			if err := prod.SendMessages(msgs); err != nil {
				produced <- fmt.Errorf("produce records %d..: %w", start, err)
				return
			}
			time.Sleep(200 * time.Millisecond)
		}
		produced <- nil
	})
	for i := range procs {
		time.Sleep(3 * time.Second)
		procs[i].stop() // fails the test unless it exits 0
		if i == 0 {
			// Between stops two instances carry the load; once, the stopped
			// one stays away for a while so that the others rebalance it away.
			time.Sleep(2 * time.Second)
		}
		procs[i] = start(t, env)
	}
	wg.Wait()
	if err := <-produced; err != nil {
		t.Fatal(err)
	}
	out.until(t, 90*time.Second, "every record", deliveredAll(values))
	waitRows(t, db.Pool, 30*time.Second, "SELECT count(*) FROM deferred_message", 0)
	// A duplicate from a lease taken over would come within LEASE_DURATION.
	time.Sleep(7 * time.Second)
	got := out.all()

	dups := duplicates(got)
	t.Logf("%d deliveries of %d records, %d duplicates", len(got), records, dups)
	// Bound: the messages of one round (DISPATCH_BATCH_KEYS keys of
	// DISPATCH_KEY_BATCH messages each) per stop.
	if limit := len(procs) * batch * keyBatch; dups > limit {
		t.Errorf("%d duplicates, more than the %d a round per stop could be", dups, limit)
	}
	// Per key, the first delivery of each record follows production order.
	seen := map[string]bool{}
	last := map[string]int{}
	for _, d := range got {
		if seen[d.id] {
			continue
		}
		seen[d.id] = true
		i, err := strconv.Atoi(strings.TrimPrefix(d.value, "v-"))
		if err != nil {
			t.Fatalf("unexpected delivery %q", d.value)
		}
		if prev, ok := last[d.key]; ok && i < prev {
			t.Errorf("key %s: %s delivered after v-%d", d.key, d.value, prev)
		}
		last[d.key] = i
	}
	if len(seen) != records {
		t.Errorf("%d distinct defer.id delivered, want %d", len(seen), records)
	}
	for _, p := range procs {
		p.stop()
	}
}
