package queries

import (
	"context"
	"time"
)

// KeySetParams are key_set.sql's parameters.
type KeySetParams struct {
	Group string // $1: the consumer group
	After string // $2: the page starts after this key; "" for the first
	Limit int    // $3: keys per page at most
}

func (p KeySetParams) args() []any { return []any{p.Group, p.After, p.Limit} }

// KeySetRow is one blocked key of the page, or, with BusinessKey nil, the
// row that only carries the cursor of a page with no keys. Reason, HeadSeq
// and HeadID are as in KeyStateRow.
type KeySetRow struct {
	Cursor      int64   `db:"cursor"`
	BusinessKey *string `db:"business_key"`
	Blocked     *bool   `db:"blocked"`
	Reason      *string `db:"reason"`
	HeadSeq     *int64  `db:"head_seq"`
	HeadID      *int64  `db:"head_id"`
}

func (r *KeySetRow) dest() []any {
	return []any{&r.Cursor, &r.BusinessKey, &r.Blocked, &r.Reason, &r.HeadSeq, &r.HeadID}
}

// KeySet reads one page of a consumer group's blocked keys (key_set.sql).
func KeySet(ctx context.Context, db DBTX, p KeySetParams) ([]KeySetRow, error) {
	return collect(ctx, db, keySetSQL, p.args(), (*KeySetRow).dest)
}

// KeyChangesParams are key_changes.sql's parameters.
type KeyChangesParams struct {
	Group  string   // $1: the consumer group
	Cursor int64    // $2: the feed position the caller has read up to
	Keys   []string // $3: keys whose state to give as well
	Topic  string   // $4: the defer topic, for the ingest positions
	Limit  int      // $5: more changed keys than this: reset
	// $6, $7: with Keys, the partition and offset of each key's deferral
	// (nil: answer every key of Keys).
	Partitions []int32
	Offsets    []int64
}

func (p KeyChangesParams) args() []any {
	return []any{p.Group, p.Cursor, p.Keys, p.Topic, p.Limit, p.Partitions, p.Offsets}
}

// KeyChangesRow is one changed or asked-about key's state now, each with
// the statement's cursor, reset and ingest positions; with BusinessKey nil,
// the row that only carries those.
type KeyChangesRow struct {
	Cursor           int64   `db:"cursor"`
	Reset            bool    `db:"reset"`
	StoredPartitions []int32 `db:"stored_partitions"`
	StoredOffsets    []int64 `db:"stored_offsets"`
	BehindMillis     int64   `db:"behind_ms"`
	BusinessKey      *string `db:"business_key"`
	Blocked          *bool   `db:"blocked"`
	Reason           *string `db:"reason"`
	HeadSeq          *int64  `db:"head_seq"`
	HeadID           *int64  `db:"head_id"`
}

func (r *KeyChangesRow) dest() []any {
	return []any{&r.Cursor, &r.Reset, &r.StoredPartitions, &r.StoredOffsets, &r.BehindMillis,
		&r.BusinessKey, &r.Blocked, &r.Reason, &r.HeadSeq, &r.HeadID}
}

// KeyChanges reads what changed in a consumer group's blocked keys since a
// cursor (key_changes.sql).
func KeyChanges(ctx context.Context, db DBTX, p KeyChangesParams) ([]KeyChangesRow, error) {
	return collect(ctx, db, keyChangesSQL, p.args(), (*KeyChangesRow).dest)
}

// KeyChangePruneParams are key_change_prune.sql's parameters.
type KeyChangePruneParams struct {
	Retention time.Duration // $1
	Batch     int           // $2: rows per statement at most
}

func (p KeyChangePruneParams) args() []any { return []any{p.Retention, p.Batch} }

// KeyChangePruneRow counts the feed rows pruned.
type KeyChangePruneRow struct {
	Pruned int64 `db:"pruned"`
}

func (r *KeyChangePruneRow) dest() []any { return []any{&r.Pruned} }

// KeyChangePrune deletes feed rows past their retention, a batch at a
// time (key_change_prune.sql).
func KeyChangePrune(ctx context.Context, db DBTX, p KeyChangePruneParams) (KeyChangePruneRow, error) {
	return one(ctx, db, keyChangePruneSQL, p.args(), (*KeyChangePruneRow).dest)
}
