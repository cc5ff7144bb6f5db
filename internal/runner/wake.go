package runner

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/deferq/scheduler/internal/backoff"
	"github.com/deferq/scheduler/sql/queries"
)

// NotifyChannel is the channel the deferred_key triggers notify when a head
// that nobody holds becomes due soon (see migrations).
const NotifyChannel = "deferred_key_due"

// Waker turns database notifications into wake-ups for sleeping loops. A
// notification is only a hint: a loop that misses one still wakes at its next
// due time or poll, which is why Waker may drop, merge and delay them freely.
//
// A notification's payload says when its head falls due (see
// sql/schema/functions/deferred_key_notify.sql): empty for now, else the
// milliseconds until then. Waker wakes at once for the first, and for the
// second when the time comes: a loop woken earlier would claim nothing and
// then sleep dispatch's idle floor past the head's due time. Of several
// such times it keeps only the earliest: the loop woken then claims, and
// reads the next due time itself before it sleeps again.
type Waker struct {
	pool     *pgxpool.Pool
	logger   *slog.Logger
	throttle time.Duration
	// checkEvery is how often a listening session that heard nothing
	// checks that its server still takes writes (listenCheckEvery).
	checkEvery time.Duration

	mu   sync.Mutex
	subs map[chan struct{}]struct{}
	// later is the pending wake-up for a head due in the future (nil if
	// none), due at laterAt.
	later   *time.Timer
	laterAt time.Time

	// also are the other channels listened on, each with what a
	// notification on it calls (set by On before Run).
	also map[string]func()
}

// On makes the listener also listen on channel, and call fn (on the
// listener's goroutine: it must not block) for each notification there. It
// must be called before Run. The service hands ingest's Flush the channel
// key-state queries notify (queries.IngestFlushChannel).
func (w *Waker) On(channel string, fn func()) {
	if w.also == nil {
		w.also = map[string]func(){}
	}
	w.also[channel] = fn
}

// NewWaker returns a Waker that wakes subscribers for heads due now at most
// once per throttle; a head due later wakes them once, when it falls due.
func NewWaker(pool *pgxpool.Pool, throttle time.Duration, logger *slog.Logger) *Waker {
	return &Waker{pool: pool, logger: logger, throttle: throttle, checkEvery: listenCheckEvery, subs: map[chan struct{}]struct{}{}}
}

// listenCheckEvery: a primary demoted in place (a switchover without a
// restart) keeps the listening session open, and the new primary's
// notifications never reach it; the loops would poll until the session
// ended. Readiness resets the pool within METRICS_INTERVAL, but not a
// session taken out of it. One statement every ten seconds finds it.
const listenCheckEvery = 10 * time.Second

// Subscribe returns a channel that receives a value after a notification, and
// a function that unsubscribes. Wake-ups coalesce: the channel holds one.
func (w *Waker) Subscribe() (<-chan struct{}, func()) {
	ch := make(chan struct{}, 1)
	w.mu.Lock()
	w.subs[ch] = struct{}{}
	w.mu.Unlock()
	return ch, func() {
		w.mu.Lock()
		delete(w.subs, ch)
		w.mu.Unlock()
	}
}

// Broadcast wakes every subscriber.
func (w *Waker) Broadcast() {
	w.mu.Lock()
	defer w.mu.Unlock()
	for ch := range w.subs {
		select {
		case ch <- struct{}{}:
		default:
		}
	}
}

// wakeAt wakes the subscribers at t, unless a wake-up no later than t is
// pending already.
func (w *Waker) wakeAt(t time.Time) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.later != nil {
		if !w.laterAt.After(t) {
			return
		}
		w.later.Stop()
	}
	var timer *time.Timer
	// The function takes w.mu before it reads timer, which is assigned
	// below while w.mu is held: it sees the assignment however soon it runs.
	timer = time.AfterFunc(time.Until(t), func() {
		w.mu.Lock()
		if w.later == timer {
			w.later = nil
		}
		w.mu.Unlock()
		w.Broadcast()
	})
	w.later, w.laterAt = timer, t
}

// stopLater drops the pending wake-up, if any.
func (w *Waker) stopLater() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.later != nil {
		w.later.Stop()
		w.later = nil
	}
}

// dueIn reads a notification's payload: how long until its head falls due,
// zero for now. A payload it cannot read (another release's) means now: a
// wake-up too early costs a claim, one too late costs lateness.
func dueIn(payload string) time.Duration {
	ms, err := strconv.ParseInt(payload, 10, 64)
	if err != nil || ms <= 0 {
		return 0
	}
	return time.Duration(ms) * time.Millisecond
}

// Run listens until ctx is done, reconnecting after errors.
func (w *Waker) Run(ctx context.Context) {
	defer w.stopLater()
	var failures int
	for ctx.Err() == nil {
		listened, err := w.listen(ctx)
		if ctx.Err() != nil {
			return
		}
		if listened {
			failures = 0 // it worked for a while: start the back-off over
		}
		failures++
		w.logger.Warn("notification listener lost its connection; polling meanwhile", "error", err)
		// Wake every subscriber (the loops share one subscription, so one
		// of them): notifications may have been missed while down.
		w.Broadcast()
		backoff.Sleep(ctx, backoff.Exp(failures, 100*time.Millisecond, 5*time.Second))
	}
}

// listen waits for notifications on one connection until it fails. It
// reports whether it got as far as listening.
func (w *Waker) listen(ctx context.Context) (bool, error) {
	pooled, err := w.pool.Acquire(ctx)
	if err != nil {
		return false, fmt.Errorf("connect to listen: %w", err)
	}
	// A connection that has LISTENed must not go back to the pool.
	conn := pooled.Hijack()
	defer conn.Close(context.WithoutCancel(ctx))
	for _, ch := range append([]string{NotifyChannel}, slices.Sorted(maps.Keys(w.also))...) {
		if _, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{ch}.Sanitize()); err != nil {
			return false, fmt.Errorf("listen on %s: %w", ch, err)
		}
	}
	for {
		wctx, cancel := context.WithTimeout(ctx, w.checkEvery)
		n, err := conn.WaitForNotification(wctx)
		cancel()
		if err != nil && ctx.Err() == nil && errors.Is(err, context.DeadlineExceeded) {
			// Nothing heard for a while: is the server still the primary?
			// pgx leaves the connection usable after a wait that timed out.
			st, err := queries.SessionState(ctx, conn)
			if err != nil {
				return true, fmt.Errorf("check the listening session: %w", err)
			}
			if st.ReadOnly {
				// Idle connections of the pool are on that server too.
				w.pool.Reset()
				return true, errors.New("the listening session's server takes no writes any more (a primary demoted in place?): listening again where the URL leads now")
			}
			continue
		}
		if err != nil {
			return true, fmt.Errorf("wait for notifications: %w", err)
		}
		if fn, ok := w.also[n.Channel]; ok {
			fn()
			continue
		}
		if wait := dueIn(n.Payload); wait > 0 {
			w.wakeAt(time.Now().Add(wait))
			continue
		}
		w.Broadcast()
		if !backoff.Sleep(ctx, w.throttle) {
			return true, ctx.Err()
		}
	}
}
