package queries

import "context"

// TargetLimitedRow is a target with a rate limit that is not paused.
type TargetLimitedRow struct {
	Target string `db:"target_topic"`
}

func (r *TargetLimitedRow) dest() []any { return []any{&r.Target} }

// TargetLimited lists the rate-limited targets in name order
// (target_limited.sql).
func TargetLimited(ctx context.Context, db DBTX) ([]TargetLimitedRow, error) {
	return collect(ctx, db, targetLimitedSQL, NoParams{}.args(), (*TargetLimitedRow).dest)
}

// TargetPeekTokensParams are target_peek_tokens.sql's parameters.
type TargetPeekTokensParams struct {
	Targets []string // $1
}

func (p TargetPeekTokensParams) args() []any { return []any{p.Targets} }

// TargetPeekTokensRow is a limited target with due work, its rate and how
// many tokens its bucket holds now.
type TargetPeekTokensRow struct {
	Target    string  `db:"target_topic"`
	RateLimit float64 `db:"rate_limit"`
	Level     float64 `db:"level"`
}

func (r *TargetPeekTokensRow) dest() []any { return []any{&r.Target, &r.RateLimit, &r.Level} }

// TargetPeekTokens reads token buckets without writing them
// (target_peek_tokens.sql).
func TargetPeekTokens(ctx context.Context, db DBTX, p TargetPeekTokensParams) ([]TargetPeekTokensRow, error) {
	return collect(ctx, db, targetPeekTokensSQL, p.args(), (*TargetPeekTokensRow).dest)
}

// TargetTakeTokensParams are target_take_tokens.sql's parameters.
type TargetTakeTokensParams struct {
	Targets []string // $1
	Want    int      // $2: tokens to take at most from each
}

func (p TargetTakeTokensParams) args() []any { return []any{p.Targets, p.Want} }

// TargetTakeTokensRow is what one target's bucket gave.
type TargetTakeTokensRow struct {
	Target           string  `db:"target_topic"`
	Taken            int32   `db:"taken"`
	NextTokenSeconds float64 `db:"next_token_seconds"`
}

func (r *TargetTakeTokensRow) dest() []any { return []any{&r.Target, &r.Taken, &r.NextTokenSeconds} }

// TargetTakeTokens takes tokens (target_take_tokens.sql).
func TargetTakeTokens(ctx context.Context, db DBTX, p TargetTakeTokensParams) ([]TargetTakeTokensRow, error) {
	return collect(ctx, db, targetTakeTokensSQL, p.args(), (*TargetTakeTokensRow).dest)
}

// TargetReturnTokensParams are target_return_tokens.sql's parameters.
type TargetReturnTokensParams struct {
	Targets []string // $1
	Counts  []int32  // $2, one per target
}

func (p TargetReturnTokensParams) args() []any { return []any{p.Targets, p.Counts} }

// TargetReturnTokens gives unused tokens back (target_return_tokens.sql).
func TargetReturnTokens(ctx context.Context, db DBTX, p TargetReturnTokensParams) error {
	_, err := db.Exec(ctx, targetReturnTokensSQL, p.args()...)
	return err
}
