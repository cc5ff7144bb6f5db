package keylock_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/deferq/scheduler/internal/keylock"
	"github.com/deferq/scheduler/internal/pgtest"
)

// bigPool returns a pool on db with room for every goroutine of a test, so
// they contend in Postgres rather than for pool connections.
func bigPool(t *testing.T, url string, conns int32) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = conns
	pool, err := pgxpool.NewWithConfig(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// retryDeadlock runs f until it does not fail with a deadlock, counting the
// deadlocks.
func retryDeadlock(count *atomic.Int64, f func() error) error {
	for {
		err := f()
		if !keylock.IsDeadlock(err) {
			return err
		}
		count.Add(1)
	}
}

// hold is one claim of one key, from Claim's return to Finalize's call: an
// interval during which the holder certainly held the key.
type hold struct {
	locker   string
	key      string // "k:<business key>" or "u:<head id>"
	ids      []int64
	retried  bool // finalized as a retriable failure: its messages stay pending
	claimEnd time.Time
	finStart time.Time
	finEnd   time.Time
}

func holdKey(c keylock.Claim) string {
	if c.Ordered {
		return "k:" + c.BusinessKey
	}
	return fmt.Sprintf("u:%d", c.HeadID)
}

// TestConcurrentInvariants runs ingest-style inserts, several Lockers
// claiming and finalizing (parking some messages, which then hold their
// keys), and operator SQL (expedite, delay, park with and without holding the
// key, hold or release a parked message's key, replay, cancel, re-key,
// re-seq) against the same few keys at once, and checks:
//   - at every committed snapshot (sampled) and at the end, deferred_key is
//     exactly the brute-force recomputation of the heads;
//   - no two claims ever held the same key at the same time (leases are long,
//     so none expires during the run);
//   - no message came out of two claims unless the first left it pending (a
//     retriable failure) or an operator replayed it in between: a published
//     message is never handed out again;
//   - every claim was released, and what is pending can be drained.
func TestConcurrentInvariants(t *testing.T) {
	runFor := 3 * time.Second
	if d, err := time.ParseDuration(os.Getenv("KEYLOCK_STRESS")); err == nil {
		runFor = d
	}
	db := pgtest.NewDB(t)
	// Deadlocks are expected now and then (see the counts logged); detect
	// them fast so that the run is not mostly waiting for the default 1s.
	// Setting it needs superuser; without it the test is just slower.
	_, _ = db.Pool.Exec(t.Context(), "ALTER DATABASE "+pgx.Identifier{db.Name}.Sanitize()+" SET deadlock_timeout = '50ms'")
	pool := bigPool(t, db.URL, 24)
	// Explicit seqs below this become heads ahead of fresh ones.
	mustExec(t, pool, "SELECT setval('deferred_message_seq', 1000000)")

	keys := []string{"k0", "k1", "k2", "k3", "k4", "k5"}
	tctx := t.Context() // statements always run to the end
	run, stop := context.WithTimeout(tctx, runFor)
	defer stop()

	var (
		wg sync.WaitGroup
		mu sync.Mutex // guards holds, replayed, disturbed

		holds    []hold
		replayed = map[int64]bool{}
		// Messages an operator parked, cancelled or moved to another key.
		// Moved: a holder of the new key may claim one while the holder of
		// the old key still has it in its claim, so both publish it. Any of
		// the three can remove a held key's last pending message, and with
		// it the key row and its lease; an insert then makes a new, free
		// row that a second holder may claim while the first still
		// publishes. Both are the operator's doing, so they are counted,
		// not failed.
		disturbed = map[int64]bool{}

		inserted, claimsN, published, opStmts atomic.Int64
		insertDeadlocks, finalizeDeadlocks    atomic.Int64
		claimDeadlocks                        atomic.Int64
		opDeadlocks, snapshotChecks           atomic.Int64
		snapshotFailures                      atomic.Int64
		// Snapshots in which some key was held by a parked message.
		heldSnapshots atomic.Int64
	)
	failed := func(format string, args ...any) {
		t.Errorf(format, args...)
		stop()
	}

	// (a) Ingest: batches of 1-4 messages, some unordered, some with an
	// explicit low seq (a re-deferral), due from a little ago to a little
	// later, a few parked at once (a retry policy said exhausted), holding
	// their key or not.
	for w := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 1))
			for run.Err() == nil {
				n := 1 + rng.IntN(4)
				bk := make([]*string, n)
				seqs := make([]*int64, n)
				offs := make([]int32, n)
				parked := make([]bool, n)
				holds := make([]bool, n)
				for i := range n {
					parked[i] = rng.IntN(10) == 0
					holds[i] = rng.IntN(2) == 0
					if rng.IntN(7) > 0 {
						bk[i] = &keys[rng.IntN(len(keys))]
					}
					if rng.IntN(5) == 0 {
						s := 1 + rng.Int64N(999_999)
						seqs[i] = &s
					}
					offs[i] = int32(rng.IntN(250) - 100)
				}
				var added int64
				err := retryDeadlock(&insertDeadlocks, func() error {
					// Keep the backlog bounded, so that the run stays about
					// contention on a few keys rather than a growing table.
					tag, err := pool.Exec(tctx, `INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at,
							state, reason, park_holds_key)
						SELECT k, coalesce(s, nextval('deferred_message_seq')), 't', now() + o * interval '1 millisecond',
							CASE WHEN p THEN 'parked' ELSE 'pending' END, CASE WHEN p THEN 'exhausted: test' END, h
						FROM unnest($1::text[], $2::bigint[], $3::int[], $4::bool[], $5::bool[]) AS r (k, s, o, p, h)
						WHERE (SELECT count(*) FROM deferred_message) < 300`, bk, seqs, offs, parked, holds)
					added = tag.RowsAffected()
					return err
				})
				if err != nil {
					failed("insert: %v", err)
					return
				}
				inserted.Add(added)
				if added == 0 {
					time.Sleep(2 * time.Millisecond) // backlog full: wait for dispatch
				}
			}
		}()
	}

	// (b) Dispatch: Lockers claim, "publish", and finalize: mostly published,
	// sometimes the last message parked, sometimes a retriable failure.
	for w := range 3 {
		owner := fmt.Sprintf("locker-%d", w)
		l := newLockerBackoff(t, pool, owner, 30*time.Second, 3, 20*time.Millisecond)
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 2))
			for run.Err() == nil {
				// A claim can deadlock with an operator's statement (see
				// Locker.claim), and runs once more by itself; a second
				// deadlock fails the round, which the loop runs again.
				var claims []keylock.Claim
				err := retryDeadlock(&claimDeadlocks, func() error {
					var err error
					claims, err = l.Claim(tctx, 4)
					return err
				})
				claimEnd := time.Now()
				if err != nil {
					failed("%s: claim: %v", owner, err)
					return
				}
				if len(claims) == 0 {
					time.Sleep(5 * time.Millisecond) // an idle dispatcher's poll interval
					continue
				}
				claimsN.Add(int64(len(claims)))
				var out keylock.Outcome
				batch := make([]hold, len(claims))
				for i, c := range claims {
					h := hold{locker: owner, key: holdKey(c), claimEnd: claimEnd}
					for _, m := range c.Messages {
						h.ids = append(h.ids, m.ID)
					}
					switch r := rng.IntN(10); {
					case r == 0:
						out.Retry = append(out.Retry, c)
						h.retried = true
					case r == 1:
						last := len(h.ids) - 1
						out.Published = append(out.Published, h.ids[:last]...)
						out.Parked = append(out.Parked, keylock.Park{ID: h.ids[last], Reason: "refused"})
					default:
						out.Published = append(out.Published, h.ids...)
					}
					batch[i] = h
				}
				finStart := time.Now()
				if err := retryDeadlock(&finalizeDeadlocks, func() error { return l.Finalize(tctx, claims, out) }); err != nil {
					failed("%s: finalize: %v", owner, err)
					return
				}
				finEnd := time.Now()
				published.Add(int64(len(out.Published)))
				mu.Lock()
				for i := range batch {
					batch[i].finStart, batch[i].finEnd = finStart, finEnd
				}
				holds = append(holds, batch...)
				mu.Unlock()
			}
		}()
	}

	// (c) Operators: plain SQL on random rows.
	const pick = `SELECT id FROM deferred_message WHERE state = 'pending' ORDER BY random() LIMIT `
	for w := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 3))
			for run.Err() == nil {
				key := keys[rng.IntN(len(keys))]
				var sql string
				args := []any{}
				replay, disturb := false, false
				switch rng.IntN(12) {
				case 0:
					sql, args = `UPDATE deferred_message SET next_run_at = now() WHERE business_key = $1 AND state = 'pending'`, []any{key}
				case 1:
					sql = `UPDATE deferred_message SET next_run_at = now() + interval '50 milliseconds' WHERE id IN (` + pick + `2)`
				case 2:
					// Half the parks hold their key (a parked head then
					// blocks the key), half release it.
					sql, disturb = `UPDATE deferred_message SET state = 'parked', reason = 'operator', park_holds_key = random() < 0.5
						WHERE id IN (`+pick+`2) RETURNING id`, true
				case 3:
					sql, replay = `UPDATE deferred_message SET state = 'pending', next_run_at = now()
						WHERE id IN (SELECT id FROM deferred_message WHERE state = 'parked' ORDER BY random() LIMIT 3) RETURNING id`, true
				case 4:
					sql, args, replay = `UPDATE deferred_message SET state = 'pending' WHERE state = 'parked' AND business_key = $1 RETURNING id`, []any{key}, true
				case 5:
					sql, disturb = `DELETE FROM deferred_message WHERE id IN (SELECT id FROM deferred_message ORDER BY random() LIMIT 2) RETURNING id`, true
				case 6:
					sql, args, disturb = `UPDATE deferred_message SET business_key = $1 WHERE id IN (`+pick+`1) RETURNING id`, []any{key}, true
				case 7:
					sql, disturb = `UPDATE deferred_message SET business_key = NULL WHERE id IN (`+pick+`1) RETURNING id`, true
				case 8:
					sql = `UPDATE deferred_message SET seq = seq - 500000 WHERE id IN (` + pick + `1)`
				case 9:
					// Hold or release keys with messages already parked.
					sql = `UPDATE deferred_message SET park_holds_key = NOT park_holds_key
						WHERE id IN (SELECT id FROM deferred_message WHERE state = 'parked' ORDER BY random() LIMIT 2)`
				case 10:
					// Replay the parked messages holding keys: the keys flow again.
					sql, replay = `UPDATE deferred_message SET state = 'pending', next_run_at = now()
						WHERE id IN (SELECT head_id FROM deferred_key WHERE held ORDER BY random() LIMIT 2) RETURNING id`, true
				default:
					sql, args = `UPDATE deferred_message SET error_message = 'still failing' WHERE business_key = $1`, []any{key}
				}
				var ids []int64
				err := retryDeadlock(&opDeadlocks, func() error {
					rows, err := pool.Query(tctx, sql, args...)
					if err != nil {
						return err
					}
					if replay || disturb {
						ids, err = pgx.CollectRows(rows, pgx.RowTo[int64])
						return err
					}
					rows.Close()
					return rows.Err()
				})
				if err != nil {
					failed("operator %s: %v", oneLine(sql), err)
					return
				}
				opStmts.Add(1)
				if len(ids) > 0 {
					mu.Lock()
					for _, id := range ids {
						if replay {
							replayed[id] = true
						} else {
							disturbed[id] = true
						}
					}
					mu.Unlock()
				}
			}
		}()
	}

	// Every committed snapshot must be consistent, not just the final one.
	wg.Add(1)
	go func() {
		defer wg.Done()
		for run.Err() == nil {
			var diff []string
			err := pgx.BeginTxFunc(tctx, pool, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly},
				func(tx pgx.Tx) error {
					var err error
					if diff, err = headsDiff(tctx, tx); err != nil {
						return err
					}
					var held bool
					if err := tx.QueryRow(tctx, "SELECT EXISTS (SELECT FROM deferred_key WHERE held)").Scan(&held); err != nil {
						return err
					}
					if held {
						heldSnapshots.Add(1)
					}
					return nil
				})
			if err != nil {
				failed("snapshot check: %v", err)
				return
			}
			snapshotChecks.Add(1)
			if len(diff) > 0 && snapshotFailures.Add(1) <= 3 {
				t.Errorf("snapshot %d: deferred_key inconsistent: %q", snapshotChecks.Load(), diff)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}()

	wg.Wait()
	t.Logf("%v: inserted %d, claimed %d keys, published %d, %d operator statements, %d snapshot checks",
		runFor, inserted.Load(), claimsN.Load(), published.Load(), opStmts.Load(), snapshotChecks.Load())
	t.Logf("deadlocks retried: ingest %d, claim (twice in a row) %d, finalize %d, operator %d",
		insertDeadlocks.Load(), claimDeadlocks.Load(), finalizeDeadlocks.Load(), opDeadlocks.Load())
	if claimsN.Load() == 0 || published.Load() == 0 || inserted.Load() == 0 {
		t.Fatalf("the run did no work")
	}
	t.Logf("%d of %d snapshots had a key held by a parked message", heldSnapshots.Load(), snapshotChecks.Load())
	if heldSnapshots.Load() == 0 {
		t.Fatalf("no key was ever held by a parked message; the run did not test holding")
	}

	assertHeadsMatch(t, pool)
	var leased int
	if err := pool.QueryRow(tctx, "SELECT count(*) FROM deferred_key WHERE leased_by IS NOT NULL").Scan(&leased); err != nil {
		t.Fatal(err)
	}
	if leased != 0 {
		t.Errorf("%d keys still leased after every claim was finalized", leased)
	}

	// No two holders at once, per key.
	byKey := map[string][]hold{}
	for _, h := range holds {
		byKey[h.key] = append(byKey[h.key], h)
	}
	overlaps, operatorOverlaps := 0, 0
	for k, hs := range byKey {
		slices.SortFunc(hs, func(a, b hold) int { return a.claimEnd.Compare(b.claimEnd) })
		for i := range hs {
			for j := i + 1; j < len(hs) && hs[j].claimEnd.Before(hs[i].finStart); j++ {
				if slices.ContainsFunc(hs[i].ids, func(id int64) bool { return disturbed[id] }) {
					operatorOverlaps++
					continue
				}
				if overlaps++; overlaps <= 5 {
					t.Errorf("key %s held by %s and %s at once: [%v, %v] and [%v, %v]", k,
						hs[i].locker, hs[j].locker, hs[i].claimEnd, hs[i].finStart, hs[j].claimEnd, hs[j].finStart)
				}
			}
		}
	}

	// A message handed out again must have been left pending or replayed.
	byID := map[int64][]hold{}
	for _, h := range holds {
		for _, id := range h.ids {
			byID[id] = append(byID[id], h)
		}
	}
	dups := 0
	for id, hs := range byID {
		slices.SortFunc(hs, func(a, b hold) int { return a.claimEnd.Compare(b.claimEnd) })
		for i := 1; i < len(hs); i++ {
			if hs[i-1].retried || replayed[id] || disturbed[id] {
				continue
			}
			if dups++; dups <= 5 {
				t.Errorf("message %d returned by %s (finalized %v) and again by %s (claimed by %v) without a retry or replay",
					id, hs[i-1].locker, hs[i-1].finEnd, hs[i].locker, hs[i].claimEnd)
			}
		}
	}
	t.Logf("%d holds on %d keys, %d messages claimed, %d replayed; %d concurrent holds after an operator removed a held key's messages",
		len(holds), len(byKey), len(byID), len(replayed), operatorOverlaps)

	var heldKeys int
	if err := pool.QueryRow(tctx, "SELECT count(*) FROM deferred_key WHERE held").Scan(&heldKeys); err != nil {
		t.Fatal(err)
	}
	t.Logf("%d keys held by a parked message at the end", heldKeys)

	// Everything still pending can be drained once no parked message holds
	// its key (keys backing off after a retry become claimable within their
	// 20ms back-off).
	mustExec(t, pool, "UPDATE deferred_message SET park_holds_key = false WHERE state = 'parked'")
	assertHeadsMatch(t, pool)
	mustExec(t, pool, "UPDATE deferred_message SET next_run_at = now() WHERE state = 'pending'")
	drain := newLocker(t, pool, "drain", time.Minute, 100)
	eventually(t, 20*time.Second, "the backlog to drain", func() bool {
		claims, err := drain.Claim(tctx, 100)
		if err != nil {
			t.Fatal(err)
		}
		if len(claims) == 0 {
			var left bool
			if err := pool.QueryRow(tctx, "SELECT EXISTS (SELECT FROM deferred_message WHERE state = 'pending')").Scan(&left); err != nil {
				t.Fatal(err)
			}
			return !left
		}
		var ids []int64
		for _, c := range claims {
			for _, m := range c.Messages {
				ids = append(ids, m.ID)
			}
		}
		if err := drain.Finalize(tctx, claims, keylock.Outcome{Published: ids}); err != nil {
			t.Fatal(err)
		}
		return false
	})
	var pending, keyRows int
	if err := pool.QueryRow(tctx, `SELECT (SELECT count(*) FROM deferred_message WHERE state = 'pending'),
		(SELECT count(*) FROM deferred_key)`).Scan(&pending, &keyRows); err != nil {
		t.Fatal(err)
	}
	if pending != 0 || keyRows != 0 {
		t.Errorf("after draining: %d pending messages, %d key rows; want none", pending, keyRows)
	}
}

// TestPerKeyOrderThroughClaim: messages of many keys, later seqs due
// earlier and inserted in random order, claimed and published by several
// Lockers at once until none is left, come out of Claim in seq order per key,
// each exactly once.
func TestPerKeyOrderThroughClaim(t *testing.T) {
	const nKeys, perKey = 40, 12
	db := pgtest.NewDB(t)
	pool := bigPool(t, db.URL, 12)

	type msg struct {
		key string
		seq int64
		in  int32 // due in this many milliseconds
	}
	var msgs []msg
	for k := range nKeys {
		for i := range perKey {
			// seq 1 is due last: nothing of a key may go before it.
			msgs = append(msgs, msg{fmt.Sprintf("key-%02d", k), int64(k*100 + i + 1), int32((perKey - i) * 15)})
		}
	}
	rand.Shuffle(len(msgs), func(i, j int) { msgs[i], msgs[j] = msgs[j], msgs[i] })
	// Insert in several statements of shuffled messages.
	for start := 0; start < len(msgs); start += 50 {
		end := min(start+50, len(msgs))
		var ks []string
		var seqs []int64
		var ins []int32
		for _, m := range msgs[start:end] {
			ks, seqs, ins = append(ks, m.key), append(seqs, m.seq), append(ins, m.in)
		}
		mustExec(t, pool, `INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at)
			SELECT k, s, 't', now() + i * interval '1 millisecond' FROM unnest($1::text[], $2::bigint[], $3::int[]) AS r (k, s, i)`,
			ks, seqs, ins)
	}
	assertHeadsMatch(t, pool)

	var (
		mu  sync.Mutex
		out = map[string][]int64{} // key -> seqs in the order claims returned them
		wg  sync.WaitGroup
	)
	deadline := time.Now().Add(30 * time.Second)
	for w := range 4 {
		l := newLocker(t, pool, fmt.Sprintf("w%d", w), time.Minute, 1+w) // different batch sizes
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Now().Before(deadline) {
				claims, err := l.Claim(t.Context(), 5)
				if err != nil {
					t.Errorf("claim: %v", err)
					return
				}
				if len(claims) == 0 {
					var left int
					if err := pool.QueryRow(t.Context(), "SELECT count(*) FROM deferred_message").Scan(&left); err != nil {
						t.Errorf("count: %v", err)
						return
					}
					if left == 0 {
						return
					}
					time.Sleep(2 * time.Millisecond) // poll interval while the rest is not due
					continue
				}
				var ids []int64
				mu.Lock()
				for _, c := range claims {
					for _, m := range c.Messages {
						out[c.BusinessKey] = append(out[c.BusinessKey], m.Seq)
						ids = append(ids, m.ID)
					}
				}
				mu.Unlock()
				if err := l.Finalize(t.Context(), claims, keylock.Outcome{Published: ids}); err != nil {
					t.Errorf("finalize: %v", err)
					return
				}
			}
			t.Errorf("not drained within the deadline")
		}()
	}
	wg.Wait()

	if len(out) != nKeys {
		t.Errorf("messages of %d keys came out, want %d", len(out), nKeys)
	}
	for k, seqs := range out {
		want := make([]int64, perKey)
		base := seqs[0] - seqs[0]%100
		for i := range want {
			want[i] = base + int64(i) + 1
		}
		if !slices.Equal(seqs, want) {
			t.Errorf("key %s came out as seqs %v, want %v", k, seqs, want)
		}
	}
}
