package keylock_test

import (
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/deferq/scheduler/internal/pgtest"
)

// TestHeadsNeedReadCommitted: an operator who cancels a key's head in a
// REPEATABLE READ transaction while ingest stores the key's next message.
// The head trigger locks the key's row and reads deferred_message again to
// find the next head, but REPEATABLE READ reads with the transaction's
// first snapshot, which predates the new message: before migration 0020 the
// key's row was deleted and the new message stayed pending with no head,
// never to be claimed. Now the statement is refused, and changes nothing;
// the same cancel in READ COMMITTED makes the new message the head.
func TestHeadsNeedReadCommitted(t *testing.T) {
	for _, tt := range []struct {
		level pgx.TxIsoLevel
		// refused: the cancel fails with SQLSTATE 0A000; otherwise it
		// commits and the next message is the head.
		refused bool
	}{
		{pgx.RepeatableRead, true},
		{pgx.Serializable, true},
		{pgx.ReadCommitted, false},
	} {
		t.Run(string(tt.level), func(t *testing.T) {
			db := pgtest.NewDB(t)
			ctx := t.Context()
			mustExec(t, db.Pool, `INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at)
				VALUES ('k', 1, 't', now() + interval '1 hour')`)

			operator, err := db.Pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: tt.level})
			if err != nil {
				t.Fatal(err)
			}
			defer operator.Rollback(ctx)
			// The operator looks before cancelling: the snapshot is taken.
			var first int64
			if err := operator.QueryRow(ctx, `SELECT id FROM deferred_message WHERE business_key = 'k'`).Scan(&first); err != nil {
				t.Fatal(err)
			}
			// Ingest stores the key's next message meanwhile.
			mustExec(t, db.Pool, `INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at)
				VALUES ('k', 2, 't', now() + interval '1 hour')`)

			_, err = operator.Exec(ctx, `DELETE FROM deferred_message WHERE id = $1`, first)
			if !tt.refused {
				if err != nil {
					t.Fatalf("cancel in %s: %v", tt.level, err)
				}
				if err := operator.Commit(ctx); err != nil {
					t.Fatal(err)
				}
				assertHeadsMatch(t, db.Pool)
				if got, want := headSummary(t, db.Pool), []string{"k@2"}; !slices.Equal(got, want) {
					t.Fatalf("heads %q after the cancel, want %q", got, want)
				}
				return
			}
			var pe *pgconn.PgError
			if !errors.As(err, &pe) || pe.Code != "0A000" {
				t.Fatalf("cancel in %s: err %v, want SQLSTATE 0A000", tt.level, err)
			}
			for _, want := range []string{"deferred_message can be changed only in a READ COMMITTED transaction",
				"this transaction is " + strings.ToUpper(string(tt.level))} {
				if !strings.Contains(pe.Message, want) {
					t.Errorf("message %q does not say %q", pe.Message, want)
				}
			}
			if !strings.Contains(pe.Hint, "BEGIN ISOLATION LEVEL READ COMMITTED") {
				t.Errorf("hint %q does not give the fix", pe.Hint)
			}
			if err := operator.Rollback(ctx); err != nil {
				t.Fatal(err)
			}
			assertHeadsMatch(t, db.Pool)
			if got, want := headSummary(t, db.Pool), []string{"k@1"}; !slices.Equal(got, want) {
				t.Fatalf("heads %q after the refused cancel, want %q", got, want)
			}
		})
	}
}

// TestEveryHeadWriterNeedsReadCommitted: each kind of statement whose
// triggers write deferred_key is refused outside READ COMMITTED, whether
// the transaction asked for it or the database's default gave it, and runs
// under READ COMMITTED (and READ UNCOMMITTED, the same in PostgreSQL).
func TestEveryHeadWriterNeedsReadCommitted(t *testing.T) {
	db := pgtest.NewDB(t)
	ctx := t.Context()
	mustExec(t, db.Pool, `INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at)
		VALUES ('k', 1, 't', now() + interval '1 hour'), ('j', 2, 't', now())`)
	mustExec(t, db.Pool, `INSERT INTO deferred_inflight (group_id, business_key, target_topic, partition, record_offset, message_id, seq)
		VALUES ('g', 'j', 't', 0, 7, 99, 2)`)
	writes := []struct{ table, sql string }{
		{"deferred_message", `INSERT INTO deferred_message (business_key, seq, target_topic, next_run_at) VALUES ('k', 3, 't', now())`},
		{"deferred_message", `UPDATE deferred_message SET next_run_at = now() WHERE business_key = 'k'`},
		{"deferred_message", `DELETE FROM deferred_message WHERE business_key = 'k'`},
		{"deferred_inflight", `DELETE FROM deferred_inflight WHERE business_key = 'j'`},
		{"target_control", `INSERT INTO target_control (target_topic, paused) VALUES ('t', true)`},
	}
	run := func(t *testing.T, conn *pgx.Conn, opts pgx.TxOptions, sql string) error {
		t.Helper()
		tx, err := conn.BeginTx(ctx, opts)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx) // each write is tried, never kept
		_, err = tx.Exec(ctx, sql)
		return err
	}
	conn, err := pgx.Connect(ctx, db.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	for _, w := range writes {
		for _, level := range []pgx.TxIsoLevel{pgx.ReadCommitted, pgx.ReadUncommitted} {
			if err := run(t, conn, pgx.TxOptions{IsoLevel: level}, w.sql); err != nil {
				t.Errorf("%s in %s: %v", w.sql, level, err)
			}
		}
		for _, level := range []pgx.TxIsoLevel{pgx.RepeatableRead, pgx.Serializable} {
			err := run(t, conn, pgx.TxOptions{IsoLevel: level}, w.sql)
			var pe *pgconn.PgError
			if !errors.As(err, &pe) || pe.Code != "0A000" || !strings.Contains(pe.Message, w.table+" can be changed only") {
				t.Errorf("%s in %s: err %v, want SQLSTATE 0A000 naming %s", w.sql, level, err, w.table)
			}
		}
	}

	// A database whose default is stricter: a plain statement, no BEGIN.
	db.SetDefault(t, "default_transaction_isolation", "repeatable read")
	strict, err := pgx.Connect(ctx, db.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer strict.Close(ctx)
	_, err = strict.Exec(ctx, writes[0].sql)
	var pe *pgconn.PgError
	if !errors.As(err, &pe) || pe.Code != "0A000" || !strings.Contains(pe.Message, "this transaction is REPEATABLE READ") {
		t.Errorf("an insert under the database's default of repeatable read: err %v, want SQLSTATE 0A000", err)
	}
	assertHeadsMatch(t, db.Pool)
}
