package queries

import (
	"context"
	"errors"
	"time"

	"github.com/jackc/pgx/v5"
)

// ClaimParams are the parameters both claim statements share, $1 to $5.
type ClaimParams struct {
	MaxKeys  int           // $1: keys to lease at most
	Lease    time.Duration // $2: how long the lease holds
	PerKey   int           // $3: messages read per key at most
	Owner    string        // $4: leased_by
	MaxBytes int64         // $5: the claim's byte budget, at least 1
}

func (p ClaimParams) args() []any {
	return []any{p.MaxKeys, p.Lease, p.PerKey, p.Owner, p.MaxBytes}
}

// DispatchClaimParams are dispatch_claim.sql's parameters.
type DispatchClaimParams struct {
	ClaimParams     // $1..$5
	Share       int // $6: due heads read per target and unit of its weight at most, at most MaxKeys
}

func (p DispatchClaimParams) args() []any {
	return append(p.ClaimParams.args(), p.Share)
}

// DispatchClaimTargetParams are dispatch_claim_target.sql's: the main
// claim's first five, for the heads of one rate-limited target.
type DispatchClaimTargetParams struct {
	ClaimParams        // $1..$5
	Target      string // $6
}

func (p DispatchClaimTargetParams) args() []any {
	return append(p.ClaimParams.args(), p.Target)
}

// DispatchClaimExpressParams are dispatch_claim_express.sql's: the main
// claim's first five, for the due heads of light targets.
type DispatchClaimExpressParams struct {
	ClaimParams          // $1..$5
	Targets     []string // $6: the light targets
	PerTarget   int      // $7: due heads read per target at most
}

func (p DispatchClaimExpressParams) args() []any {
	return append(p.ClaimParams.args(), p.Targets, p.PerTarget)
}

// DispatchExpressTargetsParams are dispatch_express_targets.sql's.
type DispatchExpressTargetsParams struct {
	Light int // $1: a target with at most this many due heads is light
}

func (p DispatchExpressTargetsParams) args() []any { return []any{p.Light} }

// DispatchExpressTargetsRow is one light target.
type DispatchExpressTargetsRow struct {
	Target string `db:"target"`
}

func (r *DispatchExpressTargetsRow) dest() []any { return []any{&r.Target} }

// DispatchExpressTargets returns the light targets beside a backlog
// (dispatch_express_targets.sql).
func DispatchExpressTargets(ctx context.Context, db DBTX, p DispatchExpressTargetsParams) ([]DispatchExpressTargetsRow, error) {
	return collect(ctx, db, dispatchExpressTargetsSQL, p.args(), (*DispatchExpressTargetsRow).dest)
}

// DispatchClaimRow is one message a claim read, or, with ID nil, a leased
// key for which none came back (to be released).
type DispatchClaimRow struct {
	BusinessKey  *string    `db:"business_key"` // nil: an unordered head
	HeadID       int64      `db:"head_id"`
	ClaimedAt    time.Time  `db:"claimed_at"` // the claim statement's now()
	ID           *int64     `db:"id"`
	Seq          *int64     `db:"seq"`
	Target       *string    `db:"target_topic"`
	NextRunAt    *time.Time `db:"next_run_at"`
	Attempt      *int32     `db:"attempt"`
	RedriveCount *int32     `db:"redrive_count"`
	Key          []byte     `db:"key"`
	Value        []byte     `db:"value"`
	HeaderKeys   []string   `db:"header_keys"`
	HeaderValues [][]byte   `db:"header_values"`
	Group        *string    `db:"group_id"`
	TargetWeight int32      `db:"target_weight"` // the target's target_control.weight; 1 without one
}

func (r *DispatchClaimRow) dest() []any {
	return []any{&r.BusinessKey, &r.HeadID, &r.ClaimedAt, &r.ID, &r.Seq, &r.Target, &r.NextRunAt, &r.Attempt, &r.RedriveCount,
		&r.Key, &r.Value, &r.HeaderKeys, &r.HeaderValues, &r.Group, &r.TargetWeight}
}

// DispatchClaim leases due heads and reads their runs (dispatch_claim.sql).
func DispatchClaim(ctx context.Context, db DBTX, p DispatchClaimParams) ([]DispatchClaimRow, error) {
	return collect(ctx, db, dispatchClaimSQL, p.args(), (*DispatchClaimRow).dest)
}

// DispatchClaimTarget leases due heads of one rate-limited target
// (dispatch_claim_target.sql).
func DispatchClaimTarget(ctx context.Context, db DBTX, p DispatchClaimTargetParams) ([]DispatchClaimRow, error) {
	return collect(ctx, db, dispatchClaimTargetSQL, p.args(), (*DispatchClaimRow).dest)
}

// DispatchClaimExpress leases the due heads of light targets
// (dispatch_claim_express.sql).
func DispatchClaimExpress(ctx context.Context, db DBTX, p DispatchClaimExpressParams) ([]DispatchClaimRow, error) {
	return collect(ctx, db, dispatchClaimExpressSQL, p.args(), (*DispatchClaimRow).dest)
}

// The finalize statements run in one pipelined implicit transaction (one
// round trip): each has a Queue function that adds it to a *pgx.Batch, and
// a function that runs it alone (tests run them in a transaction of their
// own).

// DispatchLockMessagesParams are dispatch_lock_messages.sql's parameters.
type DispatchLockMessagesParams struct {
	IDs []int64 // $1: the messages finalize changes
}

func (p DispatchLockMessagesParams) args() []any { return []any{p.IDs} }

// QueueDispatchLockMessages adds dispatch_lock_messages.sql to b.
func QueueDispatchLockMessages(b *pgx.Batch, p DispatchLockMessagesParams) {
	b.Queue(dispatchLockMessagesSQL, p.args()...)
}

// DispatchLockMessages runs dispatch_lock_messages.sql.
func DispatchLockMessages(ctx context.Context, db DBTX, p DispatchLockMessagesParams) error {
	_, err := db.Exec(ctx, dispatchLockMessagesSQL, p.args()...)
	return err
}

// DispatchLockKeysParams are dispatch_lock_keys.sql's parameters.
type DispatchLockKeysParams struct {
	Keys []string // $1: the business keys finalize releases
}

func (p DispatchLockKeysParams) args() []any { return []any{p.Keys} }

// QueueDispatchLockKeys adds dispatch_lock_keys.sql to b.
func QueueDispatchLockKeys(b *pgx.Batch, p DispatchLockKeysParams) {
	b.Queue(dispatchLockKeysSQL, p.args()...)
}

// DispatchLockKeys runs dispatch_lock_keys.sql.
func DispatchLockKeys(ctx context.Context, db DBTX, p DispatchLockKeysParams) error {
	_, err := db.Exec(ctx, dispatchLockKeysSQL, p.args()...)
	return err
}

// DispatchDeleteParams are dispatch_delete.sql's parameters.
type DispatchDeleteParams struct {
	IDs []int64 // $1: the messages the broker acknowledged
	// Where each went in its target, one per id; nil when unknown (no
	// in-flight row is recorded then).
	Partitions []int32 // $2
	Offsets    []int64 // $3
	// ClaimedAt is, one per id, when the claim that read it ran (its
	// claimed_at): the 'published' event is recorded at it. Nil: the
	// finalize's now().
	ClaimedAt []time.Time // $4
}

func (p DispatchDeleteParams) args() []any {
	return []any{p.IDs, p.Partitions, p.Offsets, p.ClaimedAt}
}

// QueueDispatchDelete adds dispatch_delete.sql to b.
func QueueDispatchDelete(b *pgx.Batch, p DispatchDeleteParams) {
	b.Queue(dispatchDeleteSQL, p.args()...)
}

// DispatchDelete runs dispatch_delete.sql.
func DispatchDelete(ctx context.Context, db DBTX, p DispatchDeleteParams) error {
	_, err := db.Exec(ctx, dispatchDeleteSQL, p.args()...)
	return err
}

// DispatchFinalizingParams are dispatch_finalizing.sql's parameters.
type DispatchFinalizingParams struct {
	Owner string // $1: the lease holder finalizing in this transaction
}

func (p DispatchFinalizingParams) args() []any { return []any{p.Owner} }

// QueueDispatchFinalizing adds dispatch_finalizing.sql to b.
func QueueDispatchFinalizing(b *pgx.Batch, p DispatchFinalizingParams) {
	b.Queue(dispatchFinalizingSQL, p.args()...)
}

// DispatchFinalizing runs dispatch_finalizing.sql.
func DispatchFinalizing(ctx context.Context, db DBTX, p DispatchFinalizingParams) error {
	_, err := db.Exec(ctx, dispatchFinalizingSQL, p.args()...)
	return err
}

// DispatchReleaseEmptyParams are dispatch_release_empty.sql's parameters.
type DispatchReleaseEmptyParams struct {
	Keys  []string // $1: the business keys finalize releases
	Owner string   // $2: only rows this owner leases
}

func (p DispatchReleaseEmptyParams) args() []any { return []any{p.Keys, p.Owner} }

// QueueDispatchReleaseEmpty adds dispatch_release_empty.sql to b.
func QueueDispatchReleaseEmpty(b *pgx.Batch, p DispatchReleaseEmptyParams) {
	b.Queue(dispatchReleaseEmptySQL, p.args()...)
}

// DispatchReleaseEmpty runs dispatch_release_empty.sql.
func DispatchReleaseEmpty(ctx context.Context, db DBTX, p DispatchReleaseEmptyParams) error {
	_, err := db.Exec(ctx, dispatchReleaseEmptySQL, p.args()...)
	return err
}

// DispatchParkParams are dispatch_park.sql's parameters.
type DispatchParkParams struct {
	IDs     []int64  // $1
	Reasons []string // $2, one per id
}

func (p DispatchParkParams) args() []any { return []any{p.IDs, p.Reasons} }

// QueueDispatchPark adds dispatch_park.sql to b.
func QueueDispatchPark(b *pgx.Batch, p DispatchParkParams) { b.Queue(dispatchParkSQL, p.args()...) }

// DispatchPark runs dispatch_park.sql.
func DispatchPark(ctx context.Context, db DBTX, p DispatchParkParams) error {
	_, err := db.Exec(ctx, dispatchParkSQL, p.args()...)
	return err
}

// DispatchReleaseParams are dispatch_release.sql's parameters.
type DispatchReleaseParams struct {
	Keys        []string      // $1: business keys to release
	Owner       string        // $2: only leases this owner holds
	RetryKeys   []string      // $3: keys that back off instead
	BackoffBase time.Duration // $4
	BackoffMax  time.Duration // $5
}

func (p DispatchReleaseParams) args() []any {
	return []any{p.Keys, p.Owner, p.RetryKeys, p.BackoffBase, p.BackoffMax}
}

// QueueDispatchRelease adds dispatch_release.sql to b.
func QueueDispatchRelease(b *pgx.Batch, p DispatchReleaseParams) {
	b.Queue(dispatchReleaseSQL, p.args()...)
}

// DispatchRelease runs dispatch_release.sql.
func DispatchRelease(ctx context.Context, db DBTX, p DispatchReleaseParams) error {
	_, err := db.Exec(ctx, dispatchReleaseSQL, p.args()...)
	return err
}

// DispatchReleaseUnorderedParams are dispatch_release_unordered.sql's
// parameters.
type DispatchReleaseUnorderedParams struct {
	Heads       []int64       // $1: unordered heads to release
	Owner       string        // $2: only leases this owner holds
	RetryHeads  []int64       // $3: heads that back off instead
	BackoffBase time.Duration // $4
	BackoffMax  time.Duration // $5
}

func (p DispatchReleaseUnorderedParams) args() []any {
	return []any{p.Heads, p.Owner, p.RetryHeads, p.BackoffBase, p.BackoffMax}
}

// QueueDispatchReleaseUnordered adds dispatch_release_unordered.sql to b.
func QueueDispatchReleaseUnordered(b *pgx.Batch, p DispatchReleaseUnorderedParams) {
	b.Queue(dispatchReleaseUnorderedSQL, p.args()...)
}

// DispatchReleaseUnordered runs dispatch_release_unordered.sql.
func DispatchReleaseUnordered(ctx context.Context, db DBTX, p DispatchReleaseUnorderedParams) error {
	_, err := db.Exec(ctx, dispatchReleaseUnorderedSQL, p.args()...)
	return err
}

// DispatchNextDueRow is how many seconds until the earliest head nobody
// holds is due (0 if due now).
type DispatchNextDueRow struct {
	Seconds float64 `db:"seconds"`
}

func (r *DispatchNextDueRow) dest() []any { return []any{&r.Seconds} }

// DispatchNextDue reads the next due time (dispatch_next_due.sql); found is
// false when no head is waiting.
func DispatchNextDue(ctx context.Context, db DBTX) (row DispatchNextDueRow, found bool, err error) {
	row, err = one(ctx, db, dispatchNextDueSQL, NoParams{}.args(), (*DispatchNextDueRow).dest)
	if errors.Is(err, pgx.ErrNoRows) {
		return row, false, nil
	}
	return row, err == nil, err
}

// DispatchThrottleSweepRow counts the throttled flags the sweep changed.
type DispatchThrottleSweepRow struct {
	Changed int64 `db:"changed"`
}

func (r *DispatchThrottleSweepRow) dest() []any { return []any{&r.Changed} }

// DispatchThrottleSweep repairs throttled flags (dispatch_throttle_sweep.sql).
func DispatchThrottleSweep(ctx context.Context, db DBTX) (DispatchThrottleSweepRow, error) {
	return one(ctx, db, dispatchThrottleSweepSQL, NoParams{}.args(), (*DispatchThrottleSweepRow).dest)
}

// LeaseSweep clears expired leases (lease_sweep.sql) and returns how many.
func LeaseSweep(ctx context.Context, db DBTX) (int64, error) {
	tag, err := db.Exec(ctx, leaseSweepSQL)
	return tag.RowsAffected(), err
}

// QueueAnalyzeParams are queue_analyze.sql's parameters.
type QueueAnalyzeParams struct {
	MinRows int64 // $1: tables smaller than this are left alone
}

func (p QueueAnalyzeParams) args() []any { return []any{p.MinRows} }

// QueueAnalyzeRow names the tables analyzed.
type QueueAnalyzeRow struct {
	Analyzed []string `db:"analyzed"`
}

func (r *QueueAnalyzeRow) dest() []any { return []any{&r.Analyzed} }

// QueueAnalyze analyzes queue tables with stale statistics
// (queue_analyze.sql).
func QueueAnalyze(ctx context.Context, db DBTX, p QueueAnalyzeParams) (QueueAnalyzeRow, error) {
	return one(ctx, db, queueAnalyzeSQL, p.args(), (*QueueAnalyzeRow).dest)
}
