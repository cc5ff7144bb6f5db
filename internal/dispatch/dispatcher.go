// Package dispatch is the dispatch round: claim due key heads
// (internal/keylock), publish each key's run of due messages to its target
// topic in order, and finalize. internal/runner drives rounds in loops
// under River; this package knows nothing of River.
//
// No transaction is open while publishing: the claim commits a lease, the
// publish happens outside the database, and a second short transaction
// deletes what the broker acknowledged. A crash between the two republishes
// after the lease expires, with the same defer.id (at-least-once).
//
// A message refused for good is parked; if its park_holds_key says so it
// then holds its key, and nothing more of the key goes out until an operator
// replays or deletes it. Targets with a rate limit (target_control) are
// claimed apart, one message per token of a bucket all loops share. The
// records a round publishes, and the dead-letter copies of parked messages
// (internal/deadletter publishes them), are built here (Record, DeadLetter).
// See docs/design.md section 4.
package dispatch

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"

	"github.com/deferq/scheduler/internal/backoff"
	"github.com/deferq/scheduler/internal/batchproducer"
	"github.com/deferq/scheduler/internal/defer/protocol"
	"github.com/deferq/scheduler/internal/highwater"
	"github.com/deferq/scheduler/internal/keylock"
	"github.com/deferq/scheduler/internal/metrics"
	"github.com/deferq/scheduler/internal/reason"
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
	Targets protocol.TargetPatterns
	// Metrics receives per-round counts and durations, and River job outcomes
	// when this Config is a Runtime's; nil records nothing.
	Metrics *metrics.Metrics
	// RoundMessages caps the messages one round reads and holds, which
	// bounds a loop's memory; zero: no cap beyond BatchKeys × the locker's
	// per-key limit. Under the cap a round claims either many keys with
	// short runs or few keys with whole runs, the latter after a round in
	// which some key had more due messages than it could take (see
	// claimSize).
	RoundMessages int
	// OnParked, when set, is called after a round parked messages (the
	// runner's dead-letter publisher then looks at once).
	OnParked func()
	// Marks (nil: none) remembers the highest id and seq this process has
	// seen: every claim raises it, and the Runtime's heartbeat moves the
	// database's sequences past it (see internal/highwater).
	Marks *highwater.Marks
	// ClaimTurns, shared by the Dispatchers of one process, lets their main
	// claims take turns: at most its capacity of them run at once, and a
	// round waits for a turn before it claims (the wait goes to
	// Metrics.ClaimWait). nil: no turns, every loop claims when it likes.
	//
	// Why: a claim is the one statement a due message waits for, and loops
	// claiming at once make each claim slower (they share the database's
	// CPU, and each skips the heads the others hold locked) while the
	// finalizes, which nobody waits for, do not need to overlap with them.
	// Measured on two cores (docs/benchmarks.md, "Claims in turn"): with one
	// claim at a time among four loops, a quiet target's p99 while another
	// drains a million messages fell by 31% on average over seven pairs, the
	// end-to-end rate unchanged and the drain within a few percent.
	ClaimTurns chan struct{}
	// ExpressHeads is how many due heads (leased or not) a target may have
	// and still be light: express rounds (RunExpress) claim the free due
	// heads of light targets while another target has more, a backlog.
	ExpressHeads int
	// Sleeping, shared by the Dispatchers of one process (nil: not
	// counted), counts their loops asleep with nothing to claim, which a
	// notification wakes. Express rounds run only while it is zero: a
	// sleeping loop woken by the same notification claims at once, and an
	// express round beside it would only race it for the same heads.
	Sleeping *atomic.Int32
	// MaxMessageBytes is the producer's Producer.MaxMessageBytes; zero means
	// sarama's default (1 MiB). A message larger than that is parked before
	// the publish rather than refused by the producer, so that when it holds
	// its key nothing after it goes out in the same batch.
	MaxMessageBytes int
}

// defaultMaxMessageBytes is sarama's default Producer.MaxMessageBytes.
const defaultMaxMessageBytes = 1024 * 1024

// Dispatcher runs claim, publish, finalize rounds for one loop.
type Dispatcher struct {
	locker   *keylock.Locker
	producer Producer
	wake     <-chan struct{}
	cfg      Config
	logger   *slog.Logger
	now      func() time.Time

	// failures counts consecutive rounds that failed or achieved nothing;
	// it lengthens the loop's sleep.
	failures int
	// rounds counts rounds, for tests.
	rounds int
	// longRuns says the last claim had a key with more due messages than it
	// read (see claimSize).
	longRuns bool

	// afterPublish, when set (tests), runs between publish and finalize; an
	// error stops the round there, as a crash would.
	afterPublish func() error

	// limited caches the rate-limited targets for limitedFor (see
	// limitedTargets): a round only pays for rate limits when some exist.
	// limitedAt is when it was read; zero forces a read.
	limited    []string
	limitedAt  time.Time
	limitedFor time.Duration
}

// defaultLimitedFor is how long a loop trusts its list of rate-limited
// targets when no notification says otherwise. An operator's change to
// target_control notifies (see sleep), so a new limit applies at once where
// notifications work, and within this where they do not.
const defaultLimitedFor = 200 * time.Millisecond

// Bounds of the sleep of a loop waiting for a rate-limited target's next
// token: short enough to keep the rate, long enough not to spin.
const (
	minTokenWait = 10 * time.Millisecond
	maxTokenWait = time.Second
)

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
	if cfg.MaxMessageBytes <= 0 {
		cfg.MaxMessageBytes = defaultMaxMessageBytes
	}
	return &Dispatcher{locker: locker, producer: producer, wake: wake, cfg: cfg, logger: logger, now: time.Now,
		limitedFor: defaultLimitedFor}, nil
}

// errCrashed is returned by a round that a test hook stopped mid-way.
var errCrashed = errors.New("dispatch: stopped between publish and finalize")

// minIdle is the shortest sleep after a round that claimed nothing, for two
// reasons. A head can be due and still not claimed: someone locks it (an
// operator's open transaction, ingest, a finalize), and polling it without
// pause would spin. And heads that fall due within minIdle of each other
// are claimed together. Sleeping exactly until the next head instead
// (tried, docs/benchmarks.md) halved the p99 lateness at 200 msgs/s, 17 to
// 8 ms, for 35-70% more claims and a fifth more of Postgres's CPU per
// message; at 5,000 msgs/s it changed nothing, the loops seldom being idle.
const minIdle = 20 * time.Millisecond

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
		// The loop backs off only when the round failed or achieved nothing.
		// Keys that failed back off on their own (deferred_key.failures), so
		// one broken target does not slow the others down.
		if err != nil || (st.Retry > 0 && st.Published == 0 && st.Parked == 0) {
			d.failures++
			if err != nil && ctx.Err() == nil {
				d.logger.Warn("dispatch round failed", "error", err, "consecutive", d.failures)
			}
			d.sleep(ctx, until, stop, backoff.Exp(d.failures, 50*time.Millisecond, d.cfg.MaxBackoff), false)
			continue
		}
		d.failures = 0
		if st.Keys > 0 {
			continue // more may be due; cheap to look once more before sleeping
		}
		wait := d.cfg.PollInterval
		if due, ok, err := d.locker.NextDue(ctx); err != nil {
			d.logger.Warn("read next due time", "error", err)
		} else if ok {
			wait = min(wait, max(due, minIdle))
		}
		if st.Limited {
			// Rate-limited work is due: come back for the next token.
			wait = min(wait, max(minTokenWait, min(st.NextToken, maxTokenWait)))
		}
		d.sleep(ctx, until, stop, wait, true)
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
// A notification also drops the cached list of rate-limited targets: it may
// be an operator's change to target_control (which notifies), and a target
// that was just limited is skipped by the main claim at once, so it would
// otherwise send nothing until the cache expired. Other notifications cost
// one small read of target_control.
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
		if d.cfg.Sleeping != nil {
			d.cfg.Sleeping.Add(1)
			defer d.cfg.Sleeping.Add(-1)
		}
	}
	select {
	case <-t.C:
	case <-wake:
		d.limitedAt = time.Time{}
	case <-stop:
	case <-ctx.Done():
	}
}

// claimSize returns how many keys the next claim leases and how many
// messages it reads per key, within Config.RoundMessages. Without a cap, or
// when BatchKeys whole runs fit in it, that is BatchKeys and the locker's
// per-key limit. Otherwise it depends on the last round: if some key filled
// its share (its run is longer), few keys with whole runs, so that one hot
// key still moves PerKey messages per round; if not, many keys with short
// runs, so that many keys with a message or two each still move BatchKeys
// per round. Either way the main claim reads at most RoundMessages messages
// (a rate-limited target's claims, one message per token, come on top).
func (d *Dispatcher) claimSize() (keys, perKey int) {
	keys, perKey = d.cfg.BatchKeys, d.locker.PerKey()
	limit := d.cfg.RoundMessages
	if limit <= 0 || keys*perKey <= limit {
		return keys, perKey
	}
	if d.longRuns {
		perKey = min(perKey, limit)
		return max(1, min(keys, limit/perKey)), perKey
	}
	// At least two messages per key, so that a key filling its share shows
	// a run, not a single message.
	keys = min(keys, max(1, limit/2))
	return keys, max(1, limit/keys)
}

// RoundStats counts what one round did.
type RoundStats struct {
	Keys      int // keys claimed
	Published int // messages the broker acknowledged
	Parked    int // messages moved to the parking lot
	Retry     int // keys backed off after a retriable error
	// Limited says a rate-limited target had due work; NextToken is then how
	// long until one of them has a token again.
	Limited   bool
	NextToken time.Duration
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
	d.rounds++
	start := d.now()
	keys, perKey := d.claimSize()
	claims, claimErr := d.claimInTurn(ctx, keys, perKey)
	if claimErr != nil && len(claims) == 0 {
		return RoundStats{}, claimErr
	}
	// An error with claims (keys that came back empty were not given back):
	// they are leased to this loop all the same, so they go out below and
	// the error is returned after.
	d.longRuns = slices.ContainsFunc(claims, func(c keylock.Claim) bool { return len(c.Messages) >= perKey })
	// A failure here must not strand the keys claimed above: they are
	// published and finalized, and the error is returned after.
	limitedClaims, st, limitErr := d.claimLimited(ctx, d.locker.MaxBytes()-keylock.Bytes(claims))
	claimErr = errors.Join(claimErr, limitErr)
	claims = append(claims, limitedClaims...)
	return d.deliver(ctx, start, claims, st, claimErr, false)
}

// deliver publishes what a round claimed and finalizes it: st and claimErr
// are what the claims said so far. An express round (ExpressRound) is
// counted apart from the others and logged at debug level.
func (d *Dispatcher) deliver(ctx context.Context, start time.Time, claims []keylock.Claim, st RoundStats, claimErr error,
	express bool) (RoundStats, error) {
	st.Keys = len(claims)
	for _, c := range claims {
		for _, m := range c.Messages {
			d.cfg.Marks.Observe(m.ID, m.Seq)
		}
	}
	if len(claims) == 0 {
		return st, claimErr
	}

	batches := make([]batch, len(claims))
	var records []*sarama.ProducerMessage
	for i, c := range claims {
		b := batch{claim: c, first: len(records)}
		for _, m := range run(c.Messages) {
			// Parking either holds the key or releases it (the message's
			// park_holds_key), so stop the run here either way: what follows
			// is claimed again next round, in order, if the key is free.
			if reason := d.refuse(m.Target); reason != "" {
				d.logger.Warn("parking message whose target may not be published to", "id", m.ID,
					"target", m.Target, "reason", reason)
				// Such a target comes from a producer or an operator, not
				// from TARGET_TOPICS: it is not one to name in a label.
				d.cfg.Metrics.Parked(metrics.OtherTarget, reason)
				b.parks = append(b.parks, keylock.Park{ID: m.ID, Reason: reason})
				break
			}
			r := Record(m)
			// The producer would refuse it too, and not send what comes
			// after it in its partition (other keys would back off); and
			// when it holds its key, nothing after it may go anyway.
			if !batchproducer.Fits(r, d.cfg.MaxMessageBytes) {
				err := sarama.ConfigurationError(fmt.Sprintf(
					"Attempt to produce message larger than configured Producer.MaxMessageBytes: %d > %d", r.ByteSize(2), d.cfg.MaxMessageBytes))
				_, reason := classify(err)
				d.logger.Warn("parking message too large to publish", "id", m.ID, "target", m.Target, "reason", reason)
				d.cfg.Metrics.PublishError(m.Target, PublishErrorCode(err))
				d.cfg.Metrics.Parked(m.Target, reason)
				b.parks = append(b.parks, keylock.Park{ID: m.ID, Reason: reason})
				break
			}
			b.msgs = append(b.msgs, m)
			records = append(records, r)
		}
		batches[i] = b
	}

	failed := map[int]error{}
	if len(records) > 0 {
		if err := d.producer.SendMessages(records); err != nil {
			var perrs sarama.ProducerErrors
			if errors.As(err, &perrs) {
				index := make(map[*sarama.ProducerMessage]int, len(records))
				for i, r := range records {
					index[r] = i
				}
				for _, pe := range perrs {
					failed[index[pe.Msg]] = pe.Err
				}
			} else {
				// Not per message: count every record as failed, retriably.
				for i := range records {
					failed[i] = err
				}
			}
		}
	}
	// SendMessages returns once the last acknowledgement is in; the round's
	// messages went out in one go, so this is their acknowledgement time.
	acked := d.now()
	if d.afterPublish != nil {
		if err := d.afterPublish(); err != nil {
			return st, errCrashed
		}
	}

	mx := d.cfg.Metrics
	var out keylock.Outcome
	published := map[string]int{}
	for _, b := range batches {
		out.Parked = append(out.Parked, b.parks...)
		var lastErr error
		var firstFailed int64
		blocked, refused := false, false
		for j, m := range b.msgs {
			err, ok := failed[b.first+j]
			if !ok {
				if blocked || refused {
					// An earlier message of this key failed and this one went out.
					// The Producer contract rules this out; should one break it,
					// the message cannot be taken back: keep it published and
					// say so.
					d.logger.Warn("message published after an earlier one of its key failed",
						"id", m.ID, "target", m.Target)
				}
				r := records[b.first+j]
				out.Published = append(out.Published, m.ID)
				out.Placements = append(out.Placements, keylock.Placement{Partition: r.Partition, Offset: r.Offset})
				published[m.Target]++
				mx.ObserveLateness(acked.Sub(m.NextRunAt))
				continue
			}
			kind, reason := classify(err)
			if kind == permanent {
				d.logger.Warn("parking message the broker refused", "id", m.ID, "target", m.Target, "reason", reason)
				mx.PublishError(m.Target, PublishErrorCode(err))
				mx.Parked(m.Target, reason)
				out.Parked = append(out.Parked, keylock.Park{ID: m.ID, Reason: reason})
				refused = true
				continue
			}
			mx.PublishError(m.Target, "retriable")
			if !blocked {
				firstFailed = m.ID
			}
			blocked, lastErr = true, err
		}
		if blocked {
			out.Retry = append(out.Retry, b.claim)
			d.logger.Warn("publish failed, key backs off", "id", firstFailed, "target", b.msgs[0].Target,
				"reason", "retriable", "error", lastErr)
		}
	}
	for target, n := range published {
		mx.Published(target, n)
	}
	st.Published, st.Parked, st.Retry = len(out.Published), len(out.Parked), len(out.Retry)

	// Finalizing must not be given up for a database blip (a restart, a
	// failover): every message of the round would be published again after
	// the lease. Keep trying, whatever happens to ctx, for as long as the
	// lease holds; past it, another holder may have taken the keys.
	fctx, cancel := context.WithDeadline(context.WithoutCancel(ctx), start.Add(d.locker.Lease()))
	defer cancel()
	for attempt := 1; ; attempt++ {
		err := d.locker.Finalize(fctx, claims, out)
		if err == nil {
			break
		}
		d.logger.Warn("finalize failed; retrying while the lease holds", "error", err, "attempt", attempt)
		if !backoff.Sleep(fctx, backoff.Exp(attempt, 50*time.Millisecond, time.Second)) {
			return st, fmt.Errorf("finalize gave up when the lease ran out; %d published messages will be republished: %w",
				st.Published, err)
		}
	}
	if st.Parked > 0 && d.cfg.OnParked != nil {
		d.cfg.OnParked()
	}
	took := d.now().Sub(start)
	level := slog.LevelInfo
	if express {
		// There may be one per message of a light target.
		level = slog.LevelDebug
		mx.ExpressKeys(st.Keys)
	} else {
		mx.Round(took)
	}
	// One line per round that did something (empty rounds return above), so
	// the log follows the work, not the polling.
	d.logger.Log(ctx, level, "dispatch round", "keys", st.Keys, "published", st.Published, "parked", st.Parked,
		"retry", st.Retry, "duration", took)
	return st, claimErr
}

// claimInTurn is the round's main claim, once the loop has its turn
// (Config.ClaimTurns). The turn is given back when the claim statement
// returns: publishing and finalizing need none.
func (d *Dispatcher) claimInTurn(ctx context.Context, keys, perKey int) ([]keylock.Claim, error) {
	if d.cfg.ClaimTurns != nil {
		waited := d.now()
		select {
		case d.cfg.ClaimTurns <- struct{}{}:
		case <-ctx.Done():
			return nil, fmt.Errorf("wait for a turn to claim: %w", context.Cause(ctx))
		}
		d.cfg.Metrics.ClaimWait(d.now().Sub(waited))
		defer func() { <-d.cfg.ClaimTurns }()
	}
	return d.locker.ClaimRuns(ctx, keys, perKey)
}

// limitedTargets returns the rate-limited targets, read at most once per
// limitedFor unless a notification came (see sleep).
func (d *Dispatcher) limitedTargets(ctx context.Context) ([]string, error) {
	if now := d.now(); d.limitedAt.IsZero() || now.Sub(d.limitedAt) >= d.limitedFor {
		targets, err := d.locker.LimitedTargets(ctx)
		if err != nil {
			return nil, err
		}
		d.limited, d.limitedAt = targets, now
	}
	return d.limited, nil
}

// claimLimited claims due heads of rate-limited targets, one message per
// token: it takes tokens for every limited target with due work, claims at
// most that many heads of each, and gives back the tokens it could not use
// (heads held by other loops, or gone). The stats say whether any limited
// target had due work and how long until the next token. When no target is
// limited it costs nothing but a cached lookup. The claims share maxBytes,
// what the round's byte budget leaves after its main claim; each target's
// claim returns at least one message even when nothing is left of it, so a
// round holds at most its budget plus one message per limited target.
func (d *Dispatcher) claimLimited(ctx context.Context, maxBytes int) ([]keylock.Claim, RoundStats, error) {
	var st RoundStats
	targets, err := d.limitedTargets(ctx)
	if err != nil || len(targets) == 0 {
		return nil, st, err
	}
	grants, err := d.locker.TakeTokens(ctx, targets, d.cfg.BatchKeys)
	if err != nil {
		return nil, st, err
	}
	var claims []keylock.Claim
	var errs []error
	unused := map[string]int{}
	for _, g := range grants {
		if !st.Limited || g.NextToken < st.NextToken {
			st.NextToken = g.NextToken
		}
		st.Limited = true
		if g.Taken == 0 {
			continue
		}
		got, err := d.locker.ClaimTarget(ctx, g.Taken, g.Target, max(1, maxBytes))
		if err != nil {
			errs = append(errs, err)
		}
		maxBytes -= keylock.Bytes(got)
		claims = append(claims, got...)
		unused[g.Target] = g.Taken - len(got)
	}
	if err := d.locker.ReturnTokens(ctx, unused); err != nil {
		// Lost tokens only slow the target down until its bucket refills.
		errs = append(errs, err)
	}
	return claims, st, errors.Join(errs...)
}

// refuse says why target must not be published to, or "" if it may.
func (d *Dispatcher) refuse(target string) string {
	switch {
	case !protocol.ValidTopic(target):
		return reason.Format(reason.InvalidTarget, fmt.Sprintf("target_topic %q is not a valid Kafka topic name", target))
	case !d.cfg.Targets.Allows(target):
		return reason.Format(reason.TargetNotAllowed, fmt.Sprintf("target_topic %q is not in TARGET_TOPICS (changed after ingest?)", target))
	}
	return ""
}

// run returns the leading messages of a claim that go to the same topic,
// hence to the same partition: the one of their business key, whatever
// their record keys (see Record), where the producer keeps their order: it
// never acknowledges one after an earlier one failed (see Producer).
// Messages after a change of target wait for the next round, after these
// are acknowledged. An unordered claim holds one message.
func run(msgs []keylock.Message) []keylock.Message {
	for i := 1; i < len(msgs); i++ {
		if msgs[i].Target != msgs[0].Target {
			return msgs[:i]
		}
	}
	return msgs
}
