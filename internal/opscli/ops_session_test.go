package opscli

import (
	"context"
	"errors"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/deferq/scheduler/internal/pgtest"
)

// An operator command's transactions time out locks and statements by
// default, and take the timeouts DATABASE_URL sets instead, in either form
// (README, "Session settings"). The defaults are set in each transaction,
// for it alone: as startup parameters a pooler would refuse them.
//
// Its transactions are READ COMMITTED, which the head triggers need, over
// the database's default of REPEATABLE READ here; a URL that asks for
// another level is refused.
func TestOpsSessionSettings(t *testing.T) {
	db := pgtest.NewDB(t)
	db.SetDefault(t, "default_transaction_isolation", "repeatable read")
	for _, tt := range []struct {
		name, query              string // query: added to the URL; empty: none
		lockTimeout, stmtTimeout string
	}{
		{"defaults", "", "5s", "30s"},
		{"parameters of their own", "lock_timeout=1s&statement_timeout=2min", "1s", "2min"},
		{"in options", "options=-c%20statement_timeout%3D10min", "5s", "10min"},
		{"in options, long form", "options=--lock-timeout%3D2s%20-c%20jit%3Doff", "2s", "30s"},
		{"something else in options", "options=-c%20work_mem%3D8MB", "5s", "30s"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			dbURL := db.URL
			if tt.query != "" {
				dbURL = pgtest.WithQuery(t, db.URL, tt.query)
			}
			o, _ := newOps("status", nil, io.Discard, io.Discard)
			conn, err := o.connect(ctx, []string{"DATABASE_URL=" + dbURL})
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close(ctx)
			// What a command's transaction has, as every command's
			// statements run in one.
			var lock, stmt, app, level string
			if err := o.inTx(ctx, conn, readCommitted(), func(tx pgx.Tx) error {
				return tx.QueryRow(ctx, "SELECT current_setting('lock_timeout'), current_setting('statement_timeout'), "+
					"current_setting('application_name'), current_setting('transaction_isolation')").
					Scan(&lock, &stmt, &app, &level)
			}); err != nil {
				t.Fatal(err)
			}
			// And for that transaction alone: nothing stays on the
			// session, which behind a pooler is other clients' too.
			var after string
			if err := conn.QueryRow(ctx, "SELECT current_setting('lock_timeout')").Scan(&after); err != nil {
				t.Fatal(err)
			}
			if !strings.Contains(tt.query, "lock") && after != "0" {
				t.Errorf("lock_timeout after the transaction %s, want the server's 0", after)
			}
			if level != "read committed" {
				t.Errorf("transaction_isolation %q, want read committed", level)
			}
			if lock != tt.lockTimeout || stmt != tt.stmtTimeout {
				t.Errorf("with %q: lock_timeout %s, statement_timeout %s; want %s, %s", tt.query, lock, stmt, tt.lockTimeout, tt.stmtTimeout)
			}
			if app != "defer-scheduler-status" {
				t.Errorf("application_name %q, want defer-scheduler-status", app)
			}
		})
	}

	// A URL that asks for another level: refused before connecting, as a
	// mistake in how the command was called.
	o, _ := newOps("status", nil, io.Discard, io.Discard)
	_, err := o.connect(t.Context(), []string{"DATABASE_URL=" + pgtest.WithQuery(t, db.URL, "options=-c%20default_transaction_isolation%3Dserializable")})
	var ue usageError
	if !errors.As(err, &ue) || !strings.Contains(err.Error(), "DATABASE_URL sets default_transaction_isolation=serializable; the scheduler needs read committed") {
		t.Errorf("connect with serializable: %v; want a usage error naming the setting", err)
	}
}
