// Package dispatch republishes due messages: River jobs drive dispatch loops
// that claim due key heads (internal/keylock), publish each key's run of due
// messages to its target topic in order, and finalize.
//
// No transaction is open while publishing: the claim commits a lease, the
// publish happens outside the database, and a second short transaction
// deletes what the broker acknowledged. A crash between the two republishes
// after the lease expires, with the same defer.id (at-least-once).
package dispatch

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/IBM/sarama"

	deferral "github.com/deferq/scheduler/internal/defer"
	"github.com/deferq/scheduler/internal/keylock"
)

// Config tunes a Dispatcher.
type Config struct {
	// BatchKeys is how many keys one claim may lease.
	BatchKeys int
	// PollInterval bounds how long a loop sleeps when it has no better wake-up
	// time; polling alone keeps dispatch correct when notifications are off.
	PollInterval time.Duration
	// MaxBackoff caps the back-off after errors (database or broker).
	MaxBackoff time.Duration
	// Targets is the allow-list, checked again at publish time because an
	// operator may have changed target_topic in SQL.
	Targets deferral.TargetPatterns
}

// Dispatcher runs claim, publish, finalize rounds for one loop.
type Dispatcher struct {
	locker   *keylock.Locker
	producer Producer
	wake     <-chan struct{}
	cfg      Config
	logger   *slog.Logger
	now      func() time.Time

	// failures counts consecutive rounds that failed or backed off; it
	// lengthens both the loop's sleep and the keys' back-off.
	failures int

	// afterPublish, when set (tests), runs between publish and finalize; an
	// error stops the round there, as a crash would.
	afterPublish func() error
}

// New returns a Dispatcher. wake may be nil (no notifications).
func New(locker *keylock.Locker, producer Producer, wake <-chan struct{}, cfg Config, logger *slog.Logger) (*Dispatcher, error) {
	switch {
	case cfg.BatchKeys < 1:
		return nil, fmt.Errorf("dispatch: batch of %d keys, need at least 1", cfg.BatchKeys)
	case cfg.PollInterval <= 0:
		return nil, fmt.Errorf("dispatch: poll interval %v must be positive", cfg.PollInterval)
	}
	if cfg.MaxBackoff <= 0 {
		cfg.MaxBackoff = 5 * time.Second
	}
	return &Dispatcher{locker: locker, producer: producer, wake: wake, cfg: cfg, logger: logger, now: time.Now}, nil
}

// errCrashed is returned by a round that a test hook stopped mid-way.
var errCrashed = errors.New("dispatch: stopped between publish and finalize")

// Run dispatches until ctx is done, stop is closed, or until passes. It
// returns nil on those; errors inside rounds are logged and backed off from,
// because one failed round (a database blip, a broker restart) must not end
// the loop.
func (d *Dispatcher) Run(ctx context.Context, until time.Time, stop <-chan struct{}) error {
	for ctx.Err() == nil && d.now().Before(until) && !closed(stop) {
		st, err := d.Round(ctx)
		if errors.Is(err, errCrashed) {
			return err
		}
		if err != nil || st.Retry > 0 {
			d.failures++
			if err != nil && ctx.Err() == nil {
				d.logger.Warn("dispatch round failed", "error", err, "consecutive", d.failures)
			}
			d.sleep(ctx, until, stop, backoff(d.failures, d.cfg.MaxBackoff), false)
			continue
		}
		d.failures = 0
		if st.Keys >= d.cfg.BatchKeys {
			continue // a full batch: more is probably due
		}
		if st.Keys > 0 {
			continue // cheap to look once more before sleeping
		}
		wait := d.cfg.PollInterval
		if due, ok, err := d.locker.NextDue(ctx); err != nil {
			d.logger.Warn("read next due time", "error", err)
		} else if ok && due < wait {
			wait = due
		}
		if wait > 0 {
			d.sleep(ctx, until, stop, wait, true)
		}
	}
	return nil
}

func closed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// sleep waits for d, the loop's end, a stop, or (if wakeable) a notification.
func (d *Dispatcher) sleep(ctx context.Context, until time.Time, stop <-chan struct{}, dur time.Duration, wakeable bool) {
	if left := until.Sub(d.now()); left < dur {
		dur = left
	}
	if dur <= 0 {
		return
	}
	t := time.NewTimer(dur)
	defer t.Stop()
	var wake <-chan struct{}
	if wakeable {
		wake = d.wake
	}
	select {
	case <-t.C:
	case <-wake:
	case <-stop:
	case <-ctx.Done():
	}
}

func backoff(failures int, limit time.Duration) time.Duration {
	b := 50 * time.Millisecond
	for i := 1; i < failures && b < limit; i++ {
		b *= 2
	}
	return min(b, limit)
}

// RoundStats counts what one round did.
type RoundStats struct {
	Keys      int // keys claimed
	Published int
	Parked    int
	Retry     int // keys backed off after a retriable error
}

// batch is what a round publishes for one claimed key.
type batch struct {
	claim keylock.Claim
	msgs  []keylock.Message
	parks []keylock.Park
	first int // index of msgs[0] in the producer batch
}

// Round claims due keys once, publishes, and finalizes.
func (d *Dispatcher) Round(ctx context.Context) (RoundStats, error) {
	start := d.now()
	claims, err := d.locker.Claim(ctx, d.cfg.BatchKeys)
	if err != nil {
		return RoundStats{}, err
	}
	st := RoundStats{Keys: len(claims)}
	if len(claims) == 0 {
		return st, nil
	}

	batches := make([]batch, len(claims))
	var records []*sarama.ProducerMessage
	for i, c := range claims {
		b := batch{claim: c, first: len(records)}
		for _, m := range run(c.Messages) {
			if !d.cfg.Targets.Allows(m.Target) || !deferral.ValidTopic(m.Target) {
				// Parking releases the key, so stop the run here: what follows
				// is claimed again next round, in order.
				b.parks = append(b.parks, keylock.Park{ID: m.ID, Reason: fmt.Sprintf(
					"target_not_allowed: target_topic %q is not in TARGET_TOPICS (changed after ingest?)", m.Target)})
				break
			}
			b.msgs = append(b.msgs, m)
			records = append(records, Record(m))
		}
		batches[i] = b
	}

	failed := map[int]error{}
	if len(records) > 0 {
		if err := d.producer.SendMessages(records); err != nil {
			var perrs sarama.ProducerErrors
			if !errors.As(err, &perrs) {
				return st, fmt.Errorf("publish %d records: %w", len(records), err)
			}
			index := make(map[*sarama.ProducerMessage]int, len(records))
			for i, r := range records {
				index[r] = i
			}
			for _, pe := range perrs {
				failed[index[pe.Msg]] = pe.Err
			}
		}
	}
	if d.afterPublish != nil {
		if err := d.afterPublish(); err != nil {
			return st, errCrashed
		}
	}

	out := keylock.Outcome{Backoff: backoff(d.failures+1, d.cfg.MaxBackoff)}
	for _, b := range batches {
		out.Parked = append(out.Parked, b.parks...)
		var lastErr error
		blocked := false
		for j, m := range b.msgs {
			err, ok := failed[b.first+j]
			if !ok {
				if blocked {
					// An earlier message of this key failed and this one went out:
					// it cannot be taken back, so keep it published and say so.
					d.logger.Warn("message published after an earlier one of its key failed",
						"id", m.ID, "target", m.Target)
				}
				out.Published = append(out.Published, m.ID)
				continue
			}
			kind, reason := classify(err)
			if kind == permanent {
				d.logger.Warn("parking message the broker refused", "id", m.ID, "target", m.Target, "reason", reason)
				out.Parked = append(out.Parked, keylock.Park{ID: m.ID, Reason: reason})
				continue
			}
			blocked, lastErr = true, err
		}
		if blocked {
			out.Retry = append(out.Retry, b.claim)
			d.logger.Warn("publish failed, key backs off", "target", b.msgs[0].Target, "error", lastErr)
		}
	}
	st.Published, st.Parked, st.Retry = len(out.Published), len(out.Parked), len(out.Retry)

	// Finalizing must not be skipped for a database blip: that would turn
	// every published message of the batch into a duplicate later.
	for attempt := 1; ; attempt++ {
		err := d.locker.Finalize(ctx, claims, out)
		if err == nil {
			break
		}
		if ctx.Err() != nil || attempt == 5 {
			return st, err
		}
		time.Sleep(backoff(attempt, time.Second))
	}
	d.logger.Debug("dispatch round", "keys", st.Keys, "published", st.Published, "parked", st.Parked,
		"retry", st.Retry, "duration", d.now().Sub(start))
	return st, nil
}

// run returns the leading messages of a claim that go to the same topic with
// the same record key, hence to the same partition, where the idempotent
// producer keeps their order even across retries. Messages after a change of
// destination wait for the next round, after these are acknowledged.
func run(msgs []keylock.Message) []keylock.Message {
	if len(msgs) > 0 && msgs[0].Key == nil {
		// Without a record key the partitioner picks a partition at random
		// per record, so nothing orders two of them: send one at a time.
		return msgs[:1]
	}
	for i := 1; i < len(msgs); i++ {
		if msgs[i].Target != msgs[0].Target || msgs[i].Key == nil || !bytes.Equal(msgs[i].Key, msgs[0].Key) {
			return msgs[:i]
		}
	}
	return msgs
}
