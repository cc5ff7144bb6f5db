package keylock_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/deferq/scheduler/internal/keylock"
	"github.com/deferq/scheduler/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// querier is a pool, a connection or a transaction.
type querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

func mustExec(t testing.TB, q querier, sql string, args ...any) pgconn.CommandTag {
	t.Helper()
	tag, err := q.Exec(t.Context(), sql, args...)
	if err != nil {
		t.Fatalf("%s: %v", oneLine(sql), err)
	}
	return tag
}

func oneLine(s string) string { return strings.Join(strings.Fields(s), " ") }

func newLocker(t testing.TB, pool *pgxpool.Pool, owner string, lease time.Duration, perKey int) *keylock.Locker {
	t.Helper()
	return newLockerBackoff(t, pool, owner, lease, perKey, 0)
}

// newLockerBackoff is newLocker with the first back-off of a failing key.
func newLockerBackoff(t testing.TB, pool *pgxpool.Pool, owner string, lease time.Duration, perKey int, backoff time.Duration) *keylock.Locker {
	t.Helper()
	l, err := keylock.New(pool, keylock.Config{Owner: owner, Lease: lease, PerKey: perKey, BackoffBase: backoff})
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// headsDiffSQL compares deferred_key with a brute-force recomputation of the
// heads from deferred_message (docs/design.md section 4.1, migration 0002): per
// business key, the message with the lowest (seq, id) among those pending or
// parked with park_holds_key; if that message is parked the key is held
// (held = true, next_run_at 'infinity'); a key without such a message has
// no row, unless a dispatcher leased it before its last message went (an
// emptied row, see deferred_key_refresh.sql). Every pending unordered
// message is a head of its own; unordered parked messages hold nothing. A head that is not
// held is throttled when target_control pauses or rate-limits its target.
// Each returned row is one difference; none means they agree exactly,
// duplicates included.
const headsDiffSQL = `
WITH throttling AS (
    SELECT target_topic FROM target_control WHERE paused OR rate_limit IS NOT NULL
), expected AS (
    (SELECT DISTINCT ON (business_key) business_key, id AS head_id, seq AS head_seq,
            CASE WHEN state = 'parked' THEN 'infinity' ELSE next_run_at END AS next_run_at,
            target_topic AS head_target, state = 'parked' AS held,
            state = 'pending' AND target_topic IN (SELECT target_topic FROM throttling) AS throttled
     FROM deferred_message
     WHERE (state = 'pending' OR (state = 'parked' AND park_holds_key)) AND business_key IS NOT NULL
     ORDER BY business_key, seq, id)
    UNION ALL
    SELECT business_key, id, seq, next_run_at, target_topic, false,
           target_topic IN (SELECT target_topic FROM throttling)
    FROM deferred_message
    WHERE state = 'pending' AND business_key IS NULL
    UNION ALL
    -- An emptied key: its last message went while a dispatcher held its
    -- lease, which the row keeps until the holder releases it.
    SELECT k.business_key, 0, 9223372036854775807, 'infinity', NULL, false, false
    FROM deferred_key k
    WHERE k.head_id = 0 AND k.leased_by IS NOT NULL AND k.business_key IS NOT NULL
      AND NOT EXISTS (SELECT FROM deferred_message m
                      WHERE m.business_key = k.business_key
                        AND (m.state = 'pending' OR (m.state = 'parked' AND m.park_holds_key)))
), actual AS (
    SELECT business_key, head_id, head_seq, next_run_at, head_target, held, throttled FROM deferred_key
), diff AS (
    SELECT 'missing from deferred_key' AS kind, * FROM (SELECT * FROM expected EXCEPT ALL SELECT * FROM actual) e
    UNION ALL
    SELECT 'unexpected in deferred_key', * FROM (SELECT * FROM actual EXCEPT ALL SELECT * FROM expected) a
)
SELECT format('%s: key=%s head_id=%s head_seq=%s next_run_at=%s head_target=%s held=%s throttled=%s', kind,
              coalesce(quote_literal(business_key), 'NULL'), head_id, head_seq, next_run_at, head_target, held, throttled)
FROM diff
ORDER BY business_key, head_id, kind`

func headsDiff(ctx context.Context, q querier) ([]string, error) {
	rows, err := q.Query(ctx, headsDiffSQL)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// assertHeadsMatch fails the test if deferred_key differs from the heads
// recomputed from deferred_message.
func assertHeadsMatch(t testing.TB, q querier) {
	t.Helper()
	diff, err := headsDiff(t.Context(), q)
	if err != nil {
		t.Fatalf("compare heads: %v", err)
	}
	if len(diff) > 0 {
		t.Errorf("deferred_key differs from the heads recomputed from deferred_message:\n  %s\ndeferred_message:\n%s",
			strings.Join(diff, "\n  "), dumpMessages(t, q))
	}
}

func dumpMessages(t testing.TB, q querier) string {
	t.Helper()
	rows, err := q.Query(t.Context(), `SELECT format('  id=%s key=%s seq=%s state=%s holds=%s next_run_at=%s', id,
		coalesce(quote_literal(business_key), 'NULL'), seq, state, park_holds_key, next_run_at)
		FROM deferred_message ORDER BY business_key, seq, id LIMIT 50`)
	if err != nil {
		return err.Error()
	}
	lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return err.Error()
	}
	return strings.Join(lines, "\n")
}

// headSummary lists deferred_key as "key@head_seq" (unordered heads as
// "-@head_seq"; a key held by a parked message as "key@head_seq!"), sorted: a
// compact, exact statement of which messages are heads when tests give each
// message a distinct seq.
func headSummary(t testing.TB, q querier) []string {
	t.Helper()
	rows, err := q.Query(t.Context(),
		`SELECT coalesce(business_key, '-') || '@' || head_seq || CASE WHEN held THEN '!' ELSE '' END FROM deferred_key`)
	if err != nil {
		t.Fatal(err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(out)
	return out
}

// claimSummary lists claims as "key:seq,seq" (unordered as "-:seq"), sorted,
// and checks the structural promises every claim makes.
func claimSummary(t testing.TB, claims []keylock.Claim) []string {
	t.Helper()
	var out []string
	for _, c := range claims {
		if len(c.Messages) == 0 {
			t.Errorf("claim of key %q (head %d) has no messages; empty claims must be released, not returned", c.BusinessKey, c.HeadID)
			continue
		}
		if c.Messages[0].ID != c.HeadID {
			t.Errorf("claim of key %q: first message %d is not the head %d", c.BusinessKey, c.Messages[0].ID, c.HeadID)
		}
		if !c.Ordered && len(c.Messages) != 1 {
			t.Errorf("unordered claim (head %d) has %d messages, want 1", c.HeadID, len(c.Messages))
		}
		name := "-"
		if c.Ordered {
			name = c.BusinessKey
		}
		seqs := make([]string, len(c.Messages))
		for i, m := range c.Messages {
			seqs[i] = fmt.Sprint(m.Seq)
		}
		out = append(out, name+":"+strings.Join(seqs, ","))
	}
	slices.Sort(out)
	return out
}

// leaseRow is the lease on one business key's row of deferred_key.
type leaseRow struct {
	By    *string
	Until *time.Time // nil for none, and for 'infinity' (Forever)
	// Forever: leased until 'infinity', as a key in flight is.
	Forever bool
	Found   bool
}

func leaseOf(t testing.TB, q querier, key string) leaseRow {
	t.Helper()
	var l leaseRow
	err := q.QueryRow(t.Context(), `SELECT leased_by, CASE WHEN leased_until < 'infinity' THEN leased_until END,
		coalesce(leased_until = 'infinity', false) FROM deferred_key WHERE business_key = $1`, key).
		Scan(&l.By, &l.Until, &l.Forever)
	if errors.Is(err, pgx.ErrNoRows) {
		return l
	}
	if err != nil {
		t.Fatal(err)
	}
	l.Found = true
	return l
}

func (l leaseRow) String() string {
	if !l.Found {
		return "no key row"
	}
	by, until := "NULL", "NULL"
	if l.By != nil {
		by = *l.By
	}
	if l.Until != nil {
		until = l.Until.Format(time.RFC3339Nano)
	}
	if l.Forever {
		until = "infinity"
	}
	return "leased_by=" + by + " leased_until=" + until
}

func dbNow(t testing.TB, q querier) time.Time {
	t.Helper()
	var now time.Time
	if err := q.QueryRow(t.Context(), "SELECT clock_timestamp()").Scan(&now); err != nil {
		t.Fatal(err)
	}
	return now
}

// eventually calls f until it returns true or the timeout passes.
func eventually(t testing.TB, timeout time.Duration, what string, f func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !f() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
