package runner

import (
	"context"
	"log/slog"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/deferq/scheduler/internal/dispatchtest"
	"github.com/deferq/scheduler/internal/fixture"
	"github.com/deferq/scheduler/internal/pglocal"
	"github.com/deferq/scheduler/internal/pgtest"
)

// The head triggers' notification says when the head falls due: empty for
// now, else the milliseconds until then, and nothing for a head further out
// than the longest poll interval.
func TestNotificationSaysWhenTheHeadFallsDue(t *testing.T) {
	e := dispatchtest.New(t)
	tests := []struct {
		name   string
		in     time.Duration
		notify bool
		// minMs and maxMs bound the payload read as milliseconds; both 0:
		// the payload is empty.
		minMs, maxMs int64
	}{
		{name: "overdue", in: -time.Second, notify: true},
		{name: "due now", in: 0, notify: true},
		{name: "due in 2s", in: 2 * time.Second, notify: true, minMs: 1000, maxMs: 2000},
		{name: "due in 10s", in: 10 * time.Second, notify: false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			conn := listen(t, e.Pool)
			e.Insert(fixture.Message{Key: fixture.Key(tt.name), Target: dispatchtest.TopicA, In: tt.in})
			ctx, cancel := context.WithTimeout(t.Context(), time.Second)
			defer cancel()
			n, err := conn.WaitForNotification(ctx)
			if !tt.notify {
				if err == nil {
					t.Fatalf("notified %q for a head due in %v", n.Payload, tt.in)
				}
				return
			}
			if err != nil {
				t.Fatalf("no notification for a head due in %v: %v", tt.in, err)
			}
			if tt.maxMs == 0 {
				if n.Payload != "" {
					t.Fatalf("payload %q, want empty for a head due now", n.Payload)
				}
				return
			}
			ms, err := strconv.ParseInt(n.Payload, 10, 64)
			if err != nil || ms <= tt.minMs || ms > tt.maxMs {
				t.Fatalf("payload %q, want milliseconds in (%d, %d]", n.Payload, tt.minMs, tt.maxMs)
			}
		})
	}
}

// listen returns a connection of pool that listens on NotifyChannel; the
// test's cleanup closes it.
func listen(t *testing.T, pool *pgxpool.Pool) *pgx.Conn {
	t.Helper()
	pooled, err := pool.Acquire(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	conn := pooled.Hijack()
	t.Cleanup(func() { conn.Close(context.Background()) })
	if _, err := conn.Exec(t.Context(), "LISTEN "+NotifyChannel); err != nil {
		t.Fatal(err)
	}
	return conn
}

// The waker wakes at once for a head due now (or a payload it cannot
// read), and when the time comes for one due later; of two pending times
// it keeps the earlier.
func TestWakerWakesWhenTheHeadFallsDue(t *testing.T) {
	e := dispatchtest.New(t)
	tests := []struct {
		name     string
		payloads []string
		// The wake-up comes no sooner than after and within within.
		after, within time.Duration
	}{
		{name: "due now", payloads: []string{""}, within: time.Second},
		{name: "unreadable", payloads: []string{"soon"}, within: time.Second},
		{name: "due in 700ms", payloads: []string{"700"}, after: 500 * time.Millisecond, within: 3 * time.Second},
		{name: "an earlier time replaces a later one", payloads: []string{"4000", "500"},
			after: 300 * time.Millisecond, within: 2500 * time.Millisecond},
		{name: "a later time leaves the earlier one", payloads: []string{"500", "4000"},
			after: 300 * time.Millisecond, within: 2500 * time.Millisecond},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			waker := startWaker(t, e)
			wake, unsubscribe := waker.Subscribe()
			defer unsubscribe()
			// The listener may not be listening yet: a notification before
			// its LISTEN is lost. A wake-up for one due now says it is.
			dispatchtest.Eventually(t, 5*time.Second, "the waker listens", func() bool {
				e.Exec("SELECT pg_notify($1, '')", NotifyChannel)
				select {
				case <-wake:
					return true
				case <-time.After(50 * time.Millisecond):
					return false
				}
			})
			time.Sleep(50 * time.Millisecond)
			select {
			case <-wake:
			default:
			}
			start := time.Now()
			for _, p := range tt.payloads {
				e.Exec("SELECT pg_notify($1, $2)", NotifyChannel, p)
			}
			select {
			case <-wake:
				if took := time.Since(start); took < tt.after {
					t.Fatalf("woken after %v, want no sooner than %v", took, tt.after)
				}
			case <-time.After(tt.within):
				t.Fatalf("not woken within %v", tt.within)
			}
		})
	}
}

// A head stored due later wakes no loop until it falls due, and then one
// loop publishes it, without waiting for the loops' poll interval.
func TestFutureHeadWakesALoopWhenDue(t *testing.T) {
	e := dispatchtest.New(t)
	claims := idleLoops(t, e) // each loop now sleeps its poll interval, 5 s
	before := claims()
	e.Insert(fixture.Message{Key: fixture.Key("later"), Target: dispatchtest.TopicA, In: 1500 * time.Millisecond})
	stored := time.Now()
	time.Sleep(time.Second)
	if got := claims() - before; got != 0 {
		t.Fatalf("%d claims before the head fell due; want none", got)
	}
	dispatchtest.Eventually(t, 2*time.Second, "the message published at its due time", func() bool {
		return e.Count("true") == 0
	})
	if took := time.Since(stored); took >= 4*time.Second {
		t.Fatalf("published %v after it was stored: the loops' poll, not a wake-up", took)
	}
}

// A primary demoted in place keeps the listening session open, and the
// new primary's notifications never reach it. The waker finds that its
// server takes no writes any more and listens again where the URL leads
// now (pgtest.Pair), where a notification wakes the loops.
func TestWakerListensOnThePromotedServer(t *testing.T) {
	pair := pgtest.StartPair(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	// Named, to find its sessions: the listening one's last statement is
	// the periodic check as often as LISTEN.
	pool, err := pgxpool.New(ctx, pair.URL+"&application_name=waker-test")
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	w := NewWaker(pool, time.Millisecond, slog.New(slog.DiscardHandler))
	w.checkEvery = 50 * time.Millisecond
	wake, unsubscribe := w.Subscribe()
	defer unsubscribe()
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		w.Run(runCtx)
	}()
	defer func() {
		stop()
		<-done
	}()

	// listening reports whether the waker has a session on c: it has
	// only the listening one (the pool's others are closed or reset).
	listening := func(c *pglocal.Cluster) bool {
		t.Helper()
		conn, err := pgx.Connect(ctx, c.URL("postgres"))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close(ctx)
		var n int
		if err := conn.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'waker-test'").Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n > 0
	}
	waitUntil := func(what string, cond func() bool) {
		t.Helper()
		for deadline := time.Now().Add(time.Minute); !cond(); time.Sleep(20 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("%s: not within a minute", what)
			}
		}
	}
	waitUntil("listening on the first server", func() bool { return listening(pair.First) })

	pair.Switchover(t)
	waitUntil("listening on the promoted server", func() bool { return listening(pair.Second) })
	// Woken since then (by the reconnect's broadcast): drain it.
	select {
	case <-wake:
	default:
	}
	conn, err := pgx.Connect(ctx, pair.Second.URL("postgres"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	// Again until one wakes the loops: the session may be connected and
	// not yet listening.
	for deadline := time.Now().Add(time.Minute); ; {
		if _, err := conn.Exec(ctx, "SELECT pg_notify($1, '')", NotifyChannel); err != nil {
			t.Fatal(err)
		}
		select {
		case <-wake:
			return
		case <-time.After(100 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatal("notifications on the promoted server did not wake the loops within a minute")
		}
	}
}
