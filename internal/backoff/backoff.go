// Package backoff computes retry delays and waits for them.
package backoff

import (
	"context"
	"time"
)

// Exp returns base doubled for each failure after the first, at most limit:
// base, 2·base, 4·base, ... for failures 1, 2, 3, ...
func Exp(failures int, base, limit time.Duration) time.Duration {
	d := base
	for i := 1; i < failures && d < limit; i++ {
		d *= 2
	}
	return min(d, limit)
}

// Sleep waits for d or until ctx is done, and reports whether the full d
// passed.
func Sleep(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
