package keylock

import (
	"context"
	"fmt"
	"time"

	"github.com/deferq/scheduler/sql/queries"
)

// Per-target rate limits (target_control.rate_limit, messages per second) are
// token buckets kept in target_control and shared by every dispatcher of
// every replica. Claim leaves limited targets alone; a dispatcher takes tokens
// for them (TakeTokens), claims at most that many of their heads, one message
// each (ClaimTarget), and gives back what it did not use (ReturnTokens).

// Grant is what TakeTokens got for one target that has due work.
type Grant struct {
	Target string
	// Taken is how many tokens were taken: how many messages of Target may be
	// claimed now. 0 when the bucket holds less than one.
	Taken int
	// NextToken is how long until the bucket holds a whole token again, after
	// this take; 0 if it still does. At most the longest Duration, however
	// slow the rate.
	NextToken time.Duration
}

// LimitedTargets returns the targets that have a rate limit and are not
// paused, in name order.
func (l *Locker) LimitedTargets(ctx context.Context) ([]string, error) {
	rows, err := queries.TargetLimited(ctx, l.pool)
	if err != nil {
		return nil, fmt.Errorf("read rate-limited targets: %w", err)
	}
	targets := make([]string, len(rows))
	for i, r := range rows {
		targets[i] = r.Target
	}
	return targets, nil
}

// TakeTokens takes up to want tokens from the bucket of each of targets that
// has a due head nobody holds, and returns a Grant for each of those (targets
// without due work, no longer limited, or paused are left out). Tokens not
// used must go back with ReturnTokens.
//
// It looks first and takes only from buckets holding a token or more: a
// bucket with less is not written (see target_peek_tokens.sql), which is
// the usual case of a target running at its limit.
func (l *Locker) TakeTokens(ctx context.Context, targets []string, want int) ([]Grant, error) {
	levels, err := queries.TargetPeekTokens(ctx, l.pool, queries.TargetPeekTokensParams{Targets: targets})
	if err != nil {
		return nil, fmt.Errorf("read rate-limit tokens of %d targets: %w", len(targets), err)
	}
	var grants []Grant
	var full []string
	for _, lv := range levels {
		if lv.Level >= 1 {
			full = append(full, lv.Target)
			continue
		}
		grants = append(grants, Grant{Target: lv.Target, NextToken: seconds((1 - lv.Level) / lv.RateLimit)})
	}
	if len(full) == 0 {
		return grants, nil
	}
	taken, err := queries.TargetTakeTokens(ctx, l.pool, queries.TargetTakeTokensParams{Targets: full, Want: want})
	if err != nil {
		return nil, fmt.Errorf("take rate-limit tokens of %d targets: %w", len(full), err)
	}
	for _, t := range taken {
		grants = append(grants, Grant{Target: t.Target, Taken: int(t.Taken), NextToken: seconds(t.NextTokenSeconds)})
	}
	return grants, nil
}

// ReturnTokens gives back unused tokens, n[target] to each target's bucket.
func (l *Locker) ReturnTokens(ctx context.Context, n map[string]int) error {
	targets := make([]string, 0, len(n))
	counts := make([]int32, 0, len(n))
	for t, c := range n {
		if c > 0 {
			targets, counts = append(targets, t), append(counts, int32(c))
		}
	}
	if len(targets) == 0 {
		return nil
	}
	if err := queries.TargetReturnTokens(ctx, l.pool, queries.TargetReturnTokensParams{Targets: targets, Counts: counts}); err != nil {
		return fmt.Errorf("give back rate-limit tokens of %d targets: %w", len(targets), err)
	}
	return nil
}
