package keylock_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/deferq/scheduler/internal/keylock"
	"github.com/deferq/scheduler/internal/pgtest"
)

// session is one dedicated connection, for tests that interleave
// transactions by hand.
type session struct {
	*pgxpool.Conn
	pid uint32
}

func newSession(t *testing.T, pool *pgxpool.Pool) *session {
	t.Helper()
	c, err := pool.Acquire(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// A session left in a transaction must not go back to the pool.
		c.Conn().Close(context.Background())
		c.Release()
	})
	return &session{Conn: c, pid: c.Conn().PgConn().PID()}
}

// execAsync runs sql on s in a goroutine and returns its result channel.
func (s *session) execAsync(ctx context.Context, sql string) <-chan error {
	done := make(chan error, 1)
	go func() {
		_, err := s.Exec(ctx, sql)
		done <- err
	}()
	return done
}

// waitBlocked polls until the session is waiting for a lock.
func waitBlocked(t *testing.T, pool *pgxpool.Pool, s *session, done <-chan error) {
	t.Helper()
	eventually(t, 10*time.Second, "a session to block on a lock", func() bool {
		select {
		case err := <-done:
			t.Fatalf("statement finished instead of blocking: %v", err)
		default:
		}
		var waiting bool
		if err := pool.QueryRow(t.Context(), `SELECT coalesce(wait_event_type = 'Lock', false) FROM pg_stat_activity WHERE pid = $1`,
			int32(s.pid)).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		return waiting
	})
}

func wait(t *testing.T, what string, done <-chan error) error {
	t.Helper()
	select {
	case err := <-done:
		return err
	case <-time.After(20 * time.Second):
		t.Fatalf("%s did not finish", what)
		return nil
	}
}

// TestRefreshWhileKeyRowDeleted: an operator replays a parked message of a
// key while the key's last pending message is cancelled (or published and
// finalized) by another transaction that deletes the key row. The replayed
// message must end up with a key row. A third session holding a weak lock on
// the key row (as any Claim, release or refresh briefly does) lines the two
// up deterministically: the cancel's refresh waits for the lock first, the
// replay's refresh queues behind it. The parked message does not hold its key
// (a holding one would keep the key row, which is then merely updated).
func TestRefreshWhileKeyRowDeleted(t *testing.T) {
	db := pgtest.NewDB(t)
	mustExec(t, db.Pool, `INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at) VALUES
		('k', 1, 't', now()), ('k', 2, 't', now())`)
	mustExec(t, db.Pool, `UPDATE deferred_message SET state = 'parked', park_holds_key = false WHERE seq = 2`)
	refreshRace(t, db.Pool, "FOR KEY SHARE")
	if got := headSummary(t, db.Pool); len(got) != 1 || got[0] != "k@2" {
		t.Errorf("heads = %q, want [k@2]", got)
	}
}

// TestRefreshHeldKeyRace is TestRefreshWhileKeyRowDeleted with a parked
// message that holds its key: cancelling the pending head makes the key held
// (the key row is updated, not deleted) while the operator replays the
// parked message, which must leave the key free with the replayed message
// as its head. FOR SHARE, which conflicts with the update, lines them up.
func TestRefreshHeldKeyRace(t *testing.T) {
	db := pgtest.NewDB(t)
	mustExec(t, db.Pool, `INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at) VALUES
		('k', 1, 't', now()), ('k', 2, 't', now())`)
	mustExec(t, db.Pool, `UPDATE deferred_message SET state = 'parked' WHERE seq = 2`)
	refreshRace(t, db.Pool, "FOR SHARE")
	if got := headSummary(t, db.Pool); len(got) != 1 || got[0] != "k@2" {
		t.Errorf("heads = %q, want [k@2] (replayed, not held)", got)
	}
}

// refreshRace cancels seq 1 and replays seq 2 of key k in two sessions that
// both wait, in that order, for a third holding lock on k's key row.
func refreshRace(t *testing.T, pool *pgxpool.Pool, lock string) {
	t.Helper()
	holder, canceller, replayer := newSession(t, pool), newSession(t, pool), newSession(t, pool)
	mustExec(t, holder, "BEGIN")
	mustExec(t, holder, "SELECT FROM deferred_key WHERE business_key = 'k' "+lock)

	cancelled := canceller.execAsync(t.Context(), "DELETE FROM deferred_message WHERE seq = 1")
	waitBlocked(t, pool, canceller, cancelled)
	replayed := replayer.execAsync(t.Context(), "UPDATE deferred_message SET state = 'pending' WHERE seq = 2")
	waitBlocked(t, pool, replayer, replayed)
	mustExec(t, holder, "COMMIT")

	if err := wait(t, "cancel", cancelled); err != nil {
		t.Fatalf("cancel: %v", err)
	}
	if err := wait(t, "replay", replayed); err != nil {
		t.Fatalf("replay: %v", err)
	}
	assertHeadsMatch(t, pool)
}

// TestRefreshLockOrderWithIngest: the triggers take key rows in key order
// so that an ingest and an operator statement touching the same keys queue
// instead of deadlocking. Here an ingest transaction holds key a and then
// inserts for key b, while an operator replays parked messages of a and of b
// (which has no key row yet: its parked message does not hold it).
func TestRefreshLockOrderWithIngest(t *testing.T) {
	db := pgtest.NewDB(t)
	mustExec(t, db.Pool, `INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at) VALUES
		('a', 10, 't', now()), ('a', 5, 't', now()), ('b', 20, 't', now())`)
	mustExec(t, db.Pool, `UPDATE deferred_message SET state = 'parked', park_holds_key = false WHERE seq IN (5, 20)`)

	ingest, operator := newSession(t, db.Pool), newSession(t, db.Pool)
	// Detect a deadlock quickly if there is one (needs superuser; the default 1s works too).
	_, _ = ingest.Exec(t.Context(), "SET deadlock_timeout = '100ms'")
	_, _ = operator.Exec(t.Context(), "SET deadlock_timeout = '100ms'")

	mustExec(t, ingest, "BEGIN")
	mustExec(t, ingest, `INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at) VALUES ('a', 30, 't', now())`)
	replayed := operator.execAsync(t.Context(), "UPDATE deferred_message SET state = 'pending' WHERE state = 'parked'")
	waitBlocked(t, db.Pool, operator, replayed)
	_, ingestErr := ingest.Exec(t.Context(), `INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at) VALUES ('b', 40, 't', now())`)
	if ingestErr == nil {
		_, ingestErr = ingest.Exec(t.Context(), "COMMIT")
	} else {
		_, _ = ingest.Exec(t.Context(), "ROLLBACK")
	}
	replayErr := wait(t, "replay", replayed)
	if ingestErr != nil || replayErr != nil {
		t.Errorf("ingest: %v; replay: %v; want both to succeed, one after the other", ingestErr, replayErr)
	}
	assertHeadsMatch(t, db.Pool)
}

// TestTruncate: TRUNCATE is plain SQL an operator may run to cancel
// everything. It fires no row or statement trigger for DELETE, so without a
// TRUNCATE trigger deferred_key keeps heads of messages that are gone; Claim
// then claims and releases those forever, ahead of real work.
func TestTruncate(t *testing.T) {
	db := pgtest.NewDB(t)
	mustExec(t, db.Pool, `INSERT INTO deferred_message (business_key, target_topic, next_run_at) VALUES
		('a', 't', now() - interval '1 hour'), (NULL, 't', now() - interval '1 hour')`)
	mustExec(t, db.Pool, "TRUNCATE deferred_message")
	assertHeadsMatch(t, db.Pool)

	mustExec(t, db.Pool, `INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at) VALUES ('new', 1, 't', now())`)
	claims, err := newLocker(t, db.Pool, "me", time.Minute, 10).Claim(t.Context(), 1)
	if err != nil {
		t.Fatal(err)
	}
	if got := claimSummary(t, claims); len(got) != 1 || got[0] != "new:1" {
		t.Errorf("Claim(1) after TRUNCATE = %q, want [new:1]", got)
	}
}

// TestFinalizeLockOrderWithIngest: Finalize runs up to three statements in
// one transaction (delete published, park refused, release), each locking
// the key rows it touches, so it can hold key b (from the delete) while
// asking for key a (from the park), against an ingest statement that locks
// a and then b. A lock held by an operator on the parked message lines them
// up: Finalize waits on it holding b, the ingest takes a and waits for b.
func TestFinalizeLockOrderWithIngest(t *testing.T) {
	db := pgtest.NewDB(t)
	mustExec(t, db.Pool, `INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at) VALUES
		('a', 1, 't', now()), ('b', 2, 't', now())`)
	l := newLocker(t, db.Pool, "me", time.Minute, 10)
	claims, err := l.Claim(t.Context(), 10)
	if err != nil || len(claims) != 2 {
		t.Fatalf("claim: %q, %v", claimSummary(t, claims), err)
	}
	ids := map[string]int64{}
	for _, c := range claims {
		ids[c.BusinessKey] = c.Messages[0].ID
	}

	operator, ingest := newSession(t, db.Pool), newSession(t, db.Pool)
	_, _ = ingest.Exec(t.Context(), "SET deadlock_timeout = '100ms'") // needs superuser; 1s works too
	mustExec(t, operator, "BEGIN")
	mustExec(t, operator, "SELECT FROM deferred_message WHERE id = $1 FOR UPDATE", ids["a"])

	finalized := make(chan error, 1)
	go func() {
		finalized <- l.Finalize(t.Context(), claims, keylock.Outcome{
			Published: []int64{ids["b"]},
			Parked:    []keylock.Park{{ID: ids["a"], Reason: "refused"}},
		})
	}()
	eventually(t, 10*time.Second, "Finalize to wait for the parked message", func() bool {
		var n int
		if err := db.Pool.QueryRow(t.Context(), `SELECT count(*) FROM pg_stat_activity
			WHERE query LIKE '%Finalize, step 1%' AND wait_event_type = 'Lock'`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n > 0
	})
	// Finalize locks messages before keys, so while it waits for a message
	// it holds no key: ingest of the same keys goes through meanwhile.
	ingested := ingest.execAsync(t.Context(), `INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at)
		VALUES ('a', 3, 't', now()), ('b', 4, 't', now())`)
	if err := wait(t, "ingest", ingested); err != nil {
		t.Fatalf("ingest while finalize waits for a message: %v", err)
	}
	mustExec(t, operator, "COMMIT")

	if err := wait(t, "finalize", finalized); err != nil {
		t.Errorf("finalize: %v; want it to succeed once the operator commits", err)
	}
	assertHeadsMatch(t, db.Pool)
}
