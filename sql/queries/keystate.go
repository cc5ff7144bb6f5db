package queries

import "context"

// KeyStateParams are key_state.sql's parameters.
type KeyStateParams struct {
	Group string   // $1: the consumer group asking
	Keys  []string // $2: the business keys asked about
}

func (p KeyStateParams) args() []any { return []any{p.Group, p.Keys} }

// KeyStateRow is one key's state for the group. Reason, HeadSeq and HeadID
// are nil when the key is free; HeadSeq and HeadID are nil too when it is
// blocked only by a republished record the group has not committed past
// (reason "in_flight"), since no message of the key waits any more.
type KeyStateRow struct {
	BusinessKey string  `db:"business_key"`
	Blocked     bool    `db:"blocked"`
	Reason      *string `db:"reason"`
	HeadSeq     *int64  `db:"head_seq"`
	HeadID      *int64  `db:"head_id"`
}

func (r *KeyStateRow) dest() []any {
	return []any{&r.BusinessKey, &r.Blocked, &r.Reason, &r.HeadSeq, &r.HeadID}
}

// KeyState reads the state of business keys for a consumer group
// (key_state.sql).
func KeyState(ctx context.Context, db DBTX, p KeyStateParams) ([]KeyStateRow, error) {
	return collect(ctx, db, keyStateSQL, p.args(), (*KeyStateRow).dest)
}
