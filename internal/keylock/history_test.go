package keylock_test

import (
	"fmt"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/deferq/scheduler/internal/keylock"
	"github.com/deferq/scheduler/internal/operate"
	"github.com/deferq/scheduler/internal/pgtest"
)

// The history of a message stored pending has no row of its own until
// something else happens to it (migration 0012): its delivery folds the
// deferral into the 'published' row, and anything else (an operator's
// update or delete, a park) first writes the deferral as a row of its own,
// from the row as it was. TestFoldedDeferral drives each path through the
// statements that take it (dispatch's claim and finalize, an operator's
// plain SQL) and reads the history as operators do: history.sql, the view
// deferred_history, and deferred_attempt's rows.
func TestFoldedDeferral(t *testing.T) {
	db := pgtest.NewDB(t)
	ctx := t.Context()

	// insert stores a pending message of its own key, due dueIn from now,
	// deferred for a Timeout, with origin as its defer.id (0: none), and
	// returns its id and created_at.
	insert := func(t *testing.T, key string, dueIn time.Duration, origin int64, gated bool) (int64, time.Time) {
		t.Helper()
		var id int64
		var created time.Time
		if err := db.Pool.QueryRow(ctx, `INSERT INTO deferred_message (business_key, target_topic, next_run_at,
				attempt, error_class, error_message, origin_id, gated)
			VALUES ($1, 't', now() + $2::interval, $3, 'Timeout', 'read timed out', nullif($4, 0), $5)
			RETURNING id, created_at`, key, dueIn, map[bool]int{true: 1}[origin != 0], origin, gated).Scan(&id, &created); err != nil {
			t.Fatal(err)
		}
		return id, created
	}
	// insertParked stores a message parked at ingest (out of retries), as
	// a re-deferral of origin.
	insertParked := func(t *testing.T, key string, origin int64) int64 {
		t.Helper()
		var id int64
		if err := db.Pool.QueryRow(ctx, `INSERT INTO deferred_message (business_key, target_topic, next_run_at,
				attempt, state, reason, error_class, error_message, origin_id, parked_at)
			VALUES ($1, 't', now(), 2, 'parked', 'exhausted: 2 retries made', 'Timeout', 'read timed out', $2, now())
			RETURNING id`, key, origin).Scan(&id); err != nil {
			t.Fatal(err)
		}
		return id
	}
	// deliverWith claims the due heads, runs meanwhile (if not nil) as a
	// consumer would between the publish and the finalize, and finalizes
	// them as published (at partition 2, offset 40 + i) or, for the ids in
	// park, parked.
	deliverWith := func(t *testing.T, meanwhile func(*testing.T), park ...int64) {
		t.Helper()
		l := newLocker(t, db.Pool, "history", time.Minute, 10)
		claims, err := l.Claim(ctx, 10)
		if err != nil {
			t.Fatal(err)
		}
		if meanwhile != nil {
			meanwhile(t)
		}
		var out keylock.Outcome
		for _, c := range claims {
			for _, m := range c.Messages {
				if slices.Contains(park, m.ID) {
					out.Parked = append(out.Parked, keylock.Park{ID: m.ID, Reason: "unknown_topic: no such topic"})
					continue
				}
				out.Published = append(out.Published, m.ID)
				out.Placements = append(out.Placements, keylock.Placement{Partition: 2, Offset: 40 + int64(len(out.Published))})
			}
		}
		if err := l.Finalize(ctx, claims, out); err != nil {
			t.Fatal(err)
		}
	}
	deliver := func(t *testing.T, park ...int64) {
		t.Helper()
		deliverWith(t, nil, park...)
	}
	// operator runs sql as an operator named alice.
	operator := func(t *testing.T, sql string, args ...any) {
		t.Helper()
		if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
			if err := operate.SetActor(ctx, tx, "cli:alice"); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, sql, args...)
			return err
		}); err != nil {
			t.Fatal(err)
		}
	}

	tests := []struct {
		name string
		// run stores and handles the message(s); it returns the id whose
		// history is read, and when that message was stored.
		run func(t *testing.T) (int64, time.Time)
		// want is the lineage's history as history.sql prints it: one
		// "message event attempt error actor" per event, messages named
		// by their order of insertion (m1, m2).
		want []string
		// rows is how many rows the lineage has in deferred_attempt.
		rows int
	}{
		{
			name: "pending, nothing else happened: no row, the view has the deferral",
			run: func(t *testing.T) (int64, time.Time) {
				return insert(t, "k-pending", time.Hour, 0, false)
			},
			want: []string{"m1 deferred 0 Timeout -"},
			rows: 0,
		},
		{
			name: "delivered: one row, the deferral folded into the delivery",
			run: func(t *testing.T) (int64, time.Time) {
				id, at := insert(t, "k-delivered", -time.Second, 0, false)
				deliver(t)
				return id, at
			},
			want: []string{"m1 deferred 0 Timeout -", "m1 published 1 - -"},
			rows: 1,
		},
		{
			name: "expedited, then delivered: the deferral as stored, before the expedite",
			run: func(t *testing.T) (int64, time.Time) {
				id, at := insert(t, "k-expedited", time.Hour, 0, false)
				operator(t, "UPDATE deferred_message SET next_run_at = now() - interval '1 second' WHERE id = $1", id)
				deliver(t)
				return id, at
			},
			want: []string{"m1 deferred 0 Timeout -", "m1 expedited 0 Timeout cli:alice", "m1 published 1 - -"},
			rows: 3,
		},
		{
			name: "edited without an event, then delivered: the deferral keeps the error as stored",
			run: func(t *testing.T) (int64, time.Time) {
				id, at := insert(t, "k-edited", -time.Second, 0, false)
				operator(t, "UPDATE deferred_message SET error_class = 'Edited' WHERE id = $1", id)
				deliver(t)
				return id, at
			},
			want: []string{"m1 deferred 0 Timeout -", "m1 published 1 - -"},
			rows: 2,
		},
		{
			name: "cancelled by an operator",
			run: func(t *testing.T) (int64, time.Time) {
				id, at := insert(t, "k-cancelled", time.Hour, 0, false)
				operator(t, "DELETE FROM deferred_message WHERE id = $1", id)
				return id, at
			},
			want: []string{"m1 deferred 0 Timeout -", "m1 cancelled 0 Timeout cli:alice"},
			rows: 2,
		},
		{
			name: "parked by dispatch (the broker refused it), then replayed and delivered",
			run: func(t *testing.T) (int64, time.Time) {
				id, at := insert(t, "k-parked", -time.Second, 0, false)
				deliver(t, id)
				operator(t, "UPDATE deferred_message SET state = 'pending', next_run_at = now() - interval '1 second' WHERE id = $1", id)
				deliver(t)
				return id, at
			},
			want: []string{"m1 deferred 0 Timeout -", "m1 parked 0 Timeout -", "m1 replayed 0 Timeout cli:alice",
				"m1 published 1 - -"},
			rows: 4,
		},
		{
			name: "gated: a row at once, delivered without folding",
			run: func(t *testing.T) (int64, time.Time) {
				id, at := insert(t, "k-gated", -time.Second, 0, true)
				deliver(t)
				return id, at
			},
			want: []string{"m1 gated 0 Timeout -", "m1 published 1 - -"},
			rows: 2,
		},
		{
			name: "a re-deferral pending: in its origin's lineage, found by origin",
			run: func(t *testing.T) (int64, time.Time) {
				first, at := insert(t, "k-redeferred", -time.Second, 0, false)
				deliver(t)
				insert(t, "k-redeferred", time.Hour, first, false)
				return first, at
			},
			want: []string{"m1 deferred 0 Timeout -", "m1 published 1 - -", "m2 deferred 1 Timeout -"},
			rows: 1,
		},
		{
			// The consumer re-defers a record as soon as it reads it, so a
			// re-deferral can be stored before the finalize that published
			// its origin commits: the origin has its row then, but no
			// history. The re-deferral's lineage is its origin's all the
			// same. (Caught by TestPolicyWalksLadderToParkingLotAndBack in
			// CI: a parked re-deferral in a lineage of its own.)
			name: "a re-deferral parked at ingest before its origin's delivery is finalized",
			run: func(t *testing.T) (int64, time.Time) {
				first, at := insert(t, "k-quick", -time.Second, 0, false)
				deliver(t)
				second, _ := insert(t, "k-quick-2", -time.Second, first, false)
				insertParked(t, "k-quick-3", second)
				deliver(t)
				return first, at
			},
			want: []string{"m1 deferred 0 Timeout -", "m1 published 1 - -", "m2 deferred 1 Timeout -", "m3 parked 2 Timeout -",
				"m2 published 2 - -"},
			rows: 3,
		},
		{
			// A consumer reads the record, fails it again and re-defers it,
			// and ingest stores that, all before the finalize of the
			// delivery begins. The delivery is recorded at its claim, so
			// it still comes before the deferral it caused. (Caught by
			// TestPolicyWalksLadderToParkingLotAndBack in CI: recorded at
			// the finalize, published@1 came after deferred@1.)
			name: "a re-deferral stored before its origin's delivery is finalized: the delivery first",
			run: func(t *testing.T) (int64, time.Time) {
				first, at := insert(t, "k-fast-consumer", -time.Second, 0, false)
				deliverWith(t, func(t *testing.T) {
					insert(t, "k-fast-consumer", time.Hour, first, false)
				})
				return first, at
			},
			want: []string{"m1 deferred 0 Timeout -", "m1 published 1 - -", "m2 deferred 1 Timeout -"},
			rows: 1,
		},
		{
			name: "a re-deferral delivered: its folded row in its origin's lineage",
			run: func(t *testing.T) (int64, time.Time) {
				first, at := insert(t, "k-redelivered", -time.Second, 0, false)
				deliver(t)
				insert(t, "k-redelivered", -time.Second, first, false)
				deliver(t)
				return first, at
			},
			want: []string{"m1 deferred 0 Timeout -", "m1 published 1 - -", "m2 deferred 1 Timeout -", "m2 published 2 - -"},
			rows: 2,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			id, created := tt.run(t)
			history, err := operate.Rows[operate.HistoryRow](ctx, db.Pool, "history.sql", map[string]string{"id": strconv.FormatInt(id, 10)})
			if err != nil {
				t.Fatal(err)
			}
			names := map[int64]string{}
			var got []string
			for _, h := range history {
				if h.LineageID != id {
					t.Errorf("%s of message %d is in lineage %d, want %d", h.Event, h.MessageID, h.LineageID, id)
				}
				if _, ok := names[h.MessageID]; !ok {
					names[h.MessageID] = fmt.Sprintf("m%d", len(names)+1)
				}
				got = append(got, fmt.Sprintf("%s %s %d %s %s", names[h.MessageID], h.Event, h.Attempt, str(h.ErrorClass), str(h.Actor)))
				if h.MessageID == id && h.Event == "deferred" && !h.RecordedAt.Equal(created) {
					t.Errorf("the deferral of %d is recorded at %v, want its created_at %v", id, h.RecordedAt, created)
				}
				if h.Event == "published" && (h.Partition == nil || *h.Partition != 2 || h.RecordOffset == nil) {
					t.Errorf("the delivery of %d has partition %v and offset %v, want where the broker put it", h.MessageID, h.Partition, h.RecordOffset)
				}
			}
			if !slices.Equal(got, tt.want) {
				t.Errorf("history.sql:\n got %q\nwant %q", got, tt.want)
			}
			if n := historyRowsOf(t, db.Pool, id); n != tt.rows {
				t.Errorf("%d rows of the lineage in deferred_attempt, want %d", n, tt.rows)
			}
			// The view has the same events, read by message.
			var viewed []string
			rows, err := db.Pool.Query(ctx, `SELECT message_id, event FROM deferred_history
				WHERE message_id IN (SELECT message_id FROM deferred_lineage_history($1))
				ORDER BY recorded_at, id NULLS LAST, event <> 'deferred'`, id)
			if err != nil {
				t.Fatal(err)
			}
			var mid int64
			var event string
			if _, err := pgx.ForEachRow(rows, []any{&mid, &event}, func() error {
				viewed = append(viewed, names[mid]+" "+event)
				return nil
			}); err != nil {
				t.Fatal(err)
			}
			var fromRunbook []string
			for _, g := range got {
				var m, e string
				fmt.Sscan(g, &m, &e)
				fromRunbook = append(fromRunbook, m+" "+e)
			}
			if !slices.Equal(viewed, fromRunbook) {
				t.Errorf("deferred_history by message: %q, want history.sql's %q", viewed, fromRunbook)
			}
		})
	}
}

// historyRowsOf counts the rows of deferred_attempt in lineage.
func historyRowsOf(t *testing.T, pool *pgxpool.Pool, lineage int64) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(t.Context(), "SELECT count(*) FROM deferred_attempt WHERE lineage_id = $1", lineage).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// str prints a nullable text column, "-" for NULL.
func str(s *string) string {
	if s == nil {
		return "-"
	}
	return *s
}

// TestDeliveryRecordedAtItsClaim: both claims (the main one and a
// rate-limited target's) say when they ran, and the finalize records each
// delivery at its own claim's time, even when one finalize holds messages
// of both, claimed in separate transactions.
func TestDeliveryRecordedAtItsClaim(t *testing.T) {
	db := pgtest.NewDB(t)
	ctx := t.Context()
	mustExec(t, db.Pool, `INSERT INTO deferred_message (business_key, target_topic, next_run_at) VALUES
		('free-key', 'free', now() - interval '1 second'), ('lim-key', 'lim', now() - interval '1 second')`)
	mustExec(t, db.Pool, `INSERT INTO target_control (target_topic, rate_limit) VALUES ('lim', 100)`)
	l := newLocker(t, db.Pool, "recorded", time.Minute, 10)

	var claims []keylock.Claim
	for _, claim := range []struct {
		name string
		run  func() ([]keylock.Claim, error)
	}{
		{"main", func() ([]keylock.Claim, error) { return l.Claim(ctx, 10) }},
		{"rate-limited target", func() ([]keylock.Claim, error) {
			return l.ClaimTarget(ctx, 10, "lim", keylock.DefaultMaxBytes)
		}},
	} {
		got, err := claim.run()
		if err != nil {
			t.Fatal(err)
		}
		if len(got) != 1 || len(got[0].Messages) != 1 {
			t.Fatalf("%s claim: %d claims, want one with one message", claim.name, len(got))
		}
		if got[0].Messages[0].ClaimedAt.IsZero() {
			t.Errorf("%s claim: ClaimedAt is zero", claim.name)
		}
		claims = append(claims, got...)
	}
	// The finalize's now() is later than either claim's.
	time.Sleep(20 * time.Millisecond)
	var out keylock.Outcome
	for _, c := range claims {
		out.Published = append(out.Published, c.Messages[0].ID)
		out.Placements = append(out.Placements, keylock.Placement{Partition: 0, Offset: int64(len(out.Published))})
	}
	if err := l.Finalize(ctx, claims, out); err != nil {
		t.Fatal(err)
	}
	for _, c := range claims {
		m := c.Messages[0]
		var at time.Time
		if err := db.Pool.QueryRow(ctx, `SELECT recorded_at FROM deferred_attempt
			WHERE message_id = $1 AND event = 'published'`, m.ID).Scan(&at); err != nil {
			t.Fatalf("the delivery of %s: %v", c.BusinessKey, err)
		}
		if !at.Equal(m.ClaimedAt) {
			t.Errorf("the delivery of %s is recorded at %v, want its claim's time %v", c.BusinessKey, at, m.ClaimedAt)
		}
	}
	if claims[0].Messages[0].ClaimedAt.Equal(claims[1].Messages[0].ClaimedAt) {
		t.Errorf("both claims report %v: the check above cannot tell them apart", claims[0].Messages[0].ClaimedAt)
	}
}
