package keylock_test

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/deferq/scheduler/internal/keylock"
	"github.com/deferq/scheduler/internal/pgtest"
)

// session is one dedicated connection, for tests that interleave
// transactions by hand.
type session struct {
	*pgxpool.Conn
	pid uint32
	// async counts execAsync's statements still running: the connection
	// is closed only after them, since a test that failed before waiting
	// for one leaves it using the connection.
	async sync.WaitGroup
}

func newSession(t *testing.T, pool *pgxpool.Pool) *session {
	t.Helper()
	c, err := pool.Acquire(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	s := &session{Conn: c, pid: c.Conn().PgConn().PID()}
	t.Cleanup(func() {
		// t.Context() is done by now, so a statement still running on it
		// returns.
		s.async.Wait()
		// A session left in a transaction must not go back to the pool.
		c.Conn().Close(context.Background())
		c.Release()
	})
	return s
}

// execAsync runs sql on s in a goroutine and returns its result channel.
// ctx must end by the test's cleanup (t.Context() does).
func (s *session) execAsync(ctx context.Context, sql string) <-chan error {
	done := make(chan error, 1)
	s.async.Go(func() {
		_, err := s.Exec(ctx, sql)
		done <- err
	})
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
// the key rows it touches, so it could hold key b (from the delete) while
// asking for key a (from the park), against an ingest statement that locks
// a and then b. A lock held by an operator on a message lines them up. With
// a park, Finalize takes its locks first, messages before keys, and waits
// for the message holding no key; a round that published everything leaves
// those statements out (keylock's lockFree), and its delete meets the
// message before any key just the same. Either way ingest of the same keys
// goes through meanwhile.
func TestFinalizeLockOrderWithIngest(t *testing.T) {
	for _, tc := range []struct {
		name     string
		outcome  func(a, b int64) keylock.Outcome
		waitsIn  string // the statement Finalize waits in for the message
		lockFree bool
		heads    string // deferred_key afterwards; "" to check only that it matches the messages
	}{
		{"a park", func(a, b int64) keylock.Outcome {
			return keylock.Outcome{Published: []int64{b}, Parked: []keylock.Park{{ID: a, Reason: "refused"}}}
		}, "Finalize, step 1", false, ""},
		{"everything published", func(a, b int64) keylock.Outcome {
			return keylock.Outcome{Published: []int64{a, b}}
		}, "Finalize, step 4", true, "a@3 b@4"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			db := pgtest.NewDB(t)
			l, claims, ids := claimAB(t, db.Pool)
			out := tc.outcome(ids["a"], ids["b"])
			if got := keylock.LockFree(claims, out); got != tc.lockFree {
				t.Fatalf("LockFree = %v, want %v", got, tc.lockFree)
			}

			operator, ingest := newSession(t, db.Pool), newSession(t, db.Pool)
			_, _ = ingest.Exec(t.Context(), "SET deadlock_timeout = '100ms'") // needs superuser; 1s works too
			mustExec(t, operator, "BEGIN")
			mustExec(t, operator, "SELECT FROM deferred_message WHERE id = $1 FOR UPDATE", ids["a"])

			finalized := make(chan error, 1)
			go func() { finalized <- l.Finalize(t.Context(), claims, out) }()
			waitFinalizeBlocked(t, db.Pool, tc.waitsIn)
			ingested := ingest.execAsync(t.Context(), `INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at)
				VALUES ('a', 3, 't', now()), ('b', 4, 't', now())`)
			if err := wait(t, "ingest", ingested); err != nil {
				t.Fatalf("ingest while finalize waits for a message: %v", err)
			}
			mustExec(t, operator, "COMMIT")
			if err := wait(t, "finalize", finalized); err != nil {
				t.Fatalf("finalize: %v; want it to succeed once the operator commits", err)
			}
			assertHeadsMatch(t, db.Pool)
			if got := strings.Join(headSummary(t, db.Pool), " "); tc.heads != "" && got != tc.heads {
				t.Errorf("heads after the finalize = %q, want %q", got, tc.heads)
			}
		})
	}
}

// claimAB stores one message of key a and one of key b, claims both and
// returns the locker, the claims and the messages' ids by key.
func claimAB(t *testing.T, pool *pgxpool.Pool) (*keylock.Locker, []keylock.Claim, map[string]int64) {
	t.Helper()
	mustExec(t, pool, `INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at) VALUES
		('a', 1, 't', now()), ('b', 2, 't', now())`)
	l := newLocker(t, pool, "me", time.Minute, 10)
	claims, err := l.Claim(t.Context(), 10)
	if err != nil || len(claims) != 2 {
		t.Fatalf("claim: %q, %v", claimSummary(t, claims), err)
	}
	ids := map[string]int64{}
	for _, c := range claims {
		ids[c.BusinessKey] = c.Messages[0].ID
	}
	return l, claims, ids
}

// waitFinalizeBlocked waits until a statement of a finalize whose text
// contains marker waits for a lock.
func waitFinalizeBlocked(t *testing.T, pool *pgxpool.Pool, marker string) {
	t.Helper()
	eventually(t, 10*time.Second, "a finalize to wait for a lock in "+marker, func() bool {
		var n int
		if err := pool.QueryRow(t.Context(), `SELECT count(*) FROM pg_stat_activity
			WHERE query LIKE '%' || $1 || '%' AND wait_event_type = 'Lock'`, marker).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n > 0
	})
}

// TestFinalizeWithoutLockStatementsRecoversFromDeadlock: the case lockFree
// cannot see. An operator cancels the only message of claimed key a while
// it is published, so the finalize's delete locks only key b and its
// release locks a after it, out of key order. An ingest transaction holds a
// (a new message for it) and then asks for b: a deadlock, and Postgres
// aborts the finalize (it waited first, so its deadlock check runs first).
// Finalize must then run again with its lock statements and succeed once
// ingest commits, which takes b while the second attempt waits for a.
func TestFinalizeWithoutLockStatementsRecoversFromDeadlock(t *testing.T) {
	db := pgtest.NewDB(t)
	l, claims, ids := claimAB(t, db.Pool)
	out := keylock.Outcome{Published: []int64{ids["a"], ids["b"]}}
	if !keylock.LockFree(claims, out) {
		t.Fatal("a round that published every message finalizes with its lock statements; this test is about the path without them")
	}
	mustExec(t, db.Pool, "DELETE FROM deferred_message WHERE business_key = 'a'") // the operator's cancel
	deadlocks := func() int64 {
		var n int64
		if err := db.Pool.QueryRow(t.Context(), "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()").Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	before := deadlocks()

	// The finalize waits first, so it must be the one to find the
	// deadlock: Postgres checks once, deadlock_timeout after a wait
	// began, and the ingest statement must be waiting by then. 2s for the
	// finalize's new connections (needs superuser; the default 1s is
	// plenty on most machines), 30s for ingest.
	_, _ = db.Pool.Exec(t.Context(), "ALTER DATABASE "+pgx.Identifier{db.Name}.Sanitize()+" SET deadlock_timeout = '2s'")
	db.Pool.Reset()
	ingest := newSession(t, db.Pool)
	mustExec(t, ingest, "SET deadlock_timeout = '30s'")
	mustExec(t, ingest, "BEGIN")
	mustExec(t, ingest, `INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at) VALUES ('a', 3, 't', now())`)

	start := time.Now()
	finalized := make(chan error, 1)
	go func() { finalized <- l.Finalize(t.Context(), claims, out) }()
	waitFinalizeBlocked(t, db.Pool, "Finalize, ") // for key a
	if err := wait(t, "ingest of key b", ingest.execAsync(t.Context(),
		`INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at) VALUES ('b', 4, 't', now())`)); err != nil {
		t.Fatalf("ingest of key b: %v; want it to go through once the finalize gave b back", err)
	}
	mustExec(t, ingest, "COMMIT")
	if err := wait(t, "finalize", finalized); err != nil {
		t.Fatalf("finalize: %v; want it to run again with its lock statements and succeed", err)
	}
	// The aborted backend reports its deadlock when it next goes idle.
	eventually(t, 30*time.Second, "the deadlock to be counted", func() bool { return deadlocks() > before })
	t.Logf("finalize took %v, one deadlock included", time.Since(start).Round(time.Millisecond))
	assertHeadsMatch(t, db.Pool)
	if got, want := headSummary(t, db.Pool), []string{"a@3", "b@4"}; strings.Join(got, " ") != strings.Join(want, " ") {
		t.Errorf("heads after the finalize = %q, want %q", got, want)
	}
	for _, k := range []string{"a", "b"} {
		if got := leaseOf(t, db.Pool, k); !got.Found || got.By != nil {
			t.Errorf("key %s after the finalize: %v, want released", k, got)
		}
	}
}

// TestLockFree: which finalizes leave out their lock statements. Each case
// that keeps them names the statement that would otherwise lock a key out
// of key order.
func TestLockFree(t *testing.T) {
	msg := func(id int64, group string) keylock.Message { return keylock.Message{ID: id, Group: group} }
	a := keylock.Claim{BusinessKey: "a", Ordered: true, HeadID: 1, Messages: []keylock.Message{msg(1, ""), msg(2, "")}}
	b := keylock.Claim{BusinessKey: "b", Ordered: true, HeadID: 3, Messages: []keylock.Message{msg(3, "")}}
	grouped := keylock.Claim{BusinessKey: "g", Ordered: true, HeadID: 4, Messages: []keylock.Message{msg(4, "billing")}}
	unordered := keylock.Claim{HeadID: 5, Messages: []keylock.Message{msg(5, "")}}
	for _, tc := range []struct {
		name   string
		claims []keylock.Claim
		out    keylock.Outcome
		want   bool
	}{
		{"everything published", []keylock.Claim{a, b, unordered}, keylock.Outcome{Published: []int64{1, 2, 3, 5}}, true},
		{"a key's run published in part (a change of target)", []keylock.Claim{a, b}, keylock.Outcome{Published: []int64{1, 3}}, true},
		{"a claim with nothing published: the release would lock its key last", []keylock.Claim{a, b}, keylock.Outcome{Published: []int64{1, 2}}, false},
		{"a parked message: the park is a statement after the delete", []keylock.Claim{a, b}, keylock.Outcome{Published: []int64{1, 2}, Parked: []keylock.Park{{ID: 3, Reason: "too_large: x"}}}, false},
		{"a retriable failure", []keylock.Claim{a, b}, keylock.Outcome{Published: []int64{1, 2}, Retry: []keylock.Claim{b}}, false},
		{"a consumer group: the delete leases its key in flight before the trigger", []keylock.Claim{a, grouped}, keylock.Outcome{Published: []int64{1, 2, 4}}, false},
		{"nothing published", []keylock.Claim{a}, keylock.Outcome{}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := keylock.LockFree(tc.claims, tc.out); got != tc.want {
				t.Errorf("LockFree = %v, want %v", got, tc.want)
			}
		})
	}
}
