package runner

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/deferq/scheduler/internal/backoff"
)

// NotifyChannel is the channel the deferred_key triggers notify when a head
// that nobody holds becomes due soon (see migrations).
const NotifyChannel = "deferred_key_due"

// Waker turns database notifications into wake-ups for sleeping loops. A
// notification is only a hint: a loop that misses one still wakes at its next
// due time or poll, which is why Waker may drop, merge and delay them freely.
type Waker struct {
	pool     *pgxpool.Pool
	logger   *slog.Logger
	throttle time.Duration

	mu   sync.Mutex
	subs map[chan struct{}]struct{}
}

// NewWaker returns a Waker that wakes subscribers at most once per throttle.
func NewWaker(pool *pgxpool.Pool, throttle time.Duration, logger *slog.Logger) *Waker {
	return &Waker{pool: pool, logger: logger, throttle: throttle, subs: map[chan struct{}]struct{}{}}
}

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

// Run listens until ctx is done, reconnecting after errors.
func (w *Waker) Run(ctx context.Context) {
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
	if _, err := conn.Exec(ctx, "LISTEN "+NotifyChannel); err != nil {
		return false, fmt.Errorf("listen on %s: %w", NotifyChannel, err)
	}
	for {
		if _, err := conn.WaitForNotification(ctx); err != nil {
			return true, fmt.Errorf("wait for notifications: %w", err)
		}
		w.Broadcast()
		if !backoff.Sleep(ctx, w.throttle) {
			return true, ctx.Err()
		}
	}
}
