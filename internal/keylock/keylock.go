// Package keylock is the per-key head and lease model behind the ordering
// guarantee: for one business key, messages are republished in seq order.
//
// The database keeps one row per business key in deferred_key, holding the
// key's head (its pending message with the lowest seq, or a parked message
// ahead of those that holds the key: the key is then held, never due, until
// an operator replays or deletes that message) and a lease. Triggers
// on deferred_message keep the heads true for every statement, including an
// operator's plain SQL, so this package only claims and releases leases:
//
//  1. Claim leases due heads nobody holds (FOR UPDATE SKIP LOCKED, committed at
//     once) and reads each key's run of consecutive due messages.
//  2. The caller publishes, outside any transaction.
//  3. Finalize, in one implicit transaction, deletes what was published, parks
//     what was refused for good, and gives the keys back (after a back-off for
//     keys that failed retriably).
//
// Two holders never share a key: a lease is only taken when free or expired.
// A holder that dies between publish and finalize loses nothing: its lease
// expires and the key is claimed again (at-least-once, same defer.id).
package keylock

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync/atomic"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/deferq/scheduler/sql/queries"
)

// Header is one Kafka record header as stored.
type Header struct {
	Key   string
	Value []byte
}

// Message is a pending message read by a claim.
type Message struct {
	ID        int64
	Seq       int64
	Target    string
	NextRunAt time.Time
	Attempt   int32
	// RedriveCount is how many times an operator replayed the message's
	// lineage out of the parking lot.
	RedriveCount int32
	Key          []byte // nil: the record had no key
	Value        []byte // nil: a tombstone
	Headers      []Header
	// BusinessKey is the key's business key, "" for an unordered message.
	BusinessKey string
	// Group is the consumer group the record named (defer.group), "" for
	// none: once published, the key stays blocked for the group until it
	// committed past the record (Outcome.Placements).
	Group string
	// ClaimedAt is when the claim that read it ran, on the database's
	// clock. Finalize records its delivery at it: before the publish, so
	// before anything a consumer does with the record.
	ClaimedAt time.Time
}

// Claim is one leased key with its due messages in order.
type Claim struct {
	BusinessKey string // valid when Ordered
	Ordered     bool
	HeadID      int64 // the head when claimed; identifies an unordered head
	Messages    []Message
	// Weight is the target's target_control.weight when claimed (1
	// without a row): how many of its heads a turn of a main claim takes.
	Weight int
}

// Placement is where the broker put a published record.
type Placement struct {
	Partition int32
	Offset    int64
}

// Park is a message to move to the parking lot.
type Park struct {
	ID     int64
	Reason string
}

// Outcome is what happened to the messages of a set of claims.
type Outcome struct {
	Published []int64 // acknowledged by the broker
	// Placements says where each of Published went in its target, in the
	// same order: recorded in its history and, for a message that names a
	// consumer group, in deferred_inflight. Nil when unknown (tests).
	Placements []Placement
	Parked     []Park // refused for good
	// Retry lists claims that hit a retriable error: their keys stay blocked
	// for a back-off that grows with each consecutive failure of the key,
	// then any holder may take them again.
	Retry []Claim
}

// Locker claims and releases keys for one holder.
type Locker struct {
	pool *pgxpool.Pool
	cfg  Config
	// share is how many due heads the next main claim reads per target
	// (dispatch_claim.sql's $6); 0: the whole round, whatever its size
	// (before the first claim, and after one that left no target holding
	// back), so that a round larger than the last one (dispatch's claimSize
	// goes from few keys to many after a hot key) still reads all of it
	// for a lone target. See nextShare.
	share atomic.Int64
}

// Config configures a Locker.
type Config struct {
	// Owner names the holder in deferred_key.leased_by; unique per dispatch
	// loop so that a late finalize cannot release someone else's lease.
	Owner string
	// Lease is how long a claim holds its keys. It must exceed the longest
	// publish, or a slow publish could overlap a second holder's.
	Lease time.Duration
	// PerKey caps the messages read for one key per claim.
	PerKey int
	// MaxBytes caps the bytes (record keys, values and header values, see
	// Bytes) of the messages one claim reads; the claim statement applies
	// it, so that what is beyond it never leaves the database. A key cut
	// part-way keeps the first messages of its run; a key cut entirely is
	// given back at once. The claim's first message always comes back,
	// whatever its size. Zero means DefaultMaxBytes.
	MaxBytes int
	// BackoffBase and BackoffMax bound the back-off of a key after retriable
	// failures: BackoffBase doubled per consecutive failure, at most
	// BackoffMax. Zero means 100ms and 30s.
	BackoffBase, BackoffMax time.Duration
}

// DefaultMaxBytes is the default memory budget of one claim (the default
// of DISPATCH_ROUND_BYTES).
const DefaultMaxBytes = 8 << 20

// New returns a Locker.
func New(pool *pgxpool.Pool, cfg Config) (*Locker, error) {
	switch {
	case cfg.Owner == "":
		return nil, errors.New("keylock: owner is empty")
	case cfg.Lease <= 0:
		return nil, fmt.Errorf("keylock: lease %v must be positive", cfg.Lease)
	case cfg.PerKey < 1:
		return nil, fmt.Errorf("keylock: per-key batch %d must be at least 1", cfg.PerKey)
	}
	if cfg.MaxBytes <= 0 {
		cfg.MaxBytes = DefaultMaxBytes
	}
	if cfg.BackoffBase <= 0 {
		cfg.BackoffBase = 100 * time.Millisecond
	}
	if cfg.BackoffMax <= 0 {
		cfg.BackoffMax = 30 * time.Second
	}
	return &Locker{pool: pool, cfg: cfg}, nil
}

// Lease returns how long a claim holds its keys.
func (l *Locker) Lease() time.Duration { return l.cfg.Lease }

// Claim leases up to maxKeys due keys and returns them with their due
// messages. The keys are shared round-robin between the targets that have
// due heads, earliest due first within each (dispatch_claim.sql), so one
// target's backlog does not hold back another's; the Locker remembers how
// many heads per target to read next (nextShare), which is why a Locker is
// one dispatch loop's. Keys whose head goes to a paused or rate-limited target are left
// alone (see ClaimTarget for the latter). A claimed key whose messages
// vanished (an operator changed them after the head was read), or that the
// byte budget cut entirely, is released at once and not returned.
//
// An error may come with claims: the claim committed, and releasing the
// keys that came back without a message failed. The claims are then leased
// to the caller like any others and must be published and finalized; the
// keys that were to be released wait out their lease.
func (l *Locker) Claim(ctx context.Context, maxKeys int) ([]Claim, error) {
	return l.ClaimRuns(ctx, maxKeys, l.cfg.PerKey)
}

// ClaimRuns is Claim reading at most perKey messages per key (at most
// Config.PerKey): a caller bounding the messages of one claim trades keys
// for run length with it.
func (l *Locker) ClaimRuns(ctx context.Context, maxKeys, perKey int) ([]Claim, error) {
	share := maxKeys
	if s := int(l.share.Load()); s > 0 {
		share = min(s, maxKeys)
	}
	claims, empty, err := l.claim(ctx, "claim due keys", func(p queries.ClaimParams) ([]queries.DispatchClaimRow, error) {
		return queries.DispatchClaim(ctx, l.pool, queries.DispatchClaimParams{ClaimParams: p, Share: share})
	}, maxKeys, max(1, min(perKey, l.cfg.PerKey)), l.cfg.MaxBytes)
	if err == nil || len(claims)+empty > 0 { // the statement ran
		next := nextShare(claims, empty, maxKeys, share)
		if next >= maxKeys {
			next = 0
		}
		l.share.Store(int64(next))
	}
	return claims, err
}

// ClaimExpress is ClaimRuns for the due heads of light targets only: those
// with at most light due heads (leased or not), and only while some other
// target has more (dispatch_express_targets.sql). Such a target has a
// backlog, which the main claim shares out; this one is for messages that
// should not wait behind it (see internal/dispatch's RunExpress). Without a
// backlog, or without a light target, it claims nothing and runs only that
// small count. It takes at most maxKeys keys, at most light of each target,
// earliest due first (dispatch_claim_express.sql), and does not change
// what the main claim reads per target.
func (l *Locker) ClaimExpress(ctx context.Context, maxKeys, perKey, light int) ([]Claim, error) {
	light = max(1, light)
	rows, err := queries.DispatchExpressTargets(ctx, l.pool, queries.DispatchExpressTargetsParams{Light: light})
	if err != nil {
		return nil, fmt.Errorf("count due heads per target for an express claim: %w", err)
	}
	if len(rows) == 0 {
		return nil, nil
	}
	targets := make([]string, len(rows))
	for i, r := range rows {
		targets[i] = r.Target
	}
	claims, _, err := l.claim(ctx, "claim due keys of light targets", func(p queries.ClaimParams) ([]queries.DispatchClaimRow, error) {
		return queries.DispatchClaimExpress(ctx, l.pool, queries.DispatchClaimExpressParams{ClaimParams: p, Targets: targets, PerTarget: light})
	}, maxKeys, max(1, min(perKey, l.cfg.PerKey)), l.cfg.MaxBytes)
	return claims, err
}

// PerKey returns Config.PerKey.
func (l *Locker) PerKey() int { return l.cfg.PerKey }

// ClaimTarget leases up to maxKeys due keys whose head goes to target, which
// must not be paused, and returns them with one message each: the caller
// took one token of the target's rate limit per key it asks for (see
// TakeTokens), and one token pays for one message. The messages come within
// maxBytes (at least one message comes back, whatever its size); keys beyond
// it are given back, and their tokens are the caller's to return. As with
// Claim, an error may come with claims, which the caller must publish.
func (l *Locker) ClaimTarget(ctx context.Context, maxKeys int, target string, maxBytes int) ([]Claim, error) {
	claims, _, err := l.claim(ctx, fmt.Sprintf("claim due keys of rate-limited target %q", target),
		func(p queries.ClaimParams) ([]queries.DispatchClaimRow, error) {
			return queries.DispatchClaimTarget(ctx, l.pool, queries.DispatchClaimTargetParams{ClaimParams: p, Target: target})
		}, maxKeys, 1, maxBytes)
	return claims, err
}

// MaxBytes returns Config.MaxBytes.
func (l *Locker) MaxBytes() int { return l.cfg.MaxBytes }

// Bytes returns what the messages of claims count against a claim's byte
// budget: record keys, values and header values, as the claim statement
// counts them.
func Bytes(claims []Claim) int {
	n := 0
	for _, c := range claims {
		for _, m := range c.Messages {
			n += len(m.Key) + len(m.Value)
			for _, h := range m.Headers {
				n += len(h.Value)
			}
		}
	}
	return n
}

// claim runs one of the claim statements (dispatch_claim.sql,
// dispatch_claim_target.sql, dispatch_claim_express.sql) through query, with
// the parameters they share, and turns its rows into claims; what names
// the statement in errors. They are separate statements rather than one
// with optional parts so that each names its partial index's predicate
// (deferred_key.throttled) as a constant, so that even a generic plan of
// the prepared statement can use that index.
//
// maxBytes is applied by the statement ($5): rows past it come back with
// their key only (id NULL), and such keys are released here. It returns how
// many keys came back empty beside the claims.
func (l *Locker) claim(ctx context.Context, what string, query func(queries.ClaimParams) ([]queries.DispatchClaimRow, error),
	maxKeys, perKey, maxBytes int) ([]Claim, int, error) {
	params := queries.ClaimParams{MaxKeys: maxKeys, Lease: l.cfg.Lease, PerKey: perKey, Owner: l.cfg.Owner,
		MaxBytes: int64(max(1, maxBytes))}
	rows, err := query(params)
	if isDeadlock(err) {
		// SKIP LOCKED does not keep the claim from ever waiting: locking a
		// head that a concurrent statement updated, PostgreSQL follows the
		// row's update chain and may wait for the transaction updating its
		// newest version ("while locking updated version ... of tuple in
		// relation deferred_key"). An operator's statement whose head
		// refresh waits for a head this claim locked then closes a cycle,
		// and Postgres aborts one of the two (seen once in
		// TestConcurrentInvariants). The claim is one statement, so nothing
		// of it committed: once more, as Finalize does, rather than fail
		// the round.
		rows, err = query(params)
	}
	if err != nil {
		return nil, 0, fmt.Errorf("%s: %w", what, err)
	}

	var claims, empty []Claim
	for i := range rows {
		r := &rows[i]
		c := Claim{HeadID: r.HeadID, Ordered: r.BusinessKey != nil}
		if r.BusinessKey != nil {
			c.BusinessKey = *r.BusinessKey
		}
		if r.ID == nil {
			empty = append(empty, c)
			continue
		}
		if len(claims) == 0 || !sameClaim(claims[len(claims)-1], c) {
			c.Weight = max(1, int(r.TargetWeight))
			claims = append(claims, c)
		}
		m := Message{ID: *r.ID, Seq: *r.Seq, Target: *r.Target, NextRunAt: *r.NextRunAt, Attempt: *r.Attempt,
			RedriveCount: *r.RedriveCount, Key: r.Key, Value: r.Value, Headers: make([]Header, len(r.HeaderKeys)),
			BusinessKey: c.BusinessKey, ClaimedAt: r.ClaimedAt}
		if r.Group != nil {
			m.Group = *r.Group
		}
		for j := range r.HeaderKeys {
			m.Headers[j] = Header{Key: r.HeaderKeys[j], Value: r.HeaderValues[j]}
		}
		last := &claims[len(claims)-1]
		last.Messages = append(last.Messages, m)
	}
	if len(empty) > 0 {
		if err := l.Finalize(ctx, empty, Outcome{}); err != nil {
			// The claims are leased all the same: dropped here, their
			// messages would wait out the lease unpublished.
			return claims, len(empty), fmt.Errorf("give back %d claimed keys that came back without a message (they wait out their lease): %w",
				len(empty), err)
		}
	}
	return claims, len(empty), nil
}

// nextShare returns how many due heads the next main claim should read per
// target and unit of its weight, from what this one took: claims (and
// empty, the keys that came back without a message) out of maxKeys,
// reading at most share times its weight of each target.
//
// The claim statement shares a round between targets turn by turn whatever
// the share; the share only bounds what it reads and locks per target
// before it does. Too small, and a target with a backlog gets less than
// the round leaves it; too large, and the claim locks heads of several
// backlogged targets that it then leaves. So it is set to what the
// targets that still had heads left can use: the round minus what the
// others took, split between them by weight (a turn takes a target's
// weight in heads: Claim.Weight). A target had heads left when it took
// the whole of what it could read, or, in a full round, when it took as
// many turns as the most any target took, less one (the turn the round
// ended in). With one target the share is the whole round; with none, or
// no target holding back anything, it is the whole round too, and a claim
// that then finds several backlogs ends up taking turns between them all
// the same, only reading more.
func nextShare(claims []Claim, empty, maxKeys, share int) int {
	type took struct{ n, weight int }
	taken := make(map[string]*took)
	for _, c := range claims {
		t := c.Messages[0].Target
		k := taken[t]
		if k == nil {
			k = &took{weight: max(1, c.Weight)}
			taken[t] = k
		}
		k.n++
	}
	turns := func(k *took) int { return (k.n + k.weight - 1) / k.weight }
	most := 0
	for _, k := range taken {
		most = max(most, turns(k))
	}
	full := len(claims)+empty >= maxKeys
	left, weights := maxKeys-empty, 0
	for _, k := range taken {
		if k.n >= min(maxKeys, share*k.weight) || (full && turns(k) >= most-1) {
			weights += k.weight
		} else {
			left -= k.n
		}
	}
	if weights == 0 {
		return maxKeys
	}
	return max(1, min(maxKeys, (left+weights-1)/weights))
}

func sameClaim(a, b Claim) bool {
	if a.Ordered != b.Ordered {
		return false
	}
	if a.Ordered {
		return a.BusinessKey == b.BusinessKey
	}
	return a.HeadID == b.HeadID
}

// Finalize records the outcome of publishing claims and releases their keys,
// all in one implicit transaction (one pipelined round trip). Leases that are
// no longer ours (expired and taken by another holder) are left alone.
func (l *Locker) Finalize(ctx context.Context, claims []Claim, out Outcome) error {
	if !lockFree(claims, out) {
		return l.finalize(ctx, claims, out, true)
	}
	err := l.finalize(ctx, claims, out, false)
	if isDeadlock(err) {
		// Most likely an operator changed a claimed key's messages since
		// the claim, so the delete left that key for the release to lock,
		// out of key order (see lockFree). Again, with every lock taken
		// in order first: nothing of the first attempt committed.
		return l.finalize(ctx, claims, out, true)
	}
	return err
}

// isDeadlock reports whether err is PostgreSQL's "deadlock detected".
func isDeadlock(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == pgerrcode.DeadlockDetected
}

// lockFree reports whether a finalize of claims with out can leave out its
// lock statements (dispatch_lock_messages.sql, dispatch_lock_keys.sql),
// because one statement, the delete, takes every lock in the order they
// keep: it locks the messages by their primary key, and the head trigger it
// fires then locks their keys, all in one upsert in key order. That holds
// when every claim published at least one message (so the trigger locks
// every key the release writes after it), nothing was parked or failed
// (the park and the back-off are statements of their own, after the
// delete) and no message names a consumer group (the delete's own update
// of in-flight keys would lock those before the trigger locks the rest).
// This is nearly every round, and the two statements are a write of every
// message and key row and a WAL record each (docs/benchmarks.md, "Finalize
// without its lock statements").
//
// It is an assumption about the database, not a proof: between the claim
// and the finalize an operator may cancel, park or move to another key
// every message of a claimed key, which the delete then skips (or
// refreshes under the other key), and the release locks that key last.
// Should an ingest statement hold it while waiting for a key this finalize
// holds, Postgres reports a deadlock and aborts one of the two; Finalize
// then runs again with the lock statements (above), and ingest retries its
// batch.
func lockFree(claims []Claim, out Outcome) bool {
	if len(out.Parked) > 0 || len(out.Retry) > 0 || len(out.Published) == 0 {
		return false
	}
	published := make(map[int64]bool, len(out.Published))
	for _, id := range out.Published {
		published[id] = true
	}
	for _, c := range claims {
		sent := false
		for _, m := range c.Messages {
			if m.Group != "" {
				return false
			}
			sent = sent || published[m.ID]
		}
		if !sent {
			return false
		}
	}
	return true
}

func (l *Locker) finalize(ctx context.Context, claims []Claim, out Outcome, lock bool) error {
	var keys, retryKeys []string
	var heads, retryHeads []int64
	for _, c := range claims {
		if c.Ordered {
			keys = append(keys, c.BusinessKey)
		} else {
			heads = append(heads, c.HeadID)
		}
	}
	for _, c := range out.Retry {
		if c.Ordered {
			retryKeys = append(retryKeys, c.BusinessKey)
		} else {
			retryHeads = append(retryHeads, c.HeadID)
		}
	}
	parkIDs := make([]int64, len(out.Parked))
	parkReasons := make([]string, len(out.Parked))
	for i, p := range out.Parked {
		parkIDs[i], parkReasons[i] = p.ID, p.Reason
	}

	// Locks first, messages before keys, each in order (see
	// dispatch_lock_messages.sql), unless the delete takes them so
	// (lockFree); then the changes, under this finalize's
	// name (dispatch_finalizing.sql), so that the head trigger deletes at
	// once the row of a key it leaves without messages; then the rows of
	// keys an operator emptied while this holder published them, unless a
	// message arrived in them meanwhile (see
	// sql/schema/functions/deferred_key_refresh.sql); last, the release.
	// Releasing before the changes would let the head trigger see the keys
	// free and wake every dispatch loop at each commit (measured: a single
	// key's dispatch fell from 15,000 to 6,000 msgs/s).
	b := &pgx.Batch{}
	if changed := append(append([]int64(nil), out.Published...), parkIDs...); lock && len(changed) > 0 {
		queries.QueueDispatchLockMessages(b, queries.DispatchLockMessagesParams{IDs: changed})
	}
	if lock && len(keys) > 0 {
		queries.QueueDispatchLockKeys(b, queries.DispatchLockKeysParams{Keys: keys})
	}
	queries.QueueDispatchFinalizing(b, queries.DispatchFinalizingParams{Owner: l.cfg.Owner})
	if len(out.Published) > 0 {
		p := queries.DispatchDeleteParams{IDs: out.Published}
		if len(out.Placements) == len(out.Published) {
			p.Partitions = make([]int32, len(out.Placements))
			p.Offsets = make([]int64, len(out.Placements))
			for i, pl := range out.Placements {
				p.Partitions[i], p.Offsets[i] = pl.Partition, pl.Offset
			}
		}
		p.ClaimedAt = claimedAt(claims, out.Published)
		queries.QueueDispatchDelete(b, p)
	}
	if len(parkIDs) > 0 {
		queries.QueueDispatchPark(b, queries.DispatchParkParams{IDs: parkIDs, Reasons: parkReasons})
	}
	if len(keys) > 0 {
		queries.QueueDispatchReleaseEmpty(b, queries.DispatchReleaseEmptyParams{Keys: keys, Owner: l.cfg.Owner})
	}
	if len(keys) > 0 {
		queries.QueueDispatchRelease(b, queries.DispatchReleaseParams{Keys: keys, Owner: l.cfg.Owner,
			RetryKeys: retryKeys, BackoffBase: l.cfg.BackoffBase, BackoffMax: l.cfg.BackoffMax})
	}
	if len(heads) > 0 {
		queries.QueueDispatchReleaseUnordered(b, queries.DispatchReleaseUnorderedParams{Heads: heads, Owner: l.cfg.Owner,
			RetryHeads: retryHeads, BackoffBase: l.cfg.BackoffBase, BackoffMax: l.cfg.BackoffMax})
	}
	if err := l.pool.SendBatch(ctx, b).Close(); err != nil {
		return fmt.Errorf("finalize %d keys (%d published, %d parked): %w",
			len(claims), len(out.Published), len(parkIDs), err)
	}
	return nil
}

// claimedAt returns, for each of ids, when the claim among claims that read
// it ran; nil if one of them is in none of claims (a caller's mistake: the
// deliveries are then recorded at the finalize, as before claims said when
// they ran).
func claimedAt(claims []Claim, ids []int64) []time.Time {
	at := make(map[int64]time.Time, len(ids))
	for _, c := range claims {
		for _, m := range c.Messages {
			at[m.ID] = m.ClaimedAt
		}
	}
	out := make([]time.Time, len(ids))
	for i, id := range ids {
		t, ok := at[id]
		if !ok || t.IsZero() {
			return nil
		}
		out[i] = t
	}
	return out
}

// NextDue returns how long until the earliest head that nobody holds is due
// (0 if due now), and false when there is none: nothing pending, or every
// head leased, backing off, held by a parked message or of a paused target
// (the caller then falls back to its poll interval). Due heads of
// rate-limited targets do not count: their pace is their tokens' (see
// TakeTokens).
func (l *Locker) NextDue(ctx context.Context) (time.Duration, bool, error) {
	row, found, err := queries.DispatchNextDue(ctx, l.pool)
	if err != nil {
		return 0, false, fmt.Errorf("read next due time: %w", err)
	}
	return seconds(row.Seconds), found, nil
}

// seconds converts a number of seconds read from the database to a
// Duration, clamped to [0, the longest Duration]. A head due in the year
// 9999, or a rate limit of 1e-12 per second, is further away than a
// Duration can say, and converting an out-of-range float to an integer
// gives an undefined value (on amd64 the most negative Duration, which
// would make a loop sleep its shortest and spin).
func seconds(secs float64) time.Duration {
	switch {
	case math.IsNaN(secs) || secs <= 0:
		return 0
	case secs >= maxDurationSeconds:
		return time.Duration(math.MaxInt64)
	}
	return time.Duration(secs * float64(time.Second))
}

// maxDurationSeconds is the whole seconds a Duration can hold: any float
// below it converts without overflow.
const maxDurationSeconds = float64(math.MaxInt64 / int64(time.Second))

// AnalyzeIfStale analyzes deferred_message and deferred_key when the
// planner's estimate of their rows has fallen below half of what they hold,
// and they hold more than minRows, and returns the tables it analyzed. A
// queue table is typically analyzed, or vacuumed to nothing, just after it
// drained; when a burst then fills it, plans made for an empty table walk
// the whole table per claimed key or statement (see migrations 0003 and
// 0013). Cheap when there is nothing to do: it reads two rows of
// statistics.
func AnalyzeIfStale(ctx context.Context, pool *pgxpool.Pool, minRows int64) ([]string, error) {
	row, err := queries.QueueAnalyze(ctx, pool, queries.QueueAnalyzeParams{MinRows: minRows})
	if err != nil {
		return nil, fmt.Errorf("analyze queue tables with stale statistics: %w", err)
	}
	return row.Analyzed, nil
}

// SweepExpired clears leases that expired, returning how many. Claims do not
// depend on it; it keeps leased_by truthful for operators.
func SweepExpired(ctx context.Context, pool *pgxpool.Pool) (int64, error) {
	n, err := queries.LeaseSweep(ctx, pool)
	if err != nil {
		return 0, fmt.Errorf("sweep expired leases: %w", err)
	}
	return n, nil
}

// SweepThrottled repairs deferred_key.throttled flags that a race between an
// operator's change to target_control and a concurrent head write left
// stale, returning how many it changed (see dispatch_throttle_sweep.sql). It
// reads all of deferred_key: run it from periodic maintenance.
func SweepThrottled(ctx context.Context, pool *pgxpool.Pool) (int64, error) {
	row, err := queries.DispatchThrottleSweep(ctx, pool)
	if err != nil {
		return 0, fmt.Errorf("repair throttled flags of key heads: %w", err)
	}
	return row.Changed, nil
}
