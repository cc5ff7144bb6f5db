package dispatch

import (
	"context"
	"slices"
	"time"

	"github.com/deferq/scheduler/internal/backoff"
	"github.com/deferq/scheduler/internal/keylock"
)

// Express claims (docs/design.md 4.4, "Express claims"): a message that falls
// due at a target without a backlog should not wait for the main claim.
// The loops of a process take that claim in turn (Config.ClaimTurns), and
// while another target drains, each claim reads a whole round: a message
// stored just after one started waits for it to end and for the next one.
// An express round claims only the due heads of light targets (at most
// Config.ExpressHeads due heads each), and only while another target has a
// backlog (keylock's ClaimExpress), outside the turns, when a notification
// says a head became due.
//
// Pacing bounds what the express rounds cost when notifications come from
// targets with a backlog (nothing light to claim): after a round that
// claimed, the next may start expressEvery later; after n rounds in a row
// that claimed nothing, expressEvery × 2^n later, up to expressIdle. Not
// expressIdle at once: a round also comes back empty when a main claim took
// the light head first, and the next light message should not pay for that.
const (
	expressEvery = 5 * time.Millisecond
	expressIdle  = 50 * time.Millisecond
)

// ExpressRound claims the due heads of light targets once (at most
// Config.ExpressHeads due heads per target), publishes and finalizes. Its
// keys go to Metrics.ExpressKeys, not to the round duration, and its line
// in the log is at debug level: there may be one per message of a light
// target.
func (d *Dispatcher) ExpressRound(ctx context.Context) (RoundStats, error) {
	start := d.now()
	keys, perKey := d.claimSize()
	claims, err := d.locker.ClaimExpress(ctx, keys, perKey, d.cfg.ExpressHeads)
	if err != nil && len(claims) == 0 {
		return RoundStats{}, err
	}
	d.longRuns = slices.ContainsFunc(claims, func(c keylock.Claim) bool { return len(c.Messages) >= perKey })
	return d.deliver(ctx, start, claims, RoundStats{}, err, true)
}

// RunExpress runs an express round after each wake-up (New's wake) until
// ctx is done or stop is closed, paced by expressEvery and expressIdle and
// backing off after errors. It skips the round while a loop of the process
// sleeps (Config.Sleeping): only when every loop is busy (claiming, waiting
// for its turn, publishing, finalizing) would a light message wait.
// Without wake-ups (notifications off) it only waits: the main loops alone
// are correct.
func (d *Dispatcher) RunExpress(ctx context.Context, stop <-chan struct{}) {
	var next time.Time
	empty := 0
	for {
		select {
		case <-ctx.Done():
			return
		case <-stop:
			return
		case <-d.wake:
		}
		if wait := next.Sub(d.now()); wait > 0 && !pause(ctx, stop, wait) {
			return
		}
		if d.cfg.Sleeping != nil && d.cfg.Sleeping.Load() > 0 {
			continue // a loop woken by the same notification claims at once
		}
		st, err := d.ExpressRound(ctx)
		gap := expressEvery
		switch {
		case err != nil:
			d.failures++
			if ctx.Err() == nil {
				d.logger.Warn("express dispatch round failed", "error", err, "consecutive", d.failures)
			}
			gap = backoff.Exp(d.failures, 50*time.Millisecond, d.cfg.MaxBackoff)
		case st.Keys == 0:
			d.failures = 0
			empty++
			gap = min(expressIdle, expressEvery<<min(empty, 8))
		default:
			d.failures, empty = 0, 0
		}
		next = d.now().Add(gap)
	}
}

// pause waits for dur, ctx or stop, and reports whether dur passed.
func pause(ctx context.Context, stop <-chan struct{}, dur time.Duration) bool {
	t := time.NewTimer(dur)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	case <-stop:
		return false
	}
}
