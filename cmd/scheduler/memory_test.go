package main

import (
	"bytes"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
)

// documentedRSS is the bound the README promises ("High availability",
// Memory) for the default budgets, whatever the record sizes.
const documentedRSS = 256_000_000

// A backlog of records near Kafka's 1 MB limit waits in the defer topic when
// the scheduler starts: 400 of them, 380 MB in all, half due at once
// (ingest and dispatch) and half in an hour (ingest only). The process's
// peak resident memory, read from /proc, stays under the documented bound:
// every buffer on the way in and out is bounded in bytes.
func TestIngestPeakRSSBoundedByBytes(t *testing.T) {
	if testing.Short() {
		t.Skip("moves 760 MB through the broker")
	}
	brokers := broker(t)
	db, pool := emptyDB(t)
	prod := largeProducer(t, brokers, nil)
	const n, size = 400, 950_000
	value := bytes.Repeat([]byte("x"), size)
	for i := range n {
		delay := "0"
		if i%2 == 1 {
			delay = "1h"
		}
		m := deferRecord(fmt.Sprint("k-", i), "", "defer.target", targetTopic, "defer.delay", delay)
		m.Value = sarama.ByteEncoder(value)
		if _, _, err := prod.SendMessage(m); err != nil {
			t.Fatal(err)
		}
	}
	out := read(t, brokers, targetTopic)
	p := start(t, serviceEnv(db, brokers, "e2e-rss"), "--migrate")
	out.until(t, 3*time.Minute, "the due half delivered", atLeast(n/2))
	waitRows(t, pool, time.Minute, "SELECT count(*) FROM deferred_message", n/2)
	peak := peakRSS(t, p.Cmd.Process.Pid)
	t.Logf("peak RSS %d MB with %d records of %d bytes ingested and %d published", peak/1_000_000, n, size, n/2)
	if peak > documentedRSS {
		t.Errorf("peak RSS %d bytes, over the documented %d", peak, documentedRSS)
	}
	p.stop()
}

// peakRSS returns the process's peak resident set size (VmHWM) in bytes.
func peakRSS(t *testing.T, pid int) int64 {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
			if err != nil {
				t.Fatalf("VmHWM %q: %v", rest, err)
			}
			return kb * 1024
		}
	}
	t.Fatalf("no VmHWM in /proc/%d/status", pid)
	return 0
}
