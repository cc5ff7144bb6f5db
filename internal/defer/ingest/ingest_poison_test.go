package ingest

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/deferq/scheduler/internal/pgtest"
)

func TestPoison(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want bool
	}{
		{&pgconn.PgError{Code: pgerrcode.RaiseException}, true},
		{&pgconn.PgError{Code: pgerrcode.StringDataRightTruncationDataException}, true},
		{&pgconn.PgError{Code: pgerrcode.CheckViolation}, true},
		{&pgconn.PgError{Code: pgerrcode.ProgramLimitExceeded}, true},
		{fmt.Errorf("store: %w", &pgconn.PgError{Code: pgerrcode.InvalidTextRepresentation}), true}, // wrapped
		{&pgconn.PgError{Code: pgerrcode.UniqueViolation}, false},                                   // a race, retried
		{&pgconn.PgError{Code: pgerrcode.SerializationFailure}, false},
		{&pgconn.PgError{Code: pgerrcode.AdminShutdown}, false},
		{&pgconn.PgError{Code: pgerrcode.ReadOnlySQLTransaction}, false},
		{errors.New("dial tcp: connection refused"), false},
		{context.DeadlineExceeded, false},
	} {
		if got := poison(tc.err); got != tc.want {
			t.Errorf("poison(%v) = %v, want %v", tc.err, got, tc.want)
		}
	}
}

// poisonTrigger makes the database refuse, with a raise, any row whose value
// is marker; with rejectedToo it refuses the row even as rejected, so that
// not even store_failed gets it in.
func poisonTrigger(ctx context.Context, t *testing.T, exec func(context.Context, string, ...any) (pgconn.CommandTag, error), marker string, rejectedToo bool) {
	t.Helper()
	cond := "NEW.value = convert_to('" + marker + "', 'UTF8')"
	if !rejectedToo {
		cond += " AND NEW.state <> 'rejected'"
	}
	for _, q := range []string{
		`CREATE OR REPLACE FUNCTION poison_test() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF ` + cond + ` THEN
        RAISE EXCEPTION 'poison record %', NEW.source_offset;
    END IF;
    RETURN NEW;
END $$`,
		`DROP TRIGGER IF EXISTS poison_test ON deferred_message`,
		`CREATE TRIGGER poison_test BEFORE INSERT ON deferred_message FOR EACH ROW EXECUTE FUNCTION poison_test()`,
	} {
		if _, err := exec(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
}

// TestIngestPoisonBatch checks that a batch the database refuses because of
// one record is stored record by record, the refused record as rejected with
// reason store_failed, and that the partition goes on.
func TestIngestPoisonBatch(t *testing.T) {
	db := pgtest.NewDB(t)
	k := newKafka(t)
	ctx := t.Context()
	poisonTrigger(ctx, t, db.Pool.Exec, "poison", false)

	var msgs []*sarama.ProducerMessage
	for i := range 5 {
		msgs = append(msgs, validRec(1, fmt.Sprintf("k-%d", i), fmt.Sprintf("good-%d", i)))
	}
	bad := validRec(1, "k-2", "poison")
	msgs = append(msgs[:3], append([]*sarama.ProducerMessage{bad}, msgs[3:]...)...)
	k.produce(t, msgs...)

	r := startIngester(ctx, t, k, db.Pool, "ingest-poison", IngestConfig{BatchSize: 100, BatchLinger: 50 * time.Millisecond}, nil)
	waitRows(t, db.Pool, int64(len(msgs)), 30*time.Second)

	got := rowAt(t, db.Pool, 1, bad.Offset)
	reason := ""
	if got.Reason != nil {
		reason = *got.Reason
	}
	if got.State != "rejected" || !strings.HasPrefix(reason, "store_failed: ") || !strings.Contains(reason, fmt.Sprintf("poison record %d", bad.Offset)) {
		t.Errorf("the poison record: state %q, reason %q; want rejected with store_failed and the raise", got.State, reason)
	}
	if string(got.Value) != "poison" || string(got.Key) != "k-2" {
		t.Errorf("the poison record kept key %q value %q, want k-2 and poison", got.Key, got.Value)
	}
	for _, m := range msgs {
		if m == bad {
			continue
		}
		if row := rowAt(t, db.Pool, 1, m.Offset); row.State != "pending" {
			t.Errorf("offset %d: state %q, want pending", m.Offset, row.State)
		}
	}
	waitFor(t, 10*time.Second, "the offset committed past the batch", func() (bool, string) {
		c := k.committed(t, "ingest-poison")
		return c[1] == int64(len(msgs)), fmt.Sprintf("committed %v", c)
	})
	if s, rj, d := r.in.Counts(); s != int64(len(msgs)) || rj != 1 || d != 0 {
		t.Errorf("Counts() = %d, %d, %d; want %d, 1, 0", s, rj, d, len(msgs))
	}
	if err := r.in.StoreError(); err != nil {
		t.Errorf("StoreError() = %v after the batch was stored", err)
	}
}

// TestIngestPoisonUnstorable checks that a record the database refuses even
// as rejected holds its partition (offsets not committed, nothing skipped)
// and shows in StoreError, and that the partition resumes once the database
// takes it.
func TestIngestPoisonUnstorable(t *testing.T) {
	db := pgtest.NewDB(t)
	k := newKafka(t)
	ctx := t.Context()
	poisonTrigger(ctx, t, db.Pool.Exec, "poison", true)

	first := validRec(2, "k-1", "good-1")
	bad := validRec(2, "k-2", "poison")
	last := validRec(2, "k-3", "good-3")
	k.produce(t, first)
	k.produce(t, bad, last)

	r := startIngester(ctx, t, k, db.Pool, "ingest-unstorable", IngestConfig{BatchSize: 100, BatchLinger: 50 * time.Millisecond}, nil)
	waitFor(t, 30*time.Second, "a store error reported", func() (bool, string) {
		err := r.in.StoreError()
		return err != nil && strings.Contains(err.Error(), "poison record"), fmt.Sprintf("StoreError() = %v", err)
	})
	// Records before the refused one may be stored (one by one); the refused
	// one and those after it are not, and the committed offset stays before
	// the refused record.
	if n := len(readRows(t, db.Pool, "source_partition = 2 AND source_offset >= $1", bad.Offset)); n != 0 {
		t.Errorf("%d rows at or after the refused record, want 0", n)
	}
	if c := k.committed(t, "ingest-unstorable"); c[2] > bad.Offset {
		t.Errorf("committed offset %d past the refused record at %d", c[2], bad.Offset)
	}

	if _, err := db.Pool.Exec(ctx, "DROP TRIGGER poison_test ON deferred_message"); err != nil {
		t.Fatal(err)
	}
	waitRows(t, db.Pool, 3, 30*time.Second)
	if row := rowAt(t, db.Pool, 2, bad.Offset); row.State != "pending" {
		t.Errorf("the once refused record: state %q, want pending", row.State)
	}
	waitFor(t, 10*time.Second, "the store error cleared", func() (bool, string) {
		err := r.in.StoreError()
		return err == nil, fmt.Sprintf("StoreError() = %v", err)
	})
}
